//! OpenAI Chat Completions, `POST /v1/chat/completions`: the checks done in Rust before any Python runs (JSON shape,
//! model, the features the service does not offer, and the normalizations deepseek-recipe leaves to the server;
//! the messages' shapes are `checks`). Everything else (messages, sampling ranges, tools) is validated by
//! deepseek-recipe in the codec.

mod checks;

use super::fields::{self, integer, items, kind, model_of, opt_bool, opt_u64};
use super::request::images_of;
use super::tools::{self, ForcedTool, Tools, tool_choice};
use super::{Body, GenerateRequest, PinThinking, Served, Spec, Split, sse};
use crate::error::ApiError;
use crate::media::ImageRef;
use bytes::BytesMut;
use serde_json::{Map, Value};

pub struct Chat;

impl Spec for Chat {
    const PATH: &'static str = "/v1/chat/completions";
    const NAME: &'static str = "chat";
    const CODE: u8 = 0;
    const ID_PREFIX: &'static str = "chatcmpl-";
    const DONE: &'static [u8] = sse::DONE;
    const KEEP_ALIVE: &'static [u8] = sse::KEEP_ALIVE;
    const PIN_THINKING: Option<PinThinking> = Some(pin_thinking);
    const FANS_OUT: bool = true;

    fn split(body: Value, request_id: &str, raw_len: usize, bounds: (usize, usize)) -> Result<Split, ApiError> {
        super::choices::split(body, request_id, raw_len, bounds)
    }

    fn parse(body: Body, served: Served<'_>) -> Result<GenerateRequest, ApiError> {
        parse(body, served)
    }

    /// `image_url` parts of the messages' content.
    fn image_refs(body: &Value) -> Vec<ImageRef> {
        let mut out = Vec::new();
        for (i, msg) in items(body, "messages") {
            for (j, part) in items(msg, "content").filter(|(_, p)| kind(p) == "image_url") {
                // `{"url", "detail"}`, or leniently the URL itself.
                let (url, field) = match part.get("image_url") {
                    Some(Value::String(u)) => (Some(u.as_str()), "image_url"),
                    Some(obj) => (obj.get("url").and_then(Value::as_str), "image_url.url"),
                    None => (None, ""),
                };
                if let Some(url) = url {
                    out.push(ImageRef::from_url(format!("messages[{i}].content[{j}].{field}"), url));
                }
            }
        }
        out
    }

    fn envelope(err: &ApiError) -> String {
        err.envelope()
    }

    fn error_tail(err: &ApiError, buf: &mut BytesMut) {
        sse::openai_error_tail(err, buf);
    }
}

/// `"required"`, `{"type": "function", "function": {"name"}}`; tools `[{"function": {"name"}}]`.
impl Tools for Chat {
    fn choice(choice: &Value, parallel: bool) -> Result<Option<ForcedTool>, String> {
        match choice {
            Value::String(mode) => tools::openai_mode(mode, parallel),
            Value::Object(c) if c.get("type").and_then(Value::as_str) == Some("function") => {
                match c.get("function").and_then(tools::name) {
                    Some(n) => Ok(Some(ForcedTool { name: Some(n.to_string()), parallel })),
                    None => Err("a function choice needs 'function.name'.".into()),
                }
            }
            _ => Err(tools::unsupported(choice)),
        }
    }

    fn tool_name(tool: &Value) -> Option<&str> {
        tool.get("function").and_then(tools::name)
    }
}

/// A pinned thinking mode goes through `thinking`, as for Messages; pinned on, a `reasoning_effort` of "none"
/// (which would turn it off) goes.
fn pin_thinking(obj: &mut Map<String, Value>, on: bool) {
    fields::pin_thinking(obj, on);
    if on && obj.get("reasoning_effort").and_then(Value::as_str) == Some("none") {
        obj.remove("reasoning_effort");
    }
}

fn parse(body: Body, served: Served<'_>) -> Result<GenerateRequest, ApiError> {
    let Body { json: mut v, may_have_images } = body;
    let model = model_of(&v, served.names)?;
    let obj = v.as_object_mut().ok_or(ApiError::Internal)?;
    fields::check(obj)?;
    if let Some(tools) = obj.get("tools").filter(|t| !t.is_null()) {
        checks::check_tools(tools)?;
    }
    let seed = fields::take_seed(obj)?;
    let priority = fields::take_priority(obj)?;

    match obj.get_mut("messages") {
        Some(Value::Array(msgs)) if msgs.len() > checks::MAX_MESSAGES => {
            return Err(ApiError::bad_param(
                "messages",
                format!("Too many messages: {} (at most {}).", msgs.len(), checks::MAX_MESSAGES),
            ));
        }
        Some(Value::Array(msgs)) if !msgs.is_empty() => {
            for (i, m) in msgs.iter_mut().enumerate() {
                let m = m
                    .as_object_mut()
                    .ok_or_else(|| ApiError::bad_param(&format!("messages[{i}]"), "Each message must be an object."))?;
                match m.get("role").and_then(Value::as_str) {
                    Some("developer") => {
                        m.insert("role".into(), Value::String("system".into()));
                    }
                    Some("assistant") => checks::refusals_as_text(m),
                    _ => {}
                }
                checks::check_message(i, m)?;
                checks::check_content(i, m)?;
            }
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::bad_param("messages", "'messages' must not be empty."));
        }
        _ => {
            return Err(ApiError::bad_param("messages", "'messages' is required and must be an array."));
        }
    }

    checks::thinking_from_template_kwargs(obj)?;
    let stream = opt_bool(obj, "stream", "stream")?;
    let (mut include_usage, mut continuous_usage) = (false, false);
    match obj.get("stream_options") {
        None | Some(Value::Null) => {
            obj.remove("stream_options");
        }
        Some(Value::Object(so)) => {
            if !stream {
                return Err(ApiError::bad_param(
                    "stream_options",
                    "'stream_options' is only allowed with \"stream\": true.",
                ));
            }
            include_usage = opt_bool(so, "include_usage", "stream_options.include_usage")?;
            continuous_usage = opt_bool(so, "continuous_usage_stats", "stream_options.continuous_usage_stats")?;
        }
        Some(_) => {
            return Err(ApiError::bad_param("stream_options", "'stream_options' must be an object."));
        }
    }

    match obj.get("n") {
        None | Some(Value::Null) => {}
        Some(n) if integer(n) == Some(1) => {
            obj.insert("n".into(), Value::from(1));
        }
        // n > 1 is split into n requests before this (`super::choices`), except where nothing splits it (a batch
        // line).
        Some(_) => return Err(ApiError::bad_param("n", "Only n = 1 is supported here (n > 1: send a request).")),
    }
    let logprobs = opt_bool(obj, "logprobs", "logprobs")?;
    fields::token_id_switches(obj)?;
    if let Some(top) = fields::top_logprobs(obj, "top_logprobs")? {
        if !logprobs {
            return Err(ApiError::bad_param("top_logprobs", "Invalid 'top_logprobs': it needs \"logprobs\": true."));
        }
        obj.insert("top_logprobs".into(), Value::from(top));
    }
    let forced_tool = tool_choice::<Chat>(obj)?;
    if let Some(rf) = obj.get("response_format").filter(|v| !v.is_null()) {
        checks::check_response_format(rf)?;
    }

    // max_completion_tokens wins over the deprecated max_tokens (as in vLLM); the recipe reads max_tokens only.
    let max_tokens = opt_u64(obj, "max_tokens")?;
    let max_completion = opt_u64(obj, "max_completion_tokens")?;
    obj.remove("max_completion_tokens");
    if let Some(n) = max_completion.or(max_tokens) {
        obj.insert("max_tokens".into(), Value::from(n));
    }

    let ignore_eos = opt_bool(obj, "ignore_eos", "ignore_eos")?;
    let mut top_k = match obj.get("top_k") {
        None | Some(Value::Null) => -1,
        Some(v) => match integer(v) {
            Some(k) if k == -1 || (1..=i32::MAX as i64).contains(&k) => {
                obj.insert("top_k".into(), Value::from(k));
                k as i32
            }
            _ => {
                return Err(ApiError::bad_param("top_k", "'top_k' must be -1 or a positive integer."));
            }
        },
    };

    if fields::take_greedy_top_p(obj) {
        top_k = 1;
    }
    if fields::prompt_logprobs(obj, stream)?.is_some() {
        fields::check_scoring_sampling(obj, max_completion.or(max_tokens), top_k)?;
    }

    served.pin::<Chat>(&mut v, &model)?;
    let images = images_of::<Chat>(may_have_images, &v);
    let body = serde_json::to_vec(&v).map_err(|_| ApiError::Internal)?;
    Ok(GenerateRequest {
        model,
        stream,
        include_usage,
        continuous_usage,
        ignore_eos,
        top_k,
        seed,
        forced_tool,
        priority,
        images,
        keeping: None,
        owner: Default::default(),
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn names() -> Vec<String> {
        vec!["m".to_string()]
    }

    fn ok(v: Value) -> GenerateRequest {
        Chat::parse(Body::read(v.to_string().as_bytes()).unwrap(), names().as_slice().into()).unwrap()
    }

    fn err(v: Value) -> ApiError {
        Chat::parse(Body::read(v.to_string().as_bytes()).unwrap(), names().as_slice().into()).unwrap_err()
    }

    fn base() -> Value {
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    }

    fn with(extra: Value) -> Value {
        let mut b = base();
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    }

    #[test]
    fn minimal_request_and_defaults() {
        let r = ok(base());
        assert!(!r.stream && !r.include_usage && !r.ignore_eos);
        assert_eq!(r.top_k, -1);
    }

    #[test]
    fn bad_json_and_shapes_are_400() {
        assert_eq!(crate::doors::Door::Chat.parse(b"{not json", names().as_slice().into()).unwrap_err().status(), 400);
        assert_eq!(crate::doors::Door::Chat.parse(b"[1]", names().as_slice().into()).unwrap_err().status(), 400);
        assert_eq!(err(json!({"messages": []})).status(), 400);
        assert_eq!(err(json!({"model": "m"})).status(), 400);
        assert_eq!(err(json!({"model": "m", "messages": []})).status(), 400);
        assert_eq!(err(json!({"model": "m", "messages": ["x"]})).status(), 400);
        let many: Vec<_> = (0..=checks::MAX_MESSAGES).map(|_| json!({"role": "user", "content": "x"})).collect();
        assert_eq!(err(json!({"model": "m", "messages": many})).status(), 400);
    }

    #[test]
    fn unknown_model_is_404() {
        assert_eq!(err(json!({"model": "other", "messages": [{"role": "user", "content": "x"}]})).status(), 404);
    }

    #[test]
    fn unsupported_features_are_400() {
        for extra in [
            json!({"n": 2}),
            json!({"logprobs": "yes"}),
            json!({"top_logprobs": 2}),
            json!({"logprobs": true, "top_logprobs": 21}),
            json!({"logprobs": true, "top_logprobs": -1}),
            json!({"logprobs": true, "top_logprobs": 1.5}),
            json!({"stream_options": {"include_usage": true}}),
            json!({"max_tokens": 0}),
            json!({"max_completion_tokens": -3}),
            json!({"ignore_eos": "yes"}),
            json!({"top_k": 0}),
        ] {
            assert_eq!(err(with(extra.clone())).status(), 400, "{extra}");
        }
        let audio = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, {"type": "input_audio", "input_audio": {"data": "x"}}]}]});
        assert!(err(with(audio)).envelope().contains("messages[0].content[1].type"));
        // An image part is taken, and its URL noted for the fetcher.
        let img = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]});
        let r = ok(with(img));
        assert_eq!(r.images.len(), 1);
        assert_eq!(r.images[0].url(), Some("http://x/y.png"));
        assert!(!r.may_constrain());
        assert!(ok(with(json!({"response_format": {"type": "json_object"}}))).may_constrain());
    }

    #[test]
    fn logprobs_checks_name_the_field() {
        let param = |extra: Value| {
            let env: Value = serde_json::from_str(&err(with(extra)).envelope()).unwrap();
            env["error"]["param"].as_str().unwrap().to_string()
        };
        assert_eq!(param(json!({"top_logprobs": 2})), "top_logprobs");
        assert_eq!(param(json!({"logprobs": true, "top_logprobs": 21})), "top_logprobs");
        assert_eq!(param(json!({"logprobs": 1})), "logprobs");
        assert_eq!(param(json!({"return_token_ids": "yes"})), "return_token_ids");
        assert_eq!(param(json!({"return_tokens_as_token_ids": 1})), "return_tokens_as_token_ids");
        ok(with(json!({"return_token_ids": true, "return_tokens_as_token_ids": null})));
        let body: Value =
            serde_json::from_slice(&ok(with(json!({"logprobs": true, "top_logprobs": 20.0}))).body).unwrap();
        assert_eq!(body["top_logprobs"], 20);
        ok(with(json!({"logprobs": true})));
        ok(with(json!({"logprobs": false, "top_logprobs": null})));
    }

    #[test]
    fn thinking_through_chat_template_kwargs() {
        let thinking = |extra: Value| {
            let body: Value = serde_json::from_slice(&ok(with(extra)).body).unwrap();
            body.get("thinking").cloned()
        };
        let (on, off) = (Some(json!({"type": "enabled"})), Some(json!({"type": "disabled"})));
        assert_eq!(thinking(json!({"chat_template_kwargs": {"thinking": false}})), off);
        assert_eq!(thinking(json!({"chat_template_kwargs": {"enable_thinking": true}})), on);
        assert_eq!(thinking(json!({"chat_template_kwargs": {"thinking": true, "enable_thinking": false}})), on);
        let top = json!({"thinking": {"type": "disabled"}, "chat_template_kwargs": {"thinking": true}});
        assert_eq!(thinking(top), off, "the top-level field wins");
        assert_eq!(thinking(json!({"chat_template_kwargs": {"other": 1}})), None);
        assert_eq!(thinking(json!({"chat_template_kwargs": null})), None);
        let e = err(with(json!({"chat_template_kwargs": {"enable_thinking": "yes"}})));
        assert!(e.status() == 400 && e.envelope().contains("chat_template_kwargs.enable_thinking"));
    }

    #[test]
    fn normalizations_for_the_recipe() {
        let r = ok(with(json!({
            "messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 50, "max_completion_tokens": 7, "stream": true,
            "stream_options": {"include_usage": true, "continuous_usage_stats": true}, "ignore_eos": true, "top_k": 5,
        })));
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body["messages"][0]["role"], "system");
        assert_eq!(body["max_tokens"], 7);
        assert!(body.get("max_completion_tokens").is_none());
        assert!(r.stream && r.include_usage && r.continuous_usage && r.ignore_eos);
        assert_eq!(r.top_k, 5);
        let r = ok(with(json!({"max_completion_tokens": 9, "stream_options": null})));
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(body["max_tokens"], 9);
        assert!(body.get("stream_options").is_none());
    }

    #[test]
    fn image_url_parts() {
        let url = |param: &str, u: &str| ImageRef::from_url(param.into(), u);
        let body = json!({"messages": [
            {"role": "system", "content": "hi"},
            {"role": "user", "content": [
                {"type": "text", "text": "what"},
                {"type": "image_url", "image_url": {"url": "https://a.example/x.png", "detail": "low"}},
                {"type": "image_url", "image_url": "http://b.example/y.jpg"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAABBBB"}},
                {"type": "image_url", "image_url": {"detail": "auto"}},
                {"type": "input_audio"},
            ]},
        ]});
        assert_eq!(
            Chat::image_refs(&body),
            [
                url("messages[1].content[1].image_url.url", "https://a.example/x.png"),
                url("messages[1].content[2].image_url", "http://b.example/y.jpg"),
                url("messages[1].content[3].image_url.url", "data:image/png;base64,AAAABBBB"),
            ]
        );
        assert!(Chat::image_refs(&json!({"messages": "x"})).is_empty());
    }

    #[test]
    fn a_pinned_thinking_mode_wins() {
        let pinned = |body: Value, on: bool| {
            let mut obj = body.as_object().unwrap().clone();
            pin_thinking(&mut obj, on);
            Value::Object(obj)
        };
        let off = pinned(json!({"thinking": {"type": "enabled"}}), false);
        assert_eq!(off["thinking"]["type"], "disabled");
        let on = pinned(json!({"reasoning_effort": "none"}), true);
        assert_eq!((on["thinking"]["type"].as_str(), on.get("reasoning_effort")), (Some("enabled"), None));
        let kept = pinned(json!({"thinking": {"type": "adaptive"}, "reasoning_effort": "low"}), true);
        assert_eq!(
            (kept["thinking"]["type"].as_str(), kept["reasoning_effort"].as_str()),
            (Some("adaptive"), Some("low"))
        );
    }
}

//! Chat Completions request checks done in Rust, before any Python runs: JSON shape, model, the features the
//! service does not offer, and the normalizations deepseek-recipe leaves to the server. Everything else
//! (messages, sampling ranges, tools) is validated by deepseek-recipe in the codec.

use super::fields::{self, brief, integer};
use crate::error::ApiError;
use serde_json::{Map, Value};

/// What the front end needs to know about a generation request, whichever door it came in by, plus the normalized
/// body for the codec.
#[derive(Debug)]
pub struct GenerateRequest {
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
    pub continuous_usage: bool,
    pub ignore_eos: bool,
    pub top_k: i32,
    pub seed: Option<u64>,
    /// A tool choice that forces a call (the codec constrains the output to one).
    pub forced_tool: Option<fields::ForcedTool>,
    /// Wait-queue order: lower first.
    pub priority: i64,
    /// The request's images (fetched, for URLs, after admission).
    pub images: Vec<crate::media::ImageRef>,
    pub body: Vec<u8>,
}

impl GenerateRequest {
    /// Whether the output may be held to a grammar: a forced tool call, or a body that names a structured format
    /// or a strict tool (an over-estimate is harmless: the check then finds none). Asked only of a request that
    /// must wait for a slot, whose grammar is then checked before the wait.
    pub fn may_constrain(&self) -> bool {
        const MARKS: [&[u8]; 4] = [b"\"json_schema\"", b"\"json_object\"", b"\"regex\"", b"\"strict\""];
        self.forced_tool.is_some() || MARKS.iter().any(|m| memchr::memmem::find(&self.body, m).is_some())
    }
}

/// The images of a body; only one that spells "image" can have any (the cheap test keeps text requests free).
pub fn images_of(protocol: crate::protocol::Protocol, raw: &[u8], body: &Value) -> Vec<crate::media::ImageRef> {
    if memchr::memmem::find(raw, b"image").is_some() { crate::media::image_refs(protocol, body) } else { Vec::new() }
}

/// Upper bound deepseek-recipe accepts for max_tokens.
const MAX_TOKENS_LIMIT: u64 = 393_216;

pub fn opt_bool(obj: &Map<String, Value>, key: &str, param: &str) -> Result<bool, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_param(param, format!("'{param}' must be a boolean"))),
    }
}

pub fn opt_u64(obj: &Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match integer(v) {
            Some(n) if (1..=MAX_TOKENS_LIMIT as i64).contains(&n) => Ok(Some(n as u64)),
            _ => Err(ApiError::bad_param(
                key,
                format!("Invalid '{key}': expected an integer in [1, {MAX_TOKENS_LIMIT}], got {}.", brief(v)),
            )),
        },
    }
}

/// Reject content the service cannot take (audio, files): text and image parts only.
fn check_content(i: usize, msg: &Map<String, Value>) -> Result<(), ApiError> {
    let Some(Value::Array(parts)) = msg.get("content") else {
        return Ok(());
    };
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
        if kind != "text" && kind != "image_url" {
            let param = format!("messages[{i}].content[{j}].type");
            let what = if kind.is_empty() { "a content part without a type".to_string() } else { format!("'{kind}'") };
            return Err(ApiError::bad_param(
                &param,
                format!(
                    "Only text and image_url content parts are supported; {what} is not (audio and files are not)."
                ),
            ));
        }
    }
    Ok(())
}

/// An assistant turn's `refusal` parts are what it said: text to the model.
fn refusals_as_text(msg: &mut Map<String, Value>) {
    let Some(Value::Array(parts)) = msg.get_mut("content") else { return };
    for part in parts.iter_mut() {
        if part.get("type").and_then(Value::as_str) == Some("refusal")
            && let Some(text) = part.get("refusal").filter(|r| r.is_string()).cloned()
        {
            *part = serde_json::json!({"type": "text", "text": text});
        }
    }
}

/// Most messages one request may carry (a conversation this long is a mistake or an attack).
pub const MAX_MESSAGES: usize = 4096;

/// The body as a JSON object, and its `model`, which must be a served name: what every door checks first.
pub fn body_and_model(raw: &[u8], served: &[String]) -> Result<(Value, String), ApiError> {
    let v: Value = serde_json::from_slice(raw)
        .map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| ApiError::bad_request("The request body must be a JSON object."))?;
    let model = match obj.get("model") {
        Some(Value::String(m)) => m.clone(),
        None | Some(Value::Null) => {
            return Err(ApiError::bad_param("model", "'model' is required."));
        }
        Some(_) => return Err(ApiError::bad_param("model", "'model' must be a string.")),
    };
    if !served.contains(&model) {
        return Err(ApiError::ModelNotFound(model));
    }
    Ok((v, model))
}

pub fn parse(raw: &[u8], served: &[String]) -> Result<GenerateRequest, ApiError> {
    let (mut v, model) = body_and_model(raw, served)?;
    let obj = v.as_object_mut().ok_or(ApiError::Internal)?;
    fields::check(obj)?;
    if let Some(tools) = obj.get("tools").filter(|t| !t.is_null()) {
        fields::check_tools(tools)?;
    }
    let seed = fields::take_seed(obj)?;
    let priority = fields::take_priority(obj)?;

    match obj.get_mut("messages") {
        Some(Value::Array(msgs)) if msgs.len() > MAX_MESSAGES => {
            return Err(ApiError::bad_param(
                "messages",
                format!("Too many messages: {} (at most {MAX_MESSAGES}).", msgs.len()),
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
                    Some("assistant") => refusals_as_text(m),
                    _ => {}
                }
                fields::check_message(i, m)?;
                check_content(i, m)?;
            }
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::bad_param("messages", "'messages' must not be empty."));
        }
        _ => {
            return Err(ApiError::bad_param("messages", "'messages' is required and must be an array."));
        }
    }

    thinking_from_template_kwargs(obj)?;
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
        Some(_) => return Err(ApiError::bad_param("n", "Only n = 1 is supported.")),
    }
    let logprobs = opt_bool(obj, "logprobs", "logprobs")?;
    if let Some(top) = fields::top_logprobs(obj, "top_logprobs")? {
        if !logprobs {
            return Err(ApiError::bad_param("top_logprobs", "Invalid 'top_logprobs': it needs \"logprobs\": true."));
        }
        obj.insert("top_logprobs".into(), Value::from(top));
    }
    let forced_tool = fields::tool_choice(obj, fields::ToolDoor::Chat)?;
    if let Some(rf) = obj.get("response_format").filter(|v| !v.is_null()) {
        check_response_format(rf)?;
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

    let images = images_of(crate::protocol::Protocol::Chat, raw, &v);
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
        body,
    })
}

/// Chat's `response_format`: text, json_object, json_schema (with a schema) or deepseek-recipe's regex. The
/// schema itself is checked by deepseek-recipe and compiled by the codec (python/deepinfer_server/grammar.py).
fn check_response_format(rf: &Value) -> Result<(), ApiError> {
    let bad = |param: &str, what: &str| Err(ApiError::bad_param(param, format!("Invalid '{param}': {what}.")));
    match rf.get("type").and_then(Value::as_str) {
        Some("text" | "json_object") => Ok(()),
        Some("json_schema") => match rf.get("json_schema") {
            Some(Value::Object(js)) => match js.get("schema") {
                Some(Value::Object(_) | Value::Bool(_)) => Ok(()),
                None | Some(Value::Null) => bad("response_format.json_schema.schema", "a JSON schema is required"),
                Some(_) => bad("response_format.json_schema.schema", "expected a JSON schema object"),
            },
            _ => bad("response_format.json_schema", "expected an object with 'name' and 'schema'"),
        },
        Some("regex") if rf.get("regex").is_some_and(Value::is_string) => Ok(()),
        Some("regex") => bad("response_format.regex", "expected a regular expression string"),
        _ => bad("response_format.type", "expected \"text\", \"json_object\", \"json_schema\" or \"regex\""),
    }
}

/// The thinking switch clients written for vLLM or Qwen send, and gateways (smg) write into rewritten bodies:
/// `chat_template_kwargs: {"thinking": bool}` or `{"enable_thinking": bool}`, turned into the top-level
/// `thinking` deepseek-recipe reads. A top-level `thinking` wins; `thinking` wins over `enable_thinking`.
fn thinking_from_template_kwargs(obj: &mut Map<String, Value>) -> Result<(), ApiError> {
    let Some(Value::Object(kwargs)) = obj.get("chat_template_kwargs") else { return Ok(()) };
    let Some((key, value)) =
        ["thinking", "enable_thinking"].iter().find_map(|k| kwargs.get(*k).filter(|v| !v.is_null()).map(|v| (*k, v)))
    else {
        return Ok(());
    };
    let Some(on) = value.as_bool() else {
        let param = format!("chat_template_kwargs.{key}");
        return Err(ApiError::bad_param(&param, format!("'{param}' must be a boolean")));
    };
    if matches!(obj.get("thinking"), None | Some(Value::Null)) {
        let kind = if on { "enabled" } else { "disabled" };
        obj.insert("thinking".into(), serde_json::json!({"type": kind}));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn names() -> Vec<String> {
        vec!["m".to_string()]
    }

    fn ok(v: Value) -> GenerateRequest {
        parse(v.to_string().as_bytes(), &names()).unwrap()
    }

    fn err(v: Value) -> ApiError {
        parse(v.to_string().as_bytes(), &names()).unwrap_err()
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
        assert_eq!(parse(b"{not json", &names()).unwrap_err().status(), 400);
        assert_eq!(parse(b"[1]", &names()).unwrap_err().status(), 400);
        assert_eq!(err(json!({"messages": []})).status(), 400);
        assert_eq!(err(json!({"model": "m"})).status(), 400);
        assert_eq!(err(json!({"model": "m", "messages": []})).status(), 400);
        assert_eq!(err(json!({"model": "m", "messages": ["x"]})).status(), 400);
        let many: Vec<_> = (0..=MAX_MESSAGES).map(|_| json!({"role": "user", "content": "x"})).collect();
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
}

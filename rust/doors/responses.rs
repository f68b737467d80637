//! OpenAI Responses, `POST /v1/responses`: the checks done in Rust before any Python runs (JSON shape, model, the
//! input items and tools deepseek-recipe converts, and what needs state the server does not keep, refused in
//! words), and its named SSE events. deepseek-recipe converts and validates the rest.

use super::fields::{self, items, kind, model_of, set};
use super::request::plain;
use super::tools::{self, ForcedTool, Tools, tool_choice};
use super::{Body, GenerateRequest, Keeping, PinThinking, Served, Spec, sse};
use crate::error::ApiError;
use crate::media::ImageRef;
use bytes::BytesMut;
use serde_json::{Map, Value, json};

pub struct Responses;

impl Spec for Responses {
    const PATH: &'static str = "/v1/responses";
    const NAME: &'static str = "responses";
    const CODE: u8 = 3;
    const ID_PREFIX: &'static str = "resp_";
    const DONE: &'static [u8] = b"";
    const KEEP_ALIVE: &'static [u8] = sse::KEEP_ALIVE;
    const PIN_THINKING: Option<PinThinking> = Some(pin_thinking);

    fn parse(body: Body, served: Served<'_>) -> Result<GenerateRequest, ApiError> {
        parse(body, served)
    }

    /// `input_image` parts of message items' `content`, and of a function call's `output` given as a list of parts.
    fn image_refs(body: &Value) -> Vec<ImageRef> {
        let mut out = Vec::new();
        for (i, item) in items(body, "input") {
            for key in ["content", "output"] {
                for (j, part) in items(item, key).filter(|(_, p)| kind(p) == "input_image") {
                    // `file_id` images name an uploaded file: not this fetcher's.
                    if let Some(url) = part.get("image_url").and_then(Value::as_str) {
                        out.push(ImageRef::from_url(format!("input[{i}].{key}[{j}].image_url"), url));
                    }
                }
            }
        }
        out
    }

    fn envelope(err: &ApiError) -> String {
        err.envelope()
    }

    /// Responses' own `error` event.
    fn error_tail(err: &ApiError, buf: &mut BytesMut) {
        let e = err.error_object();
        let event = json!({
            "type": "error", "code": e["code"], "message": e["message"], "param": e["param"], "sequence_number": 0,
        });
        sse::event_into(buf, "error", event.to_string().as_bytes());
    }
}

/// `"required"`, `{"type": "function", "name"}`; tools `[{"type": "function", "name"}]`.
impl Tools for Responses {
    fn choice(choice: &Value, parallel: bool) -> Result<Option<ForcedTool>, String> {
        match choice {
            Value::String(mode) => tools::openai_mode(mode, parallel),
            Value::Object(c) if c.get("type").and_then(Value::as_str) == Some("function") => {
                match tools::name(choice) {
                    Some(n) => Ok(Some(ForcedTool { name: Some(n.to_string()), parallel })),
                    None => Err("a function choice needs a 'name'.".into()),
                }
            }
            _ => Err(tools::unsupported(choice)),
        }
    }

    fn tool_name(tool: &Value) -> Option<&str> {
        tools::name(tool)
    }
}

/// A pinned thinking mode goes through `reasoning.effort` (deepseek-recipe reads only that here): "none" is off,
/// and an effort the client chose is kept when the pin is on.
fn pin_thinking(obj: &mut Map<String, Value>, on: bool) {
    let reasoning = obj.entry("reasoning").or_insert_with(|| json!({}));
    if !reasoning.is_object() {
        *reasoning = json!({});
    }
    let effort = reasoning.get("effort").and_then(Value::as_str);
    if !on {
        reasoning["effort"] = json!("none");
    } else if matches!(effort, None | Some("none")) {
        reasoning["effort"] = json!("high");
    }
}

/// Responses tools the server can run: function tools (and deepseek-recipe's `apply_patch` custom tool).
const CLIENT_TOOLS: &[&str] = &["function", "custom"];

/// Input items deepseek-recipe converts; anything else (hosted tools' calls, references to stored items) is not
/// served.
const INPUT_ITEMS: &[&str] = &[
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
    "custom_tool_call",
    "custom_tool_call_output",
    "tool_search_call",
    "tool_search_output",
];
/// Items that answer or make a tool call: they need the call's id.
const CALL_ITEMS: &[&str] = &[
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "tool_search_call",
    "tool_search_output",
];

/// Check the input items; an assistant turn's `refusal` parts are what it said: its text.
fn check_input(input: &mut Value) -> Result<(), ApiError> {
    let Value::Array(items) = input else { return Ok(()) };
    if items.is_empty() {
        return Err(ApiError::bad_param("input", "'input' must not be an empty array."));
    }
    for (i, item) in items.iter_mut().enumerate() {
        // An item with neither a type nor a role is a reference to a stored item.
        let default = if item.get("role").is_some() { "message" } else { "item_reference" };
        let kind = item.get("type").and_then(Value::as_str).unwrap_or(default).to_string();
        let kind = kind.as_str();
        if !INPUT_ITEMS.contains(&kind) {
            let param = format!("input[{i}].type");
            return Err(ApiError::bad_param(&param, format!("Input items of type '{kind}' are not supported.")));
        }
        if CALL_ITEMS.contains(&kind) && !item.get("call_id").is_some_and(Value::is_string) {
            let param = format!("input[{i}].call_id");
            return Err(ApiError::bad_param(&param, format!("A '{kind}' input item needs a string 'call_id'.")));
        }
        if let Some(Value::Array(parts)) = item.get_mut("content") {
            for part in parts.iter_mut() {
                if part.get("type").and_then(Value::as_str) == Some("refusal")
                    && let Some(text) = part.get("refusal").filter(|r| r.is_string()).cloned()
                {
                    *part = serde_json::json!({"type": "output_text", "text": text});
                }
            }
        }
    }
    Ok(())
}

fn parse(body: Body, served: Served<'_>) -> Result<GenerateRequest, ApiError> {
    let Body { json: mut v, may_have_images } = body;
    let model = model_of(&v, served.names)?;
    let obj = v.as_object_mut().ok_or(ApiError::Internal)?;
    fields::integers(obj, &["max_output_tokens", "top_logprobs", "max_tool_calls"]);
    fields::check(obj)?; // the sampling and bookkeeping fields it shares with chat
    let top_k = if fields::take_greedy_top_p(obj) { 1 } else { -1 };
    if let Some(input) = obj.get_mut("input") {
        check_input(input)?;
    }
    let obj = v.as_object().ok_or(ApiError::Internal)?;
    let previous_response_id = match obj.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) if !id.is_empty() && id.len() <= 256 => Some(id.clone()),
        Some(_) => {
            return Err(ApiError::bad_param(
                "previous_response_id",
                "Invalid 'previous_response_id': expected the id of a stored response.",
            ));
        }
    };
    // A conversation's id, or `{"id": …}`; not beside `previous_response_id` (OpenAI refuses the pair too).
    let conversation = match obj.get("conversation") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) if !id.is_empty() && id.len() <= 256 => Some(id.clone()),
        Some(Value::Object(c))
            if c.get("id").and_then(Value::as_str).is_some_and(|id| !id.is_empty() && id.len() <= 256) =>
        {
            c.get("id").and_then(Value::as_str).map(str::to_string)
        }
        Some(_) => {
            return Err(ApiError::bad_param("conversation", "Invalid 'conversation': expected a conversation's id."));
        }
    };
    if conversation.is_some() && previous_response_id.is_some() {
        return Err(ApiError::bad_param(
            "conversation",
            "'conversation' and 'previous_response_id' cannot be used together.",
        ));
    }
    if set(obj, "prompt") {
        return Err(ApiError::bad_param("prompt", "Stored prompt templates are not supported; send 'input'."));
    }
    // Stored unless the request says `store: false`, as OpenAI's default is.
    let store = !matches!(obj.get("store"), Some(Value::Bool(false)));
    let background = match obj.get("background") {
        None | Some(Value::Null | Value::Bool(false)) => false,
        Some(Value::Bool(true)) if store => true,
        Some(Value::Bool(true)) => {
            return Err(ApiError::bad_param(
                "background",
                "A background response must be stored: drop 'store: false'.",
            ));
        }
        Some(_) => return Err(ApiError::bad_param("background", "'background' must be a boolean")),
    };
    if !matches!(obj.get("store"), None | Some(Value::Null | Value::Bool(_))) {
        return Err(ApiError::bad_param("store", "'store' must be a boolean"));
    }
    if let Some(Value::Array(tools)) = obj.get("tools") {
        for (i, tool) in tools.iter().enumerate() {
            let kind = tool.get("type").and_then(Value::as_str).unwrap_or("");
            if kind == "custom" && tool.get("name").and_then(Value::as_str) != Some("apply_patch") {
                let param = format!("tools[{i}].type");
                return Err(ApiError::bad_param(
                    &param,
                    "Custom tools are not supported, but for 'apply_patch'; send function tools.",
                ));
            }
            if !CLIENT_TOOLS.contains(&kind) {
                let param = format!("tools[{i}].type");
                return Err(ApiError::bad_param(
                    &param,
                    format!(
                        "Hosted tool '{kind}' is not supported: only function tools run here (the client runs them)."
                    ),
                ));
            }
        }
    }
    let forced_tool = tool_choice::<Responses>(obj)?;
    fields::top_logprobs(obj, "top_logprobs")?;
    if let Some(format) = obj.get("text").and_then(|t| t.get("format")).filter(|f| !f.is_null()) {
        match format.get("type").and_then(Value::as_str) {
            Some("text" | "json_object") => {}
            Some("json_schema") if matches!(format.get("schema"), Some(Value::Object(_) | Value::Bool(_))) => {}
            Some("json_schema") => {
                return Err(ApiError::bad_param(
                    "text.format.schema",
                    "Invalid 'text.format.schema': a JSON schema is required.",
                ));
            }
            _ => {
                return Err(ApiError::bad_param(
                    "text.format.type",
                    "Invalid 'text.format.type': expected \"text\", \"json_object\" or \"json_schema\".",
                ));
            }
        }
    }
    let mut req = plain::<Responses>(may_have_images, served, v, model, top_k, forced_tool)?;
    req.keeping = Some(Keeping { store, previous_response_id, conversation, background });
    Ok(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["m".into()]
    }

    fn param(body: Value) -> String {
        let e =
            Responses::parse(Body::read(body.to_string().as_bytes()).unwrap(), names().as_slice().into()).unwrap_err();
        let env: Value = serde_json::from_str(&e.envelope()).unwrap();
        env["error"]["param"].as_str().unwrap_or("").to_string()
    }

    #[test]
    fn responses_are_stored_unless_the_request_says_not() {
        let parse = |v: Value| {
            Responses::parse(Body::read(v.to_string().as_bytes()).unwrap(), names().as_slice().into()).unwrap()
        };
        let keeping = |v: Value| parse(v).keeping.unwrap();
        let k = keeping(json!({"model": "m", "input": "hi"}));
        assert!(k.store && k.previous_response_id.is_none());
        assert!(!keeping(json!({"model": "m", "input": "hi", "store": false})).store);
        let k = keeping(json!({"model": "m", "input": "hi", "previous_response_id": "resp_1"}));
        assert_eq!(k.previous_response_id.as_deref(), Some("resp_1"));
    }

    #[test]
    fn responses_refuse_what_no_server_state_can_do() {
        let base = json!({"model": "m", "input": "hi"});
        assert!(Responses::parse(Body::read(base.to_string().as_bytes()).unwrap(), names().as_slice().into()).is_ok());
        for (extra, field) in [
            (json!({"previous_response_id": 7}), "previous_response_id"),
            (json!({"conversation": 7}), "conversation"),
            (json!({"conversation": "conv_1", "previous_response_id": "resp_1"}), "conversation"),
            (json!({"store": "yes"}), "store"),
            (json!({"background": true, "store": false}), "background"),
            (json!({"background": "yes"}), "background"),
            (json!({"tools": [{"type": "web_search"}]}), "tools[0].type"),
            (json!({"tools": [{"type": "function", "name": "f"}, {"type": "file_search"}]}), "tools[1].type"),
            (json!({"top_logprobs": 21}), "top_logprobs"),
            (json!({"tools": [{"type": "custom", "name": "sql"}]}), "tools[0].type"),
            (json!({"text": {"format": {"type": "json_schema", "name": "x"}}}), "text.format.schema"),
            (json!({"text": {"format": {"type": "grammar"}}}), "text.format.type"),
            (json!({"input": []}), "input"),
            (json!({"input": [{"type": "web_search_call", "id": "x"}]}), "input[0].type"),
            (
                json!({"input": [{"role": "user", "content": "x"}, {"type": "function_call_output"}]}),
                "input[1].call_id",
            ),
            (json!({"temperature": 3}), "temperature"),
            (json!({"input": [{"id": "msg_1"}]}), "input[0].type"),
            (json!({"tool_choice": "required"}), "tool_choice"), // no tools
            (
                json!({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}),
                "tool_choice",
            ),
            (json!({"prompt": {"id": "pmpt_1"}}), "prompt"),
            (json!({"tool_choice": {"type": "computer"}}), "tool_choice"),
        ] {
            let mut b = base.clone();
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            assert_eq!(param(b), field);
        }
        let mut b = base.clone();
        b["store"] = json!(false);
        b["top_p"] = json!(0);
        b["max_output_tokens"] = json!(5.0);
        let r = Responses::parse(Body::read(b.to_string().as_bytes()).unwrap(), names().as_slice().into()).unwrap();
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!((r.top_k, body.get("top_p"), &body["max_output_tokens"]), (1, None, &json!(5)));
    }

    #[test]
    fn input_images() {
        let url = |param: &str, u: &str| ImageRef::from_url(param.into(), u);
        let body = json!({"input": [
            {"role": "user", "content": [
                {"type": "input_text", "text": "what"},
                {"type": "input_image", "image_url": "https://a.example/x.png", "detail": "high"},
                {"type": "input_image", "file_id": "file_1"},
                {"type": "input_image", "image_url": "data:image/jpeg;base64,QUJDRA=="},
            ]},
            {"type": "function_call_output", "call_id": "c", "output": [
                {"type": "input_image", "image_url": "https://b.example/y.png"},
            ]},
            {"type": "function_call_output", "call_id": "d", "output": "text"},
        ]});
        assert_eq!(
            Responses::image_refs(&body),
            [
                url("input[0].content[1].image_url", "https://a.example/x.png"),
                url("input[0].content[3].image_url", "data:image/jpeg;base64,QUJDRA=="),
                url("input[1].output[0].image_url", "https://b.example/y.png"),
            ]
        );
        assert!(Responses::image_refs(&json!({"input": "an image"})).is_empty());
    }

    #[test]
    fn a_pinned_thinking_mode_is_a_reasoning_effort() {
        let pinned = |body: Value, on: bool| {
            let mut obj = body.as_object().unwrap().clone();
            pin_thinking(&mut obj, on);
            obj["reasoning"]["effort"].clone()
        };
        assert_eq!(pinned(json!({"reasoning": {"effort": "low"}}), false), "none");
        assert_eq!(pinned(json!({"reasoning": {"effort": "low"}}), true), "low");
        assert_eq!(pinned(json!({"reasoning": "x"}), true), "high");
    }

    #[test]
    fn a_failed_stream_ends_with_an_error_event() {
        let mut tail = BytesMut::new();
        Responses::error_tail(&ApiError::Unavailable("rank 0 died".into()), &mut tail);
        let resp = String::from_utf8(tail.to_vec()).unwrap();
        let data: Value = serde_json::from_str(resp.trim_end().split_once("data: ").unwrap().1).unwrap();
        assert_eq!((data["type"].as_str(), data["code"].as_str()), (Some("error"), Some("service_unavailable")));
    }
}

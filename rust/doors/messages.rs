//! Anthropic Messages, `POST /v1/messages` (and `/v1/messages/count_tokens`, whose body is a request's): the checks
//! done in Rust before any Python runs (JSON shape, model, stream and top_k, the server tools and outputs the
//! server cannot give, refused in words), Anthropic's error envelope and its named SSE events. deepseek-recipe
//! converts and validates the rest.

use super::fields::{self, integer, items, kind, model_of};
use super::request::plain;
use super::tools::{self, ForcedTool, Tools, tool_choice};
use super::{Body, GenerateRequest, PinThinking, Served, Spec, sse};
use crate::error::ApiError;
use crate::media::ImageRef;
use bytes::BytesMut;
use serde_json::{Map, Value, json};

pub struct Messages;

/// Anthropic's keep-alive event.
const PING: &[u8] = b"event: ping\ndata: {\"type\": \"ping\"}\n\n";

impl Spec for Messages {
    const PATH: &'static str = "/v1/messages";
    const NAME: &'static str = "messages";
    const CODE: u8 = 2;
    const ID_PREFIX: &'static str = "msg_";
    const DONE: &'static [u8] = b"";
    const KEEP_ALIVE: &'static [u8] = PING;
    const PIN_THINKING: Option<PinThinking> = Some(fields::pin_thinking);

    fn parse(body: Body, served: Served<'_>) -> Result<GenerateRequest, ApiError> {
        parse(body, served)
    }

    /// `image` blocks of the messages' content, and those inside a `tool_result`'s content.
    fn image_refs(body: &Value) -> Vec<ImageRef> {
        let mut out = Vec::new();
        for (i, msg) in items(body, "messages") {
            for (j, block) in items(msg, "content") {
                let at = format!("messages[{i}].content[{j}]");
                match kind(block) {
                    "image" => image(&mut out, &at, block),
                    "tool_result" => {
                        for (k, inner) in items(block, "content").filter(|(_, b)| kind(b) == "image") {
                            image(&mut out, &format!("{at}.content[{k}]"), inner);
                        }
                    }
                    _ => {}
                }
            }
        }
        out
    }

    fn envelope(err: &ApiError) -> String {
        envelope(err).to_string()
    }

    fn error_tail(err: &ApiError, buf: &mut BytesMut) {
        sse::event_into(buf, "error", envelope(err).to_string().as_bytes());
    }
}

/// An `image` block at `at`: `source` `{type: "url", url}` or `{type: "base64", media_type, data}`.
fn image(out: &mut Vec<ImageRef>, at: &str, block: &Value) {
    let Some(source) = block.get("source") else { return };
    let field = |key: &str| source.get(key).and_then(Value::as_str);
    match (kind(source), field("url"), field("data")) {
        ("url", Some(url), _) => out.push(ImageRef::from_url(format!("{at}.source.url"), url)),
        ("base64", _, Some(data)) => out.push(ImageRef::base64(format!("{at}.source.data"), data)),
        _ => {}
    }
}

/// Anthropic's envelope `{"type": "error", "error": {"type", "message"}}`, with Anthropic's error type for the
/// status (their API's own table; a 503 is `overloaded_error`, as Anthropic says when it cannot serve).
fn envelope(err: &ApiError) -> Value {
    let kind = match err.status().as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": err.message()}})
}

/// `{"type": "any" | "tool", "name", "disable_parallel_tool_use"}`; tools `[{"name"}]`.
impl Tools for Messages {
    fn choice(choice: &Value, _parallel_calls: bool) -> Result<Option<ForcedTool>, String> {
        let Value::Object(c) = choice else { return Err(tools::unsupported(choice)) };
        let parallel = !matches!(c.get("disable_parallel_tool_use"), Some(Value::Bool(true)));
        match c.get("type").and_then(Value::as_str) {
            Some("auto" | "none") => Ok(None),
            Some("any") => Ok(Some(ForcedTool { name: None, parallel })),
            Some("tool") => match tools::name(choice) {
                Some(n) => Ok(Some(ForcedTool { name: Some(n.to_string()), parallel })),
                None => Err("a \"tool\" choice needs a 'name'.".into()),
            },
            _ => Err("expected type \"auto\", \"any\", \"tool\" or \"none\".".into()),
        }
    }

    fn tool_name(tool: &Value) -> Option<&str> {
        tools::name(tool)
    }
}

fn parse(body: Body, served: Served<'_>) -> Result<GenerateRequest, ApiError> {
    let Body { json: mut v, may_have_images } = body;
    let model = model_of(&v, served.names)?;
    fields::integers(v.as_object_mut().ok_or(ApiError::Internal)?, &["max_tokens", "top_k"]);
    let obj = v.as_object().ok_or(ApiError::Internal)?;
    // deepseek-recipe ignores top_k; the rank takes it. Anthropic's 0 means no top-k filtering.
    let top_k = match obj.get("top_k") {
        None | Some(Value::Null) => -1,
        Some(k) => match integer(k) {
            Some(0) => -1,
            Some(k) if (1..=i32::MAX as i64).contains(&k) => k as i32,
            _ => return Err(ApiError::bad_param("top_k", "'top_k' must be a non-negative integer.")),
        },
    };
    // deepseek-recipe turns "any" (and, with thinking on, "tool") into "auto": the codec constrains them itself.
    let forced_tool = tool_choice::<Messages>(obj)?;
    if !matches!(obj.get("metadata"), None | Some(Value::Null | Value::Object(_))) {
        return Err(ApiError::bad_param("metadata", "'metadata' must be an object."));
    }
    let obj = v.as_object_mut().ok_or(ApiError::Internal)?;
    client_tools(obj)?;
    output_format(obj)?;
    // Anthropic's API thinks only when asked: a request that says nothing gets no thinking block (the quickstart
    // reads `content[0].text`). A served name that pins thinking on still turns it on (`Served::pin`).
    if matches!(obj.get("thinking"), None | Some(Value::Null)) {
        obj.insert("thinking".into(), serde_json::json!({"type": "disabled"}));
    }
    plain::<Messages>(may_have_images, served, v, model, top_k, forced_tool)
}

/// Messages tools: a client tool is one without a `type` or with `"type": "custom"` (as litellm writes them); any
/// other type is one of Anthropic's server tools (`web_search_*`, `bash_*`, `text_editor_*`, `code_execution_*`,
/// ...), which this server does not run, refused by name. Custom ones go on to deepseek-recipe without the type.
fn client_tools(obj: &mut Map<String, Value>) -> Result<(), ApiError> {
    let Some(Value::Array(tools)) = obj.get_mut("tools") else { return Ok(()) };
    let mut server = Vec::new();
    for (i, tool) in tools.iter_mut().enumerate() {
        let Some(t) = tool.as_object_mut() else { continue }; // deepseek-recipe refuses it with its own words
        match t.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(kind)) if kind == "custom" => {
                t.remove("type");
            }
            Some(kind) => server.push(format!("tools[{i}] ({})", crate::error::clip(&kind.to_string(), 64))),
        }
    }
    if server.is_empty() {
        return Ok(());
    }
    let param =
        if server.len() == 1 { server[0].split(' ').next().unwrap_or("tools").to_string() } else { "tools".into() };
    Err(ApiError::bad_param(
        &param,
        format!(
            "Server tools are not supported by this server: {}. Client tools (no 'type', or 'type': 'custom') are.",
            server.join(", ")
        ),
    ))
}

/// Anthropic's structured outputs: `output_config.format` (or the older beta `output_format`) with `type`
/// `json_schema` and a `schema`, left in the body for the codec (which enforces it as chat's `json_schema` in strict
/// mode, after Anthropic's schema limits). Only one of the two may be given.
fn output_format(obj: &mut Map<String, Value>) -> Result<(), ApiError> {
    let config = match obj.get("output_config") {
        None | Some(Value::Null) => None,
        Some(Value::Object(c)) => c.get("format").filter(|f| !f.is_null()).map(|f| ("output_config.format", f)),
        Some(_) => return Err(ApiError::bad_param("output_config", "'output_config' must be an object.")),
    };
    let beta = obj.get("output_format").filter(|f| !f.is_null()).map(|f| ("output_format", f));
    let (param, format) = match (config, beta) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_param(
                "output_format",
                "Give 'output_config.format' or the deprecated 'output_format', not both.",
            ));
        }
        (Some(f), None) | (None, Some(f)) => f,
        (None, None) => return Ok(()),
    };
    if format.get("type").and_then(Value::as_str) != Some("json_schema") {
        let message = format!("Invalid '{param}.type': only \"json_schema\" is supported.");
        return Err(ApiError::bad_param(&format!("{param}.type"), message));
    }
    if !format.get("schema").is_some_and(Value::is_object) {
        return Err(ApiError::bad_param(&format!("{param}.schema"), format!("'{param}' needs a JSON schema object.")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    fn names() -> Vec<String> {
        vec!["m".into()]
    }

    fn param(body: Value) -> String {
        let e =
            Messages::parse(Body::read(body.to_string().as_bytes()).unwrap(), names().as_slice().into()).unwrap_err();
        let env: Value = serde_json::from_str(&e.envelope()).unwrap();
        env["error"]["param"].as_str().unwrap_or("").to_string()
    }

    #[test]
    fn messages_checks() {
        let base = json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
        let ok = Messages::parse(Body::read(base.to_string().as_bytes()).unwrap(), names().as_slice().into()).unwrap();
        assert!(!ok.stream && ok.top_k == -1);
        let mut b = base.clone();
        b["top_k"] = json!(5.0);
        b["stream"] = json!(true);
        let r = Messages::parse(Body::read(b.to_string().as_bytes()).unwrap(), names().as_slice().into()).unwrap();
        assert!(r.stream && r.top_k == 5);
        for (extra, field) in [
            (json!({"tool_choice": {"type": "any"}}), "tool_choice"), // no tools
            (
                json!({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "g"}}),
                "tool_choice",
            ),
            (json!({"top_k": -2}), "top_k"),
            (json!({"metadata": 5}), "metadata"),
            (json!({"stream": "x"}), "stream"),
        ] {
            let mut b = base.clone();
            b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            assert_eq!(param(b), field);
        }
        let e = Messages::parse(
            Body::read(json!({"model": "x", "messages": []}).to_string().as_bytes()).unwrap(),
            names().as_slice().into(),
        )
        .unwrap_err();
        assert_eq!(e.status(), 404);
    }

    #[test]
    fn image_blocks_and_tool_results() {
        let url = |param: &str, u: &str| ImageRef::from_url(param.into(), u);
        let body = json!({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://a.example/x.png"}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}},
            {"type": "image", "source": {"type": "file", "file_id": "file_1"}},
            {"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "text", "text": "see"},
                {"type": "image", "source": {"type": "url", "url": "http://c.example/z.png"}},
            ]},
            {"type": "tool_result", "tool_use_id": "u", "content": "plain"},
        ]}]});
        assert_eq!(
            Messages::image_refs(&body),
            [
                url("messages[0].content[0].source.url", "https://a.example/x.png"),
                ImageRef::base64("messages[0].content[1].source.data".into(), "QUJD"),
                url("messages[0].content[3].content[1].source.url", "http://c.example/z.png"),
            ]
        );
    }

    #[test]
    fn anthropic_envelopes_and_error_events() {
        let e = ApiError::ModelNotFound("x".into());
        let v: Value = serde_json::from_str(&Messages::envelope(&e)).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "not_found_error");
        assert!(v["error"]["message"].as_str().unwrap().contains('x'));
        let codec = ApiError::Codec { status: StatusCode::BAD_REQUEST, body: e.envelope() };
        let v: Value = serde_json::from_str(&Messages::envelope(&codec)).unwrap();
        assert_eq!(
            (v["error"]["type"].as_str(), v["error"]["message"].as_str().is_some()),
            (Some("invalid_request_error"), true)
        );
        let media =
            ApiError::Media { message: "no".into(), code: "image_fetch_failed", param: "p".into(), retryable: true };
        let v: Value = serde_json::from_str(&Messages::envelope(&media)).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        let mut tail = BytesMut::new();
        Messages::error_tail(&ApiError::Unavailable("rank 0 died".into()), &mut tail);
        assert!(tail.starts_with(b"event: error\ndata: {") && tail.ends_with(b"}\n\n"));
    }
}

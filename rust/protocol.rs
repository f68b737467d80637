//! The wire protocols a request can speak. One request path serves them all; this is where they differ at the
//! edges: the error envelope, how a stream ends, its keep-alive, and the error event after a 200.

use crate::error::ApiError;
use bytes::BytesMut;
use serde_json::{Value, json};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// OpenAI Chat Completions.
    Chat,
    /// OpenAI (legacy) Completions.
    Completions,
    /// Anthropic Messages.
    Messages,
    /// OpenAI Responses.
    Responses,
}

/// `data: [DONE]`: how OpenAI's Chat and Completions streams end.
const DONE: &[u8] = b"data: [DONE]\n\n";
const KEEP_ALIVE: &[u8] = b": keep-alive\n\n";
const PING: &[u8] = b"event: ping\ndata: {\"type\": \"ping\"}\n\n";

impl Protocol {
    /// The code the Python codec reads (python/deepinfer_server/codec.py, `CHAT` ...).
    pub fn code(self) -> u8 {
        match self {
            Protocol::Chat => 0,
            Protocol::Completions => 1,
            Protocol::Messages => 2,
            Protocol::Responses => 3,
        }
    }

    /// Prefix of response ids, as each provider spells them.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Protocol::Chat => "chatcmpl-",
            Protocol::Completions => "cmpl-",
            Protocol::Messages => "msg_",
            Protocol::Responses => "resp_",
        }
    }

    /// What a finished stream ends with after its last event.
    pub fn done(self) -> &'static [u8] {
        match self {
            Protocol::Chat | Protocol::Completions => DONE,
            Protocol::Messages | Protocol::Responses => b"",
        }
    }

    /// Sent on a silent stream (proxies, dead-peer detection): Anthropic's `ping` event, else an SSE comment.
    pub fn keep_alive(self) -> &'static [u8] {
        if self == Protocol::Messages { PING } else { KEEP_ALIVE }
    }

    /// The error body of a refusal, in this protocol's envelope.
    pub fn envelope(self, err: &ApiError) -> String {
        match self {
            Protocol::Messages => anthropic_envelope(err).to_string(),
            _ => err.envelope(),
        }
    }

    /// How a stream ends when something fails after the 200 was sent.
    pub fn error_tail(self, err: &ApiError) -> BytesMut {
        let mut buf = BytesMut::new();
        match self {
            Protocol::Chat | Protocol::Completions => {
                frame_into(&mut buf, err.envelope().as_bytes());
                buf.extend_from_slice(DONE);
            }
            Protocol::Messages => event_into(&mut buf, "error", anthropic_envelope(err).to_string().as_bytes()),
            Protocol::Responses => {
                let e = openai_error(err);
                let event = json!({
                    "type": "error", "code": e["code"], "message": e["message"], "param": e["param"], "sequence_number": 0,
                });
                event_into(&mut buf, "error", event.to_string().as_bytes());
            }
        }
        buf
    }
}

/// Append one unnamed SSE event `data: <json>\n\n`, or, for text the codec already named (`event: <name>\ndata:
/// <json>`, which a JSON object cannot start like), that event.
pub fn frame_into(buf: &mut BytesMut, json: &[u8]) {
    buf.reserve(json.len() + 8);
    if !json.starts_with(b"event: ") {
        buf.extend_from_slice(b"data: ");
    }
    buf.extend_from_slice(json);
    buf.extend_from_slice(b"\n\n");
}

fn event_into(buf: &mut BytesMut, name: &str, json: &[u8]) {
    buf.extend_from_slice(b"event: ");
    buf.extend_from_slice(name.as_bytes());
    buf.extend_from_slice(b"\ndata: ");
    buf.extend_from_slice(json);
    buf.extend_from_slice(b"\n\n");
}

/// The `error` object of the OpenAI envelope (a codec refusal's ready-made body included).
fn openai_error(err: &ApiError) -> Value {
    serde_json::from_str::<Value>(&err.envelope())
        .ok()
        .and_then(|mut v| v.get_mut("error").map(Value::take))
        .unwrap_or(json!({"message": err.to_string(), "type": "server_error", "param": null, "code": "internal_error"}))
}

/// Anthropic's envelope `{"type": "error", "error": {"type", "message"}}`, with Anthropic's error type for the
/// status (their API's own table; a 503 is `overloaded_error`, as Anthropic says when it cannot serve).
fn anthropic_envelope(err: &ApiError) -> Value {
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
    let message = openai_error(err)["message"].as_str().map_or_else(|| err.to_string(), str::to_string);
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelopes_and_tails_per_protocol() {
        let e = ApiError::ModelNotFound("x".into());
        let v: Value = serde_json::from_str(&Protocol::Messages.envelope(&e)).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "not_found_error");
        assert!(v["error"]["message"].as_str().unwrap().contains('x'));
        let v: Value = serde_json::from_str(&Protocol::Chat.envelope(&e)).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found");
        let codec = ApiError::Codec { status: axum::http::StatusCode::BAD_REQUEST, body: e.envelope() };
        let v: Value = serde_json::from_str(&Protocol::Messages.envelope(&codec)).unwrap();
        assert_eq!(
            (v["error"]["type"].as_str(), v["error"]["message"].as_str().is_some()),
            (Some("invalid_request_error"), true)
        );

        let down = ApiError::Unavailable("rank 0 died".into());
        let chat = Protocol::Chat.error_tail(&down);
        assert!(chat.starts_with(b"data: {\"error\":") && chat.ends_with(DONE));
        let msg = Protocol::Messages.error_tail(&down);
        assert!(msg.starts_with(b"event: error\ndata: {") && msg.ends_with(b"}\n\n"));
        let resp = String::from_utf8(Protocol::Responses.error_tail(&down).to_vec()).unwrap();
        let data: Value = serde_json::from_str(resp.trim_end().split_once("data: ").unwrap().1).unwrap();
        assert_eq!((data["type"].as_str(), data["code"].as_str()), (Some("error"), Some("service_unavailable")));
    }

    #[test]
    fn framing_named_and_unnamed_events() {
        let mut b = BytesMut::new();
        frame_into(&mut b, br#"{"a":1}"#);
        frame_into(&mut b, b"event: x\ndata: {}");
        assert_eq!(&b[..], b"data: {\"a\":1}\n\nevent: x\ndata: {}\n\n");
    }
}

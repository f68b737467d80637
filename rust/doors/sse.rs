//! SSE framing the doors share: OpenAI's unnamed `data:` events ended by `data: [DONE]` (Chat, Completions), and
//! named `event:` lines (Messages, Responses).

use crate::error::ApiError;
use bytes::BytesMut;

/// `data: [DONE]`: how OpenAI's Chat and Completions streams end.
pub const DONE: &[u8] = b"data: [DONE]\n\n";
/// An SSE comment: what a silent stream sends, unless its door has an event for it.
pub const KEEP_ALIVE: &[u8] = b": keep-alive\n\n";

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

/// Append one named event `event: <name>\ndata: <json>\n\n`.
pub fn event_into(buf: &mut BytesMut, name: &str, json: &[u8]) {
    buf.extend_from_slice(b"event: ");
    buf.extend_from_slice(name.as_bytes());
    buf.extend_from_slice(b"\ndata: ");
    buf.extend_from_slice(json);
    buf.extend_from_slice(b"\n\n");
}

/// The end of an OpenAI `data:` stream that failed: the error envelope as an event, then `[DONE]`.
pub fn openai_error_tail(err: &ApiError, buf: &mut BytesMut) {
    frame_into(buf, err.envelope().as_bytes());
    buf.extend_from_slice(DONE);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing_named_and_unnamed_events() {
        let mut b = BytesMut::new();
        frame_into(&mut b, br#"{"a":1}"#);
        frame_into(&mut b, b"event: x\ndata: {}");
        event_into(&mut b, "y", b"{}");
        assert_eq!(&b[..], b"data: {\"a\":1}\n\nevent: x\ndata: {}\n\nevent: y\ndata: {}\n\n");
    }

    #[test]
    fn a_failed_openai_stream_ends_with_its_envelope_and_done() {
        let mut tail = BytesMut::new();
        openai_error_tail(&ApiError::Unavailable("rank 0 died".into()), &mut tail);
        assert!(tail.starts_with(b"data: {\"error\":") && tail.ends_with(DONE));
    }
}

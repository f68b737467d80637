//! The doors: the wire protocols a generation request can come in by. One request path serves them all
//! (`crate::path`: admission, codec, dispatch); what differs between them lives here, one module per door:
//! - its route and the prefix of its response ids;
//! - its request checks, done before any Python runs (the codec converts and validates the rest);
//! - where its body carries images, and how a served name that pins the thinking mode says so;
//! - its error envelope, and its SSE framing: how a stream ends, keeps alive, and fails after the 200.
//!
//! The path knows the doors only through `Door`, a `Copy` enum whose methods call the door's `Spec` through a
//! `match`: static calls, nothing allocated. Shared field checks live in `fields`, tool choices in `tools`.

mod chat;
mod completions;
pub mod fields;
mod messages;
mod request;
mod responses;
pub mod sse;
mod tools;

use crate::error::ApiError;
use crate::media::ImageRef;
use axum::response::Response;
use bytes::BytesMut;
use serde_json::{Map, Value};

pub use request::GenerateRequest;
pub use tools::ForcedTool;

/// How a door sets a pinned thinking mode in its body (`Spec::PIN_THINKING`).
pub type PinThinking = fn(&mut Map<String, Value>, bool);

/// Everything one door changes. A door is a module with a unit type implementing this.
pub trait Spec {
    /// Its route (`POST`); the pre-handler refusals of every path under it use its envelope too.
    const PATH: &'static str;
    /// Its name, lower case: exported with its code as `_native.DOOR_<NAME>`.
    const NAME: &'static str;
    /// The code the Python codec knows it by: exported as `_native.DOOR_<NAME>` (codec/seam.rs), which the
    /// codec's door table is keyed by (python/deepinfer_server/doors/).
    const CODE: u8;
    /// Prefix of its response ids, as the provider spells them.
    const ID_PREFIX: &'static str;
    /// What a finished stream ends with after its last event.
    const DONE: &'static [u8];
    /// Sent on a silent stream (proxies, dead-peer detection).
    const KEEP_ALIVE: &'static [u8];
    /// A served name that pins the thinking mode overrides what the body says (None: the door has no switch).
    const PIN_THINKING: Option<PinThinking>;

    /// The request checks done in Rust: JSON shape, model, what the front end needs, what the server cannot do.
    fn parse(raw: &[u8], served: &[String]) -> Result<GenerateRequest, ApiError>;
    /// Every image in the body, data URLs included, in request order. Shapes are only read: a malformed part is
    /// left for the codec to refuse with its own message.
    fn image_refs(body: &Value) -> Vec<ImageRef>;
    /// The error body of a refusal.
    fn envelope(err: &ApiError) -> String;
    /// How a stream ends when something fails after the 200 was sent.
    fn error_tail(err: &ApiError, buf: &mut BytesMut);
}

/// The doors. Adding one: a module with its `Spec`, a variant here, an arm in `spec!` (its route is registered
/// from `Door::ALL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Door {
    /// OpenAI Chat Completions.
    Chat,
    /// OpenAI (legacy) Completions.
    Completions,
    /// Anthropic Messages.
    Messages,
    /// OpenAI Responses.
    Responses,
}

/// `$body` with `$D` naming the door's `Spec` type.
macro_rules! spec {
    ($door:expr, $D:ident => $body:expr) => {
        match $door {
            Door::Chat => {
                type $D = chat::Chat;
                $body
            }
            Door::Completions => {
                type $D = completions::Completions;
                $body
            }
            Door::Messages => {
                type $D = messages::Messages;
                $body
            }
            Door::Responses => {
                type $D = responses::Responses;
                $body
            }
        }
    };
}

impl Door {
    pub const ALL: [Door; 4] = [Door::Chat, Door::Completions, Door::Messages, Door::Responses];

    pub fn path(self) -> &'static str {
        spec!(self, D => D::PATH)
    }

    /// The door whose route `path` is, or is under (`/v1/messages/count_tokens`); Chat's, whose envelope is the
    /// OpenAI one every other route uses, for any other path.
    pub fn for_path(path: &str) -> Door {
        let under =
            |door: &Door| path.strip_prefix(door.path()).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
        Door::ALL.into_iter().find(under).unwrap_or(Door::Chat)
    }

    pub fn code(self) -> u8 {
        spec!(self, D => D::CODE)
    }

    /// What its requests are in OpenTelemetry's `gen_ai.operation.name` (traces): the conversation doors chat.
    pub fn operation(self) -> &'static str {
        match self {
            Door::Completions => "text_completion",
            Door::Chat | Door::Messages | Door::Responses => "chat",
        }
    }

    pub fn name(self) -> &'static str {
        spec!(self, D => D::NAME)
    }

    pub fn id_prefix(self) -> &'static str {
        spec!(self, D => D::ID_PREFIX)
    }

    pub fn parse(self, raw: &[u8], served: &[String]) -> Result<GenerateRequest, ApiError> {
        spec!(self, D => D::parse(raw, served))
    }

    /// The body with the thinking mode a served name pins (`--served-model-name`'s `deepseek-chat` and
    /// `deepseek-reasoner` do), whatever it said. The body is parsed again for this, for pinned names only.
    pub fn pin_thinking(self, body: &[u8], on: bool) -> Result<Vec<u8>, ApiError> {
        let Some(pin) = spec!(self, D => D::PIN_THINKING) else { return Ok(body.to_vec()) };
        let mut v: Value = serde_json::from_slice(body).map_err(|_| ApiError::Internal)?;
        pin(v.as_object_mut().ok_or(ApiError::Internal)?, on);
        serde_json::to_vec(&v).map_err(|_| ApiError::Internal)
    }

    pub fn envelope(self, err: &ApiError) -> String {
        spec!(self, D => D::envelope(err))
    }

    /// The refusal as an HTTP response in this door's envelope.
    pub fn respond(self, err: ApiError) -> Response {
        let body = self.envelope(&err);
        err.respond(body)
    }

    pub fn done(self) -> &'static [u8] {
        spec!(self, D => D::DONE)
    }

    pub fn keep_alive(self) -> &'static [u8] {
        spec!(self, D => D::KEEP_ALIVE)
    }

    pub fn error_tail(self, err: &ApiError) -> BytesMut {
        let mut buf = BytesMut::new();
        spec!(self, D => D::error_tail(err, &mut buf));
        buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_door_has_its_own_code_path_and_prefix() {
        for (i, a) in Door::ALL.iter().enumerate() {
            for b in &Door::ALL[i + 1..] {
                assert_ne!(a.code(), b.code());
                assert_ne!(a.name(), b.name());
                assert_ne!(a.path(), b.path());
                assert_ne!(a.id_prefix(), b.id_prefix());
            }
            assert_eq!(Door::for_path(a.path()), *a);
        }
        // The codes python/deepinfer_server/codec.py reads.
        assert_eq!(Door::ALL.map(Door::code), [0, 1, 2, 3]);
    }

    #[test]
    fn paths_under_a_door_are_its_own() {
        assert_eq!(Door::for_path("/v1/messages/count_tokens"), Door::Messages);
        assert_eq!(Door::for_path("/v1/chat/completions/render"), Door::Chat);
        assert_eq!(Door::for_path("/v1/messagesX"), Door::Chat);
        assert_eq!(Door::for_path("/health"), Door::Chat);
    }

    #[test]
    fn a_door_without_a_thinking_switch_keeps_its_body() {
        let body = br#"{"model":"m",  "prompt":"x"}"#;
        assert_eq!(Door::Completions.pin_thinking(body, true).unwrap(), body);
    }
}

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
mod choices;
mod completions;
pub mod fields;
mod generate;
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
use std::collections::HashMap;
#[cfg(test)]
use std::sync::LazyLock;

pub use generate::Split;
pub use request::{Body, GenerateRequest, Keeping};
pub use tools::ForcedTool;

/// How a door sets a pinned thinking mode in its body (`Spec::PIN_THINKING`).
pub type PinThinking = fn(&mut Map<String, Value>, bool);

/// The model names this server answers to, and the thinking mode a name pins (`--served-model-name
/// NAME=thinking|no-thinking`; `deepseek-chat` and `deepseek-reasoner` do), whatever the body says.
#[derive(Clone, Copy)]
pub struct Served<'a> {
    pub names: &'a [String],
    pub pins: &'a HashMap<String, bool>,
}

#[cfg(test)]
static NO_PINS: LazyLock<HashMap<String, bool>> = LazyLock::new(HashMap::new);

/// Names that pin nothing: the doors' own tests.
#[cfg(test)]
impl<'a> From<&'a [String]> for Served<'a> {
    fn from(names: &'a [String]) -> Self {
        Served { names, pins: &NO_PINS }
    }
}

impl<'a> From<&'a crate::config::ServerConfig> for Served<'a> {
    fn from(config: &'a crate::config::ServerConfig) -> Self {
        Served { names: &config.served_model_names, pins: &config.thinking_pins }
    }
}

impl Served<'_> {
    /// Set the thinking mode `model` pins in a door's checked body, if it pins one and the door has a switch.
    pub fn pin<D: Spec>(self, body: &mut Value, model: &str) -> Result<(), ApiError> {
        if let (Some(pin), Some(&on)) = (D::PIN_THINKING, self.pins.get(model)) {
            pin(body.as_object_mut().ok_or(ApiError::Internal)?, on);
        }
        Ok(())
    }
}

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
    /// A body may ask for several sequences, each its own request on the path (`/generate`'s batches and `n`):
    /// its route splits the body first (`http::fanout`), then parses each sequence's body.
    const FANS_OUT: bool = false;

    /// A fanning door's sequences (`FANS_OUT`), each body a single request of the door; `raw_len`: the body's
    /// size, `bounds`: the fan-out's limits (sequences, bytes). A door that does not fan out has one.
    fn split(body: Value, request_id: &str, raw_len: usize, bounds: (usize, usize)) -> Result<Split, ApiError> {
        let _ = (raw_len, bounds);
        let stream = body.get("stream") == Some(&Value::Bool(true));
        Ok(Split { bodies: vec![body], rids: vec![request_id.to_string()], single: true, stream, choices: false })
    }

    /// The request checks done in Rust: JSON shape, model, what the front end needs, what the server cannot do.
    /// The thinking mode a served name pins is set here too (`Served::pin`), so a body is parsed once.
    fn parse(body: Body, served: Served<'_>) -> Result<GenerateRequest, ApiError>;
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
    /// SGLang's native generate.
    Generate,
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
            Door::Generate => {
                type $D = generate::Generate;
                $body
            }
        }
    };
}

impl Door {
    pub const ALL: [Door; 5] = [Door::Chat, Door::Completions, Door::Messages, Door::Responses, Door::Generate];

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
            Door::Completions | Door::Generate => "text_completion",
            Door::Chat | Door::Messages | Door::Responses => "chat",
        }
    }

    pub fn name(self) -> &'static str {
        spec!(self, D => D::NAME)
    }

    /// Whether a body may ask for several sequences (`Spec::FANS_OUT`).
    pub fn fans_out(self) -> bool {
        spec!(self, D => D::FANS_OUT)
    }

    pub fn id_prefix(self) -> &'static str {
        spec!(self, D => D::ID_PREFIX)
    }

    /// The sequences a fanning door's body asks for (`Spec::split`).
    pub fn split(
        self,
        body: Value,
        request_id: &str,
        raw_len: usize,
        bounds: (usize, usize),
    ) -> Result<Split, ApiError> {
        spec!(self, D => D::split(body, request_id, raw_len, bounds))
    }

    /// A request from its body's bytes.
    pub fn parse(self, raw: &[u8], served: Served<'_>) -> Result<GenerateRequest, ApiError> {
        self.parse_body(Body::read(raw)?, served)
    }

    /// A request from its body, parsed already (a batch line's), with no second pass over its bytes.
    pub fn parse_body(self, body: Body, served: Served<'_>) -> Result<GenerateRequest, ApiError> {
        spec!(self, D => D::parse(body, served))
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
        assert_eq!(Door::ALL.map(Door::code), [0, 1, 2, 3, 4]);
    }

    #[test]
    fn paths_under_a_door_are_its_own() {
        assert_eq!(Door::for_path("/v1/messages/count_tokens"), Door::Messages);
        assert_eq!(Door::for_path("/v1/chat/completions/render"), Door::Chat);
        assert_eq!(Door::for_path("/v1/messagesX"), Door::Chat);
        assert_eq!(Door::for_path("/health"), Door::Chat);
    }

    #[test]
    fn a_pinned_name_sets_thinking_as_the_door_parses() {
        let names = vec!["m".to_string()];
        let (off, on) = (HashMap::from([("m".to_string(), false)]), HashMap::from([("m".to_string(), true)]));
        let thinking = |door: Door, raw: &str, pins: &HashMap<String, bool>| {
            let req = door.parse(raw.as_bytes(), Served { names: &names, pins }).unwrap();
            serde_json::from_slice::<Value>(&req.body).unwrap()
        };
        let chat = r#"{"model":"m","messages":[{"role":"user","content":"x"}],"thinking":{"type":"enabled"}}"#;
        assert_eq!(thinking(Door::Chat, chat, &off)["thinking"]["type"], "disabled");
        // Messages thinks only when asked; a name that pins thinking on turns it on.
        let messages = r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"x"}]}"#;
        assert_eq!(thinking(Door::Messages, messages, &Default::default())["thinking"]["type"], "disabled");
        assert_eq!(thinking(Door::Messages, messages, &on)["thinking"]["type"], "enabled");
        let responses = r#"{"model":"m","input":"x","reasoning":{"effort":"low"}}"#;
        assert_eq!(thinking(Door::Responses, responses, &off)["reasoning"]["effort"], "none");
        // A door without a thinking switch keeps its body.
        let completions = r#"{"model":"m","prompt":"x"}"#;
        assert_eq!(thinking(Door::Completions, completions, &on), thinking(Door::Completions, completions, &off));
        let generate = r#"{"text":"x"}"#;
        assert_eq!(thinking(Door::Generate, generate, &on), thinking(Door::Generate, generate, &off));
    }
}

//! SGLang's native `POST /generate` (what RL rollout frameworks drive: slime, verl, AReaL, ...): a raw prompt as
//! `text` or `input_ids`, `sampling_params`, and `text`, `output_ids` and `meta_info` back. A body may hold a
//! batch of prompts and `n` samples of each: `batch` splits it into one request per sequence, each checked here
//! (`params`) as a door's request and run down the one request path; `http::fanout` puts the answers together.
//!
//! Errors use SGLang's envelope, `{"error": {"message", ...}}`; a stream ends with `data: [DONE]` once, after its
//! last sequence (`http::fanout`), so each sequence's own stream ends with nothing.

mod batch;
mod params;

use super::{Body, GenerateRequest, PinThinking, Served, Spec, sse};
use crate::error::ApiError;
use crate::media::ImageRef;
use bytes::BytesMut;
use serde_json::{Value, json};

pub use batch::Split;

pub struct Generate;

impl Spec for Generate {
    const PATH: &'static str = "/generate";
    const NAME: &'static str = "generate";
    const CODE: u8 = 4;
    const ID_PREFIX: &'static str = "gen-";
    /// Nothing: the fan-out ends the whole stream with one `data: [DONE]` after its last sequence.
    const DONE: &'static [u8] = b"";
    const KEEP_ALIVE: &'static [u8] = sse::KEEP_ALIVE;
    /// A raw prompt has no thinking switch.
    const PIN_THINKING: Option<PinThinking> = None;
    const FANS_OUT: bool = true;

    fn split(body: Value, request_id: &str, _raw_len: usize, bounds: (usize, usize)) -> Result<Split, ApiError> {
        batch::split(body, request_id, bounds)
    }

    fn parse(body: Body, served: Served<'_>) -> Result<GenerateRequest, ApiError> {
        let mut v = body.json;
        // SGLang serves one model and names none in the request: the first served name is the one.
        let model = served.names.first().cloned().ok_or(ApiError::Internal)?;
        let obj = v.as_object_mut().ok_or_else(|| ApiError::bad_request("The request body must be a JSON object."))?;
        if !obj.get("sampling_params").is_some_and(Value::is_object) {
            obj.insert("sampling_params".into(), Value::Object(Default::default()));
        }
        let sampling = params::check(obj)?;
        let priority = super::fields::take_priority(obj)?;
        let stream = obj.get("stream") == Some(&Value::Bool(true));
        Ok(GenerateRequest {
            model,
            stream,
            include_usage: false,
            continuous_usage: false,
            ignore_eos: sampling.ignore_eos,
            top_k: sampling.top_k,
            seed: sampling.seed,
            forced_tool: None,
            priority,
            images: Vec::new(), // no image inputs (`image_data` is refused)
            keeping: None,
            owner: Default::default(),
            body: serde_json::to_vec(&v).map_err(|_| ApiError::Internal)?,
        })
    }

    /// Images (`image_data`) are refused: none to find.
    fn image_refs(_body: &Value) -> Vec<ImageRef> {
        Vec::new()
    }

    fn envelope(err: &ApiError) -> String {
        envelope(err)
    }

    /// SGLang's error event (its stream's, with the HTTP status as `code`); `[DONE]` follows after the last
    /// sequence.
    fn error_tail(err: &ApiError, buf: &mut BytesMut) {
        sse::frame_into(buf, envelope(err).as_bytes());
    }
}

/// SGLang's error body, `{"error": {"message", "type", "param", "code"}}` with the HTTP status as `code`, as its
/// stream's error events have it (its JSON errors carry the message alone).
fn envelope(err: &ApiError) -> String {
    let o = err.error_object();
    json!({"error": {"message": o["message"], "type": o["type"], "param": o["param"], "code": err.status().as_u16()}})
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_sequence_parses_into_a_request() {
        let names = vec!["m".to_string()];
        let raw = r#"{"text":"x","rid":"r","sampling_params":{"top_k":5,"ignore_eos":true,"sampling_seed":7},
            "priority":3}"#;
        let req = Generate::parse(Body::read(raw.as_bytes()).unwrap(), names.as_slice().into()).unwrap();
        assert_eq!((req.model.as_str(), req.top_k, req.seed, req.ignore_eos, req.priority), ("m", 5, Some(7), true, 3));
        let body: Value = serde_json::from_slice(&req.body).unwrap();
        assert_eq!(body["sampling_params"]["max_new_tokens"], 128);
    }

    #[test]
    fn errors_have_sglangs_envelope() {
        let e: Value = serde_json::from_str(&envelope(&ApiError::bad_param("text", "no"))).unwrap();
        assert_eq!(
            e,
            json!({"error": {"message": "no", "type": "invalid_request_error", "param": "text", "code": 400}})
        );
        let mut tail = BytesMut::new();
        Generate::error_tail(&ApiError::Internal, &mut tail);
        assert!(tail.starts_with(b"data: {\"error\":") && tail.ends_with(b"}\n\n"));
    }
}

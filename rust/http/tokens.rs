//! Token counting, from the encoder that serves requests, so a count equals the prompt tokens the same request
//! reports: `POST /v1/messages/count_tokens` (Anthropic's shape), and vLLM's `POST /tokenize` and `/detokenize`.
//!
//! Each takes an admission slot as a generation request does (429 when none is free, or a place in the wait
//! queue): it costs a codec thread and may fetch images, so it counts against the same capacity.

use super::AppState;
use super::body::RawBody;
use super::traced::{TraceParent, answered};
use crate::doors::{Door, fields};
use crate::error::ApiError;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Instant;

pub async fn count_messages_tokens(State(st): State<Arc<AppState>>, parent: TraceParent, body: RawBody) -> Response {
    let traced = parent.begin(&st, Instant::now(), "count_tokens", "/v1/messages/count_tokens");
    answered(traced, count(&st, Door::Messages, body).await, |e| Door::Messages.respond(e))
}

/// A count of what `door`'s request with this body would prompt: the body goes through the door's own checks.
async fn count(st: &AppState, door: Door, RawBody(body): RawBody) -> Result<Response, ApiError> {
    let body = body?;
    let req = door.parse(&body, (&st.config).into())?;
    let _slot = st.admission.admit(0, false).await?;
    let images = fetch_images(st, &req.images).await?;
    let out = st.codec.call("count_tokens", req.body, door, images).await?;
    Ok(([(header::CONTENT_TYPE, "application/json")], out).into_response())
}

/// `POST /tokenize`: `{"prompt": text}` or a chat body's `{"messages": [...]}`; `model` may be left out.
pub async fn tokenize(State(st): State<Arc<AppState>>, parent: TraceParent, body: RawBody) -> Response {
    let traced = parent.begin(&st, Instant::now(), "tokenize", "/tokenize");
    answered(traced, tokens_call(&st, "tokenize", body).await, |e| Door::Chat.respond(e))
}

/// `POST /detokenize`: `{"tokens": [...]}` → `{"prompt": text}`.
pub async fn detokenize(State(st): State<Arc<AppState>>, parent: TraceParent, body: RawBody) -> Response {
    let traced = parent.begin(&st, Instant::now(), "detokenize", "/detokenize");
    answered(traced, tokens_call(&st, "detokenize", body).await, |e| Door::Chat.respond(e))
}

/// A count includes the images' tokens, so URL images are fetched as a request's would be (their size decides).
async fn fetch_images(
    st: &AppState,
    refs: &[crate::media::ImageRef],
) -> Result<Option<Vec<(String, bytes::Bytes)>>, ApiError> {
    if refs.is_empty() {
        return Ok(None);
    }
    let deadline = st.config.request_timeout().map(|t| tokio::time::Instant::now() + t);
    Ok(Some(st.media.fetch(refs, deadline).await?.into_iter().collect()))
}

async fn tokens_call(st: &AppState, method: &'static str, RawBody(body): RawBody) -> Result<Response, ApiError> {
    let body = body?;
    let mut v: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")))?;
    let obj = v.as_object_mut().ok_or_else(|| ApiError::bad_request("The request body must be a JSON object."))?;
    let served = &st.config.served_model_names;
    if obj.get("model").is_none_or(serde_json::Value::is_null) {
        obj.insert("model".into(), served.first().cloned().unwrap_or_default().into());
    }
    let raw = serde_json::to_vec(&v).map_err(|_| ApiError::Internal)?;
    let _slot = st.admission.admit(0, false).await?;
    // A chat body goes through chat's own checks and normalizations, so its count is the request's prompt_tokens.
    let (body, images) = if method == "tokenize" && v.get("messages").is_some() {
        let req = Door::Chat.parse(&raw, (&st.config).into())?;
        (req.body, fetch_images(st, &req.images).await?)
    } else {
        fields::model_of(&v, served)?;
        (raw, None)
    };
    let out = st.codec.call(method, body, Door::Chat, images).await?;
    Ok(([(header::CONTENT_TYPE, "application/json")], out).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::tests::state;
    use serde_json::{Value, json};

    async fn refused(door: Door, body: Value) -> Value {
        let st = state(None);
        let body = RawBody(Ok(body.to_string().into()));
        let err = count(&st, door, body).await.expect_err("refused before the codec");
        serde_json::from_str::<Value>(&err.envelope()).unwrap()["error"]["param"].clone()
    }

    #[tokio::test]
    async fn a_count_checks_the_body_as_its_door_does() {
        let msgs = json!([{"role": "user", "content": "hi"}]);
        // Chat refuses n = 2 and Messages a negative top_k; neither checks the other's field.
        let chat = json!({"model": "test-model", "messages": msgs, "n": 2});
        assert_eq!(refused(Door::Chat, chat).await, "n");
        let messages = json!({"model": "test-model", "max_tokens": 5, "messages": msgs, "top_k": -2});
        assert_eq!(refused(Door::Messages, messages).await, "top_k");
    }
}

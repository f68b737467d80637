//! Token counting: `POST /v1/messages/count_tokens` (Anthropic's shape), from the encoder that serves requests, so
//! the count equals the `usage.input_tokens` of the same request.

use super::AppState;
use super::doors;
use super::generate::{RawBody, read_body};
use crate::error::ApiError;
use crate::protocol::Protocol;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

pub async fn count_messages_tokens(State(st): State<Arc<AppState>>, body: RawBody) -> Response {
    count(&st, Protocol::Messages, body).await.unwrap_or_else(|e| e.response_for(Protocol::Messages))
}

async fn count(st: &AppState, protocol: Protocol, body: RawBody) -> Result<Response, ApiError> {
    let body = read_body(st, body)?;
    let req = doors::messages(&body, &st.config.served_model_names)?;
    let (status, out) = st.codec.call("count_tokens", req.body, protocol).await?;
    if status != 200 {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
        return Err(ApiError::Codec { status, body: out });
    }
    Ok(([(header::CONTENT_TYPE, "application/json")], out).into_response())
}

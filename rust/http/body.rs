//! A JSON route's request body, read whole (up to `--max-request-body-bytes`, by its deadline), or the refusal
//! for it: 413, 408, or 415 for a body whose `Content-Type` is not JSON.
//!
//! Why 415: a web page may send a "simple" cross-origin request (`text/plain`, a form) without a CORS preflight,
//! so a server that takes any body would let every page a user of the host opens drive it. The openai, anthropic,
//! GuideLLM and inference-perf clients all send `application/json`; a request without a `Content-Type` is still
//! taken (no browser sends one).

use super::AppState;
use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::{StatusCode, header};
use std::convert::Infallible;
use std::sync::Arc;

/// The body, or why it cannot be taken; the handler renders a refusal in its door's envelope.
pub struct RawBody(pub Result<Bytes, ApiError>);

impl FromRequest<Arc<AppState>> for RawBody {
    type Rejection = Infallible;

    async fn from_request(req: Request, st: &Arc<AppState>) -> Result<Self, Infallible> {
        let json = req.headers().get(header::CONTENT_TYPE).is_none_or(|v| is_json(v.as_bytes()));
        // Read even a body that will be refused: a keep-alive connection stays usable.
        let read = Bytes::from_request(req, st).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge(st.config.max_body_bytes)
            } else if timed_out(&e) {
                ApiError::BodyTimeout(st.config.client_timeout_s)
            } else {
                ApiError::bad_request("Could not read the request body.")
            }
        });
        Ok(RawBody(read.and_then(|b| if json { Ok(b) } else { Err(ApiError::NotJson) })))
    }
}

/// `application/json` or a `+json` type (`application/vnd.api+json`), parameters (`; charset=utf-8`) aside.
fn is_json(value: &[u8]) -> bool {
    let essence = value.split(|&b| b == b';').next().unwrap_or_default().trim_ascii();
    essence.eq_ignore_ascii_case(b"application/json")
        || (essence.len() > 5 && essence[essence.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

/// Whether reading the body failed because it did not arrive in time (`client_io::DeadlineBody`).
fn timed_out(e: &BytesRejection) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cause {
        if err.is::<crate::client_io::BodyDeadline>() {
            return true;
        }
        cause = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::is_json;

    #[test]
    fn json_content_types() {
        for ok in
            ["application/json", "Application/JSON; charset=utf-8", "application/vnd.api+json", " application/json "]
        {
            assert!(is_json(ok.as_bytes()), "{ok}");
        }
        for bad in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "", "+json"] {
            assert!(!is_json(bad.as_bytes()), "{bad}");
        }
    }
}

//! A JSON route's request body, read whole (up to `--max-request-body-bytes`, by its deadline), or the refusal
//! for it: 413, 408, or 415 for a body whose `Content-Type` is not JSON; then 413 or 400 for JSON with more
//! values, or deeper, than `--max-json-elements` and `--max-json-depth` allow (`json_bounds`), before any route
//! builds anything from it.
//!
//! Why 415: a web page may send a "simple" cross-origin request (`text/plain`, a form) without a CORS preflight,
//! so a server that takes any body would let every page a user of the host opens drive it. The openai, anthropic,
//! GuideLLM and inference-perf clients all send `application/json`. A body without a `Content-Type` is refused too:
//! a page's `fetch` with a `Blob` body sends none. Only an empty body may come without one (`http::cross_site`
//! refuses a page's bodiless writes by their `Origin`).

use super::route_state::RouteState;
use crate::error::ApiError;
use crate::json_bounds::{self, JsonBounds};
use crate::limits::MAX_INLINE_CHECK_BYTES;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{FromRequest, Request};
use axum::http::header;
use bytes::BytesMut;
use futures_util::StreamExt;
use std::convert::Infallible;

/// The body, or why it cannot be taken; the handler renders a refusal in its door's envelope.
pub struct RawBody(pub Result<Bytes, ApiError>);

impl FromRequest<RouteState> for RawBody {
    type Rejection = Infallible;

    async fn from_request(req: Request, routes: &RouteState) -> Result<Self, Infallible> {
        let st = &routes.path;
        let json = req.headers().get(header::CONTENT_TYPE).map(|v| is_json(v.as_bytes()));
        // Read even a body that will be refused: a keep-alive connection stays usable.
        let read = collect(req.into_body(), st.config.limits.max_request_body_bytes).await.map_err(|e| match e {
            Collect::TooLarge => ApiError::PayloadTooLarge(st.config.limits.max_request_body_bytes),
            Collect::Failed(e) if timed_out(e.as_ref()) => ApiError::BodyTimeout(st.config.limits.client_timeout_s),
            Collect::Failed(_) => ApiError::bad_request("Could not read the request body."),
        });
        let read = read.and_then(|b| if json.unwrap_or(b.is_empty()) { Ok(b) } else { Err(ApiError::NotJson) });
        Ok(RawBody(match read {
            Ok(b) => bounded(b, st.config.json_bounds()).await,
            Err(e) => Err(e),
        }))
    }
}

/// The body if its JSON is within the bounds. A large body is walked on a blocking thread: 16 MiB takes some
/// milliseconds, which a runtime thread owes the connections it serves.
async fn bounded(body: Bytes, bounds: JsonBounds) -> Result<Bytes, ApiError> {
    let checked = if body.len() <= MAX_INLINE_CHECK_BYTES {
        json_bounds::check(&body, bounds).map(|()| body)
    } else {
        let walk = tokio::task::spawn_blocking(move || json_bounds::check(&body, bounds).map(|()| body));
        walk.await.map_err(|_| ApiError::Internal)?
    };
    checked.map_err(|e| e.refusal())
}

enum Collect {
    TooLarge,
    Failed(axum::BoxError),
}

/// The body's bytes, copied out of each frame as it comes. A frame's `Bytes` is a slice of hyper's read buffer and
/// keeps that whole buffer alive: holding a trickled body's one-byte frames (as `BodyExt::collect` does) pinned a
/// read buffer of kilobytes per byte, about 100 KiB per connection over a 30 s trickle.
async fn collect(body: Body, limit: usize) -> Result<Bytes, Collect> {
    let hint = usize::try_from(body.size_hint().lower()).unwrap_or(usize::MAX);
    if hint > limit {
        return Err(Collect::TooLarge);
    }
    // Nothing reserved for the declared length: a `Content-Length` costs a client nothing to claim, and each of
    // 4,000 trickled bodies declaring 1 MB held 64 KiB. The buffer grows (doubling) with what has arrived.
    let mut out = BytesMut::new();
    let mut frames = body.into_data_stream();
    while let Some(frame) = frames.next().await {
        let data = frame.map_err(|e| Collect::Failed(e.into_inner()))?;
        if out.len() + data.len() > limit {
            return Err(Collect::TooLarge);
        }
        out.extend_from_slice(&data);
    }
    Ok(out.freeze())
}

/// `application/json` or a `+json` type (`application/vnd.api+json`), parameters (`; charset=utf-8`) aside.
fn is_json(value: &[u8]) -> bool {
    let essence = value.split(|&b| b == b';').next().unwrap_or_default().trim_ascii();
    essence.eq_ignore_ascii_case(b"application/json")
        || (essence.len() > 5 && essence[essence.len() - 5..].eq_ignore_ascii_case(b"+json"))
}

/// Whether reading the body failed because it did not arrive in time (`client_io::DeadlineBody`).
fn timed_out(e: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
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

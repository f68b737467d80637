//! Request heads over the documented limits get a 431 in the envelope of the door the path names (Anthropic's under
//! `/v1/messages`, else OpenAI's). hyper refuses bigger or longer heads itself with a bare 431, before any path is
//! known (`listener.rs` sets its bounds well above these); between the two, the answer is ours.

use super::AppState;
use super::drain::refuse;
use crate::doors::Door;
use crate::error::ApiError;
use crate::limits::{MAX_HEAD_BYTES, MAX_HEADERS};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use std::sync::Arc;

pub async fn head_limits(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let headers = req.headers();
    // Each header line also costs ": " and CRLF; of the request line, the target is what a client can grow.
    let target = req.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    let bytes = target + headers.iter().map(|(name, value)| name.as_str().len() + value.len() + 4).sum::<usize>();
    if headers.len() > MAX_HEADERS || bytes > MAX_HEAD_BYTES {
        let refusal = ApiError::HeadersTooLarge {
            headers: headers.len(),
            bytes,
            max_headers: MAX_HEADERS,
            max_bytes: MAX_HEAD_BYTES,
        };
        st.dispatcher.metrics.rejected.with_label_values(&[refusal.code()]).inc();
        let door = Door::for_path(req.uri().path());
        return refuse(req.into_body(), refusal, door).await;
    }
    next.run(req).await
}

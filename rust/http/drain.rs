//! Refusals decided on the request head (401, 403, 404, 405, 431) are answered without waiting on a body the
//! client may never send. A small body that is there already, or arrives at once, is read and dropped so that a
//! keep-alive connection stays usable (hyper closes a connection whose request body was left unread, without a
//! `Connection: close`, and a keep-alive client's next request on it then fails). Past that the response says the
//! connection closes and nothing more is read: a refused client gets no more of the server than a few KB and a
//! second, whatever `Content-Length` it declares.

use crate::doors::Door;
use crate::error::ApiError;
use crate::limits::MAX_DRAIN_BYTES;
use axum::body::{Body, HttpBody};
use axum::http::{HeaderValue, header};
use axum::response::Response;
use futures_util::StreamExt;
use std::time::Duration;

/// How long its body may take to arrive: a client that sent it is done in milliseconds.
pub const DRAIN_WAIT: Duration = Duration::from_secs(1);

/// `err` as a response in `door`'s envelope, after reading and dropping a small request body. A body declared or
/// found larger than `MAX_DRAIN_BYTES`, or one that fails or is not whole within `DRAIN_WAIT`, is left, and the
/// response says the connection closes.
pub async fn refuse(body: Body, err: ApiError, door: Door) -> Response {
    let drained = body.size_hint().lower() <= MAX_DRAIN_BYTES
        && tokio::time::timeout(DRAIN_WAIT, drain(body)).await.unwrap_or(false);
    let mut resp = door.respond(err);
    if !drained {
        resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

async fn drain(body: Body) -> bool {
    let mut data = body.into_data_stream();
    let mut seen = 0u64;
    while let Some(chunk) = data.next().await {
        match chunk {
            Ok(bytes) => {
                seen += bytes.len() as u64;
                if seen > MAX_DRAIN_BYTES {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    fn closes(resp: &Response) -> bool {
        resp.headers().get(header::CONNECTION).is_some_and(|v| v == "close")
    }

    #[tokio::test]
    async fn a_small_body_is_read_and_the_connection_kept() {
        let resp = refuse(Body::from(vec![b'x'; 1000]), ApiError::Unauthorized, Door::Chat).await;
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        assert!(!closes(&resp));
    }

    #[tokio::test]
    async fn a_large_body_is_left_and_the_connection_closed() {
        let big = vec![b'x'; MAX_DRAIN_BYTES as usize + 1];
        let resp = refuse(Body::from(big), ApiError::Unauthorized, Door::Chat).await;
        assert!(closes(&resp));
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_does_not_come_is_not_waited_for() {
        let (_tx, body) = http_body_util::channel::Channel::<axum::body::Bytes, std::io::Error>::new(1);
        let started = tokio::time::Instant::now();
        let resp = refuse(Body::new(body), ApiError::Unauthorized, Door::Chat).await;
        assert!(closes(&resp));
        assert_eq!(started.elapsed(), DRAIN_WAIT);
    }
}

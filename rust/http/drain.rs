//! Refusals decided before the request body is read (401, 404, 405, 431) still read it, up to the body limit, so
//! that the connection stays usable: hyper closes a connection whose request body was left unread, without a
//! `Connection: close`, and a keep-alive client's next request on it then fails.

use crate::doors::Door;
use crate::error::ApiError;
use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use futures_util::StreamExt;

/// `err` as a response in `door`'s envelope, after reading and dropping the request body. A body over `limit` bytes, or one that fails
/// or stalls (the listener's body deadline), is left, and the response says the connection closes.
pub async fn refuse(body: Body, limit: usize, err: ApiError, door: Door) -> Response {
    let drained = drain(body, limit).await;
    let mut resp = door.respond(err);
    if !drained {
        resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

async fn drain(body: Body, limit: usize) -> bool {
    let mut data = body.into_data_stream();
    let mut seen = 0usize;
    while let Some(chunk) = data.next().await {
        match chunk {
            Ok(bytes) => {
                seen += bytes.len();
                if seen > limit {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
    true
}

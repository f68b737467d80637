//! `X-Request-Id`: echo a sane client-supplied id, or make one, and put it on the response and in the logs.

use axum::extract::Request;
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use std::sync::atomic::{AtomicU64, Ordering};

pub const HEADER: &str = "x-request-id";

/// The id of the request being served, in the request's extensions.
#[derive(Clone)]
pub struct RequestId(pub String);

static NEXT: AtomicU64 = AtomicU64::new(1);

fn acceptable(v: &str) -> bool {
    !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic())
}

pub async fn request_id(mut req: Request, next: Next) -> Response {
    let id = match req.headers().get(HEADER).and_then(|v| v.to_str().ok()) {
        Some(v) if acceptable(v) => v.to_string(),
        _ => format!("req-{:x}-{:x}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)),
    };
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert(HEADER, v);
    }
    resp
}

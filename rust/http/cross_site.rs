//! Writes from web pages of other origins are refused (403 in the door's envelope). A page may send a form post
//! (`multipart/form-data`: an upload) or a POST without a body (a cancel, an empty conversation) to any server
//! with no CORS preflight, and the browser sends it with the user's network position (a server on localhost or
//! a LAN needs no key to be reached). Browsers put an `Origin` header on every such request; other clients (the
//! SDKs, curl, the batch tools) send none, and are not affected.
//!
//! An origin is allowed when `--allowed-origins` names it (or is `*`), or when it is the server's own: its host
//! and port equal the request's `Host`. The server does not know its public name (a proxy or a port mapping
//! may stand in front), but the browser sets `Host` from the very URL the page targets, so a page served from the
//! same host and port as the API (a UI behind the same proxy) passes, and a page elsewhere cannot pretend to.
//! The scheme is not compared: a TLS proxy in front makes the page's `https` an `http` here. (A page that turns a
//! DNS name of its own to the server's address, DNS rebinding, is same-origin by this rule: a host allow-list
//! would be needed against that.)

use super::AppState;
use super::drain::refuse;
use crate::doors::Door;
use crate::error::ApiError;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::Response;
use std::sync::Arc;

pub async fn refuse_foreign_writes(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(origin) = foreign_write(req.method(), req.headers(), &st.config.cors.allowed_origins) else {
        return next.run(req).await;
    };
    let err = ApiError::CrossOrigin(origin);
    st.dispatcher.metrics.rejected.with_label_values(&[err.code()]).inc();
    let door = Door::for_path(req.uri().path());
    refuse(req.into_body(), err, door).await
}

/// The `Origin` of a request that writes (any method but GET, HEAD and OPTIONS) from an origin not allowed.
fn foreign_write(method: &Method, headers: &HeaderMap, allowed: &[String]) -> Option<String> {
    if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
        return None;
    }
    let origin = headers.get(header::ORIGIN)?;
    let text = origin.to_str().unwrap_or_default();
    if allowed.iter().any(|a| a == "*" || a.eq_ignore_ascii_case(text)) || own_origin(text, headers) {
        return None;
    }
    Some(String::from_utf8_lossy(origin.as_bytes()).into_owned())
}

/// Whether `origin` (`scheme://host[:port]`) names the host and port the request was sent to.
fn own_origin(origin: &str, headers: &HeaderMap) -> bool {
    let Some((_, authority)) = origin.split_once("://") else { return false }; // "null", or not an origin
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    host.is_some_and(|h| h.eq_ignore_ascii_case(authority))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(origin: Option<&str>, host: &str, allowed: &[&str]) -> Option<String> {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, host.parse().unwrap());
        if let Some(o) = origin {
            headers.insert(header::ORIGIN, o.parse().unwrap());
        }
        let allowed: Vec<String> = allowed.iter().map(|s| s.to_string()).collect();
        foreign_write(&Method::POST, &headers, &allowed)
    }

    #[test]
    fn own_and_named_origins_pass_others_do_not() {
        assert_eq!(write(None, "localhost:8000", &[]), None, "no Origin: not a browser");
        assert_eq!(write(Some("http://localhost:8000"), "localhost:8000", &[]), None);
        assert_eq!(write(Some("https://LOCALHOST:8000"), "localhost:8000", &[]), None, "scheme and case aside");
        assert_eq!(write(Some("https://app.example"), "localhost:8000", &["https://app.example"]), None);
        assert_eq!(write(Some("https://any.example"), "localhost:8000", &["*"]), None);
        for (origin, allowed) in [
            ("https://evil.example", &[][..]),
            ("http://localhost:8001", &[]),
            ("http://localhost", &[]),
            ("null", &[]),
            ("https://evil.example", &["https://app.example"]),
        ] {
            assert_eq!(write(Some(origin), "localhost:8000", allowed).as_deref(), Some(origin), "{origin}");
        }
    }

    #[test]
    fn reads_are_not_refused() {
        let mut headers = HeaderMap::new();
        headers.insert(header::ORIGIN, "https://evil.example".parse().unwrap());
        headers.insert(header::HOST, "localhost:8000".parse().unwrap());
        for m in [Method::GET, Method::HEAD, Method::OPTIONS] {
            assert_eq!(foreign_write(&m, &headers, &[]), None, "{m}");
        }
        assert!(foreign_write(&Method::DELETE, &headers, &[]).is_some());
    }
}

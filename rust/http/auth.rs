//! `--api-key`: the routes `http::app` puts behind it need `Authorization: Bearer <key>`, or Anthropic's
//! `x-api-key: <key>`; /health, /metrics, /openapi.json, /version and /get_load stay open. Several keys may be
//! given (one a line in `--api-key-file`); each is an owner of its own (`crate::owner`), put into the request's
//! extensions for the handlers that keep or queue work under it.

use super::AppState;
use super::drain::refuse;
use crate::doors::Door;
use crate::error::ApiError;
use crate::owner::Owner;
use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;
use std::sync::Arc;

pub async fn require_api_key(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(keys) = st.config.api_key.as_deref() else { return next.run(req).await };
    let headers = req.headers();
    let bearer = headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(bearer_token);
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    if let Some(key) = matching_key(keys, [bearer, x_api_key]) {
        let mut req = req;
        req.extensions_mut().insert(Owner::for_key(key));
        return next.run(req).await;
    }
    st.dispatcher.metrics.rejected.with_label_values(&["invalid_api_key"]).inc();
    let door = Door::for_path(req.uri().path());
    refuse(req.into_body(), ApiError::Unauthorized, door).await
}

/// The configured key (one of `keys`, one a line) that one of the given credentials matches. Every key is
/// compared whole, so the time taken does not depend on which key matched or where a guess differs.
pub fn matching_key<'k, const N: usize>(keys: &'k str, given: [Option<&str>; N]) -> Option<&'k str> {
    let mut found = None;
    for key in keys.lines().map(str::trim).filter(|k| !k.is_empty()) {
        for g in given.iter().flatten() {
            if constant_time_eq(g.as_bytes(), key.as_bytes()) && found.is_none() {
                found = Some(key);
            }
        }
    }
    found
}

/// The token of `Bearer <token>`, the scheme matched case-insensitively as RFC 9110 says (`bearer KEY` too).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim_start())
}

/// Equality whose time depends only on the lengths, not on where the bytes differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
    for (i, x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::{bearer_token, constant_time_eq, matching_key};

    #[test]
    fn any_of_several_keys_matches() {
        let keys = "alpha\n\n  beta  \n";
        assert_eq!(matching_key(keys, [Some("beta"), None]), Some("beta"));
        assert_eq!(matching_key(keys, [None, Some("alpha")]), Some("alpha"));
        assert_eq!(matching_key(keys, [Some("gamma"), Some("")]), None);
        assert_eq!(matching_key(keys, [None, None]), None);
    }

    #[test]
    fn the_scheme_is_matched_without_case() {
        for ok in ["Bearer k", "bearer k", "BEARER k", "Bearer  k"] {
            assert_eq!(bearer_token(ok), Some("k"), "{ok}");
        }
        for bad in ["k", "Basic k", "Bearerk"] {
            assert_eq!(bearer_token(bad), None, "{bad}");
        }
    }

    #[test]
    fn compares_whole_keys() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }
}

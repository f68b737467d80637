//! CORS for browser clients, off unless the operator names origins (`--allowed-origins`): then preflights are
//! answered and only those origins get CORS headers (tower-http's layer). Without it browsers can send only
//! "simple" requests cross-origin: the JSON routes refuse their bodies (`body::RawBody`: a 415 for a body that is
//! not JSON), and `cross_site` refuses their writes by `Origin` (a form upload, a POST without a body).

use crate::config::ServerConfig;
use axum::http::{HeaderName, HeaderValue, Method};
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

/// The layer for `config`, or None when CORS is off. The lists were checked at start-up (cli.py).
pub fn layer(config: &ServerConfig) -> Option<CorsLayer> {
    if config.cors.allowed_origins.is_empty() {
        return None;
    }
    let origins = if config.cors.allowed_origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(config.cors.allowed_origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
    };
    let headers = if config.cors.allowed_headers.iter().any(|h| h == "*") {
        AllowHeaders::any()
    } else {
        AllowHeaders::list(config.cors.allowed_headers.iter().filter_map(|h| HeaderName::from_bytes(h.as_bytes()).ok()))
    };
    let methods: Vec<Method> = config.cors.allowed_methods.iter().filter_map(|m| m.parse().ok()).collect();
    Some(
        CorsLayer::new()
            .allow_origin(origins)
            .allow_methods(methods)
            .allow_headers(headers)
            .allow_credentials(config.cors.allow_credentials)
            .expose_headers([HeaderName::from_static("x-request-id")])
            .max_age(std::time::Duration::from_secs(600)),
    )
}

//! HTTP routes. `app(state)` builds the router; binding and serving live in `server.rs`.

mod auth;
mod chat;
mod info;
pub mod request;
pub mod request_id;

use crate::admission::Admission;
use crate::codec::Codec;
use crate::config::ServerConfig;
use crate::dispatch::Dispatcher;
use crate::error::ApiError;
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::Uri;
use axum::middleware;
use axum::routing::{get, post};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Shared by every handler.
pub struct AppState {
    pub config: ServerConfig,
    pub admission: Admission,
    pub codec: Arc<Codec>,
    pub dispatcher: Arc<Dispatcher>,
    /// Set on SIGTERM: stop admitting, report 503 on /health, let in-flight requests finish.
    pub draining: AtomicBool,
    pub started_unix: u64,
}

impl AppState {
    /// Why the service cannot take requests right now, if it cannot.
    pub fn unavailable(&self) -> Option<ApiError> {
        if self.draining.load(Ordering::Acquire) {
            return Some(ApiError::Unavailable("The server is shutting down.".into()));
        }
        if let Some(r) = self.dispatcher.ranks.iter().find(|r| !r.is_alive()) {
            return Some(ApiError::Unavailable(format!("Engine rank {} is not running.", r.index)));
        }
        if self.dispatcher.ranks.is_empty() {
            return Some(ApiError::Unavailable("No engine rank is running.".into()));
        }
        None
    }
}

pub fn app(state: Arc<AppState>) -> Router {
    let limit = state.config.max_body_bytes;
    let inference = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(info::models))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth::require_api_key));
    Router::new()
        .merge(inference)
        .route("/health", get(info::health))
        .route("/metrics", get(info::metrics))
        .route("/openapi.json", get(info::openapi))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(middleware::from_fn(request_id::request_id))
        .with_state(state)
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::RouteNotFound(uri.path().to_string())
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

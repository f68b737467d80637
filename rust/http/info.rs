//! `/health` and `/v1/models`: answered from Rust state alone, never waiting on Python or a rank.

use super::AppState;
use crate::error::ApiError;
use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

pub async fn health(State(st): State<Arc<AppState>>) -> Response {
    match st.unavailable() {
        None => Json(json!({"status": "ok"})).into_response(),
        Some(err) => err.into_response(),
    }
}

pub async fn models(State(st): State<Arc<AppState>>) -> Response {
    let data: Vec<_> = st.config.served_model_names.iter().map(|name| model_card(&st, name)).collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `GET /v1/models/{model}` (the SDK's `models.retrieve`): one served name's card, or 404.
pub async fn model(State(st): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    match st.config.served_model_names.iter().find(|n| **n == name) {
        Some(name) => Json(model_card(&st, name)).into_response(),
        None => ApiError::ModelNotFound(name).into_response(),
    }
}

fn model_card(st: &AppState, name: &str) -> Value {
    json!({
        "id": name, "object": "model", "created": st.started_unix, "owned_by": "deepinfer-server",
        "root": name, "parent": null, "max_model_len": st.config.max_model_len,
    })
}

pub async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let healthy = st.unavailable().is_none();
    let queued = st.admission.queued();
    let ranks: Vec<_> = st.dispatcher.ranks.iter().map(|r| r.view()).collect();
    let body = st.dispatcher.metrics.render(&ranks, st.config.max_num_seqs as usize, queued, healthy);
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], body).into_response()
}

pub async fn openapi(State(st): State<Arc<AppState>>) -> Response {
    match &st.config.openapi {
        Some(doc) => ([(axum::http::header::CONTENT_TYPE, "application/json")], doc.clone()).into_response(),
        None => crate::error::ApiError::RouteNotFound("/openapi.json".into()).into_response(),
    }
}

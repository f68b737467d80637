//! The control routes RL rollout frameworks drive, in SGLang's and vLLM's shapes, all behind `--api-key`:
//! `POST /abort_request {rid} | {abort_all: true}` (SGLang), `POST /pause_generation {mode}` and
//! `POST /continue_generation` (SGLang), `POST /pause?mode=&wait_for_inflight_requests=`, `POST /resume` and
//! `GET /is_paused` (vLLM), `GET /get_weight_version`, `POST /update_weight_version` and
//! `POST /update_weights_from_disk` (SGLang). They parse and answer; what they do to the request path is
//! `path::control`'s and `path::reload`'s.

use super::AppState;
use super::body::RawBody;
use crate::error::ApiError;
use crate::limits::{MAX_CONTROL_ID_BYTES, MAX_MODEL_PATH_BYTES};
use crate::path::control::{self, PauseMode};
use crate::path::reload;
use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::json;
use std::sync::Arc;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AbortBody {
    #[serde(default)]
    rid: Option<String>,
    #[serde(default)]
    abort_all: bool,
}

pub async fn abort_request(State(st): State<Arc<AppState>>, body: RawBody) -> Result<Response, ApiError> {
    let b: AbortBody = parse(body)?;
    let rid = match (b.abort_all, b.rid) {
        (true, _) => None,
        (false, Some(rid)) if !rid.is_empty() && rid.len() <= MAX_CONTROL_ID_BYTES => Some(rid),
        (false, Some(_)) => {
            return Err(ApiError::bad_param("rid", format!("'rid' must be 1 to {MAX_CONTROL_ID_BYTES} bytes")));
        }
        (false, None) => return Err(ApiError::bad_param("rid", "Send 'rid', or 'abort_all': true.")),
    };
    let n = control::abort(&st, rid.as_deref());
    let message = match (&rid, n) {
        (None, n) => format!("Aborted {n} requests."),
        (Some(rid), 0) => format!("No request with rid '{rid}' is running or waiting: nothing to abort."),
        (Some(rid), n) => format!("Aborted {n} request(s) with rid '{rid}'."),
    };
    Ok(Json(json!({"success": true, "aborted": n, "message": message})).into_response())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PauseBody {
    #[serde(default)]
    mode: Option<String>,
}

/// SGLang's `/pause_generation`: `abort` (the default), `in_place`, or `retract` (here the same as `in_place`: the
/// ranks keep the requests' KV, so there is nothing to retract).
pub async fn pause_generation(State(st): State<Arc<AppState>>, body: RawBody) -> Result<Response, ApiError> {
    let b: PauseBody = parse(body)?;
    let mode = match b.mode.as_deref().unwrap_or("abort") {
        "abort" => PauseMode::Abort,
        "in_place" | "retract" => PauseMode::InPlace,
        other => {
            return Err(ApiError::bad_param(
                "mode",
                format!("'mode' must be 'abort', 'in_place' or 'retract', not '{other}'"),
            ));
        }
    };
    let n = control::pause(&st, mode).await;
    Ok(Json(json!({"status": "ok", "message": "Generation paused.", "num_paused_requests": n})).into_response())
}

pub async fn continue_generation(State(st): State<Arc<AppState>>) -> Response {
    let message = match control::resume(&st) {
        true => "Generation continued.",
        false => "A weight reload is running: generation continues once every rank has loaded it.",
    };
    Json(json!({"status": "ok", "message": message})).into_response()
}

#[derive(Deserialize)]
pub struct PauseQuery {
    mode: Option<String>,
    wait_for_inflight_requests: Option<bool>,
    /// Accepted and ignored: the ranks' prefix caches stay valid across a pause.
    #[allow(dead_code)]
    clear_cache: Option<bool>,
}

/// vLLM's `/pause`: `mode` `abort` (the default), `wait` (as `wait_for_inflight_requests=true`) or `keep`.
pub async fn pause(State(st): State<Arc<AppState>>, q: Result<Query<PauseQuery>, QueryRejection>) -> Response {
    let q = match q {
        Ok(Query(q)) => q,
        Err(e) => return ApiError::bad_request(format!("Invalid query string: {}", e.body_text())).into_response(),
    };
    let wait = q.wait_for_inflight_requests.unwrap_or(false);
    let mode = match q.mode.as_deref() {
        None if wait => PauseMode::Wait,
        None | Some("abort") => PauseMode::Abort,
        Some("wait") => PauseMode::Wait,
        Some("keep") => PauseMode::InPlace,
        Some(other) => {
            return ApiError::bad_param("mode", format!("'mode' must be 'abort', 'wait' or 'keep', not '{other}'"))
                .into_response();
        }
    };
    control::pause(&st, mode).await;
    Json(json!({"status": "paused"})).into_response()
}

pub async fn resume(State(st): State<Arc<AppState>>) -> Response {
    control::resume(&st);
    Json(json!({"status": "resumed"})).into_response()
}

pub async fn is_paused(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({"is_paused": control::is_paused(&st)})).into_response()
}

pub async fn get_weight_version(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({"weight_version": crate::path::weight_version(&st)})).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WeightVersionBody {
    new_version: String,
    #[serde(default = "yes")]
    abort_all_requests: bool,
}

fn yes() -> bool {
    true
}

/// SGLang's `/update_weight_version`: name the weights now served (after an update made outside this server),
/// aborting the requests in flight first unless `abort_all_requests` is false, so no sample carries a version it
/// was not generated with.
pub async fn update_weight_version(State(st): State<Arc<AppState>>, body: RawBody) -> Result<Response, ApiError> {
    let b: WeightVersionBody = parse(body)?;
    if b.new_version.is_empty() || b.new_version.len() > MAX_CONTROL_ID_BYTES {
        return Err(ApiError::bad_param(
            "new_version",
            format!("'new_version' must be 1 to {MAX_CONTROL_ID_BYTES} bytes"),
        ));
    }
    if b.abort_all_requests {
        control::abort(&st, None);
    }
    st.weights.set_version(b.new_version.clone());
    let message = format!("Weight version updated to {}.", b.new_version);
    Ok(Json(json!({"success": true, "message": message})).into_response())
}

/// SGLang's `UpdateWeightFromDiskReqInput`. Its other fields (`load_format`, `flush_cache`, `is_async`,
/// `torch_empty_cache`, `keep_pause`, `recapture_cuda_graph`, `token_step`) are accepted and ignored: the ranks
/// load the checkpoint as they loaded the first, with empty caches, and resume once every one is ready.
#[derive(Deserialize)]
struct ReloadBody {
    model_path: String,
    #[serde(default)]
    weight_version: Option<String>,
    #[serde(default)]
    abort_all_requests: bool,
}

/// SGLang's `/update_weights_from_disk`: `{success, message, num_paused_requests}`, 200 on success and 400 (the
/// same shape) when the checkpoint is refused or fails to load, as SGLang answers.
pub async fn update_weights_from_disk(State(st): State<Arc<AppState>>, body: RawBody) -> Result<Response, ApiError> {
    let b: ReloadBody = parse(body)?;
    if b.model_path.is_empty() || b.model_path.len() > MAX_MODEL_PATH_BYTES {
        let max = MAX_MODEL_PATH_BYTES;
        return Err(ApiError::bad_param("model_path", format!("'model_path' must be 1 to {max} bytes")));
    }
    if let Some(v) = b.weight_version.as_ref().filter(|v| v.is_empty() || v.len() > MAX_CONTROL_ID_BYTES) {
        let n = v.len();
        return Err(ApiError::bad_param(
            "weight_version",
            format!("'weight_version' must be 1 to {MAX_CONTROL_ID_BYTES} bytes, not {n}"),
        ));
    }
    let dir = std::path::Path::new(&b.model_path);
    let (status, outcome) = match reload::reload(&st, dir, b.weight_version, b.abort_all_requests).await {
        Ok(o) => (if o.success { StatusCode::OK } else { StatusCode::BAD_REQUEST }, o),
        Err(ApiError::BadRequest { message, .. }) => {
            (StatusCode::BAD_REQUEST, reload::Outcome { success: false, message, num_paused_requests: 0 })
        }
        Err(e) => return Err(e),
    };
    let answer = json!({
        "success": outcome.success,
        "message": outcome.message,
        "num_paused_requests": outcome.num_paused_requests,
    });
    Ok((status, Json(answer)).into_response())
}

/// A control body; an empty one is `{}`.
fn parse<T: DeserializeOwned>(RawBody(body): RawBody) -> Result<T, ApiError> {
    let body = body?;
    let body: &[u8] = if body.iter().all(u8::is_ascii_whitespace) { b"{}" } else { &body };
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))
}

//! The Batch API's routes (OpenAI): `POST /v1/batches`, `GET /v1/batches` (newest first), `GET
//! /v1/batches/{id}` and `POST /v1/batches/{id}/cancel`. A batch is a row in the store from the moment it is
//! created; `crate::batches` runs it on whichever replica claims it.

use super::AppState;
use super::body::RawBody;
use super::stored::{answer, bad_query, list_page};
use super::traced::{TraceParent, answered, stored_context};
use crate::doors::Door;
use crate::error::ApiError;
use crate::limits::MAX_BATCHES_PAGE;
use crate::owner::Owner;
use crate::store::conversations::checked_metadata;
use crate::store::files::EXPIRES_AFTER_S;
use crate::store::{Store, StoredBatch, failed, items};
use crate::workers::batches::input::{Refused, scan};
use crate::workers::batches::object::{self, Batch, ENDPOINTS};
use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Instant;

/// Traced, its span is the one the batch's lines link to: kept with the batch (`trace_context`).
pub async fn create(
    State(st): State<Arc<AppState>>,
    owner: Owner,
    parent: TraceParent,
    RawBody(body): RawBody,
) -> Response {
    let traced = parent.begin(&st, Instant::now(), "create_batch", "/v1/batches");
    let created: Result<Response, ApiError> = async {
        let store = store(&st)?;
        let body: Value = serde_json::from_slice(&body?)
            .map_err(|e| ApiError::bad_request(format!("The body is not valid JSON: {e}")))?;
        let text = |key: &str| body.get(key).and_then(Value::as_str);
        let Some(input_file_id) = text("input_file_id") else {
            return Err(ApiError::bad_param("input_file_id", "Missing required parameter: 'input_file_id'."));
        };
        let endpoint = text("endpoint").unwrap_or_default();
        if !ENDPOINTS.contains(&endpoint) {
            return Err(ApiError::bad_param(
                "endpoint",
                format!("'endpoint' must be one of {}.", ENDPOINTS.join(", ")),
            ));
        }
        if text("completion_window") != Some("24h") {
            return Err(ApiError::bad_param("completion_window", "'completion_window' must be '24h'."));
        }
        let metadata = checked_metadata(body.get("metadata"))?.as_object().cloned().unwrap_or_default();
        let output_expires_after = output_expiry(body.get("output_expires_after"))?;
        let file = store.file(input_file_id, &owner).await.map_err(|e| match e {
            ApiError::NotFound { what, id, .. } => ApiError::NotFound { what, id, param: Some("input_file_id") },
            e => e,
        })?;
        if file.purpose != "batch" {
            return Err(ApiError::bad_param("input_file_id", "The input file's purpose must be 'batch'."));
        }
        // Its lines, checked now rather than by the runner: a file kept before --max-batch-line-bytes was lowered,
        // or one of more requests than a batch runs, is this request's 400, not a batch that fails later.
        let (_, content) = store.file_content(input_file_id, &owner).await?;
        let max_line = st.config.limits.max_batch_line_bytes;
        if let Err(e) = scan(content, max_line, object::lines_max(endpoint)).await {
            return Err(match e {
                Refused::Io(_) => ApiError::Store,
                e => ApiError::bad_param("input_file_id", e.to_string()),
            });
        }
        let now = items::now();
        let id = crate::ids::random_id("batch");
        let mut batch = Batch::new(&id, endpoint, input_file_id, metadata, now);
        batch.output_expires_after = output_expires_after;
        let trace_context = stored_context(&traced, "deepinfer.batch.id", &id);
        store.db.put_batch(&StoredBatch::new(&batch, trace_context, owner.as_str())).await.map_err(failed)?;
        store.batch_bell.notify_one();
        Ok(Json(batch.shown()).into_response())
    }
    .await;
    answered(traced, created, |e| Door::Responses.respond(e))
}

/// `output_expires_after` as OpenAI takes it: `{"anchor": "created_at", "seconds": 3600..=2592000}`; the output and
/// error files then expire that long after they are written (else they are kept until deleted).
fn output_expiry(v: Option<&Value>) -> Result<Option<i64>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    let anchor = v.get("anchor").and_then(Value::as_str);
    let seconds = v.get("seconds").and_then(Value::as_i64);
    match (anchor, seconds) {
        (Some("created_at"), Some(s)) if EXPIRES_AFTER_S.contains(&s) => Ok(Some(s)),
        _ => {
            let (min, max) = EXPIRES_AFTER_S.into_inner();
            let msg = format!(
                "'output_expires_after' must be {{\"anchor\": \"created_at\", \"seconds\": N}} with N from {min} to {max}."
            );
            Err(ApiError::bad_param("output_expires_after", msg))
        }
    }
}

pub async fn retrieve(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async { Ok(Json(find(store(&st)?, &id, &owner).await?.shown()).into_response()) }).await
}

#[derive(Deserialize)]
pub struct ListQuery {
    after: Option<String>,
    limit: Option<usize>,
}

pub async fn list(
    State(st): State<Arc<AppState>>,
    owner: Owner,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Response {
    answer(async {
        let Query(q) = q.map_err(bad_query)?;
        let limit = q.limit.unwrap_or(20);
        if !(1..=MAX_BATCHES_PAGE).contains(&limit) {
            return Err(ApiError::bad_param("limit", format!("'limit' must be between 1 and {MAX_BATCHES_PAGE}.")));
        }
        let page = store(&st)?
            .db
            .list_batches("batch_", owner.as_str(), q.after.as_deref(), limit as i64 + 1)
            .await
            .map_err(failed)?;
        let Some(mut page) = page else {
            return Err(ApiError::bad_param("after", "No batch with that id."));
        };
        let has_more = page.len() > limit;
        page.truncate(limit);
        let data = page.iter().map(|b| Ok(json!(b.load()?.shown()))).collect::<Result<Vec<Value>, _>>();
        let data = data.map_err(failed)?;
        Ok(Json(list_page(data, has_more)).into_response())
    })
    .await
}

/// A batch not yet finished goes `cancelling`; its runner (on any replica) stops its lines and writes what they
/// made. One already finished is answered as it is.
pub async fn cancel(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async {
        find(store(&st)?, &id, &owner).await?;
        let cancelled = crate::workers::batches::cancel(store(&st)?, &id).await.map_err(failed)?;
        let batch = cancelled.ok_or_else(|| ApiError::NotFound { what: "Batch", id: id.clone(), param: None })?;
        Ok(Json(batch.shown()).into_response())
    })
    .await
}

/// `owner`'s batch: another owner's is not found.
async fn find(store: &Store, id: &str, owner: &Owner) -> Result<Batch, ApiError> {
    let row = store.db.get_batch(id).await.map_err(failed)?.filter(|b| b.owned_by == owner.as_str());
    let row = row.ok_or_else(|| ApiError::NotFound { what: "Batch", id: id.to_string(), param: None })?;
    row.load().map_err(failed)
}

fn store(st: &AppState) -> Result<&Arc<Store>, ApiError> {
    st.store.as_ref().ok_or_else(|| ApiError::bad_request("This server keeps no batches: its state store is off."))
}

//! Anthropic's Message Batches (`/v1/messages/batches`): create, retrieve, list, cancel, delete and `…/results`.
//! They run on the batch lane as OpenAI batches do (`crate::batches`): the requests become a `purpose: batch`
//! file of `/v1/messages` lines, the batch a row; this module speaks Anthropic's objects and envelope over them.

use super::AppState;
use super::body::RawBody;
use super::traced::{TraceParent, answered, stored_context};
use crate::doors::Door;
use crate::error::ApiError;
use crate::limits::{MAX_MESSAGE_BATCH_LINES, MAX_MESSAGE_BATCHES_PAGE};
use crate::owner::Owner;
use crate::store::{Store, StoredBatch, failed, items};
use crate::workers::batches::object::{MESSAGES, new_batch, set_counts};
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Batch ids as Anthropic writes them; the store's row is the same batch.
const PREFIX: &str = "msgbatch_";

/// Traced, its span is the one the batch's lines link to: kept with the batch (`trace_context`).
pub async fn create(
    State(st): State<Arc<AppState>>,
    owner: Owner,
    parent: TraceParent,
    RawBody(body): RawBody,
) -> Response {
    let traced = parent.begin(&st, Instant::now(), "create_batch", "/v1/messages/batches");
    let created: Result<Response, ApiError> = async {
        let store = store(&st)?;
        let body: Value = serde_json::from_slice(&body?)
            .map_err(|e| ApiError::bad_request(format!("The body is not valid JSON: {e}")))?;
        let Some(requests) = body.get("requests").and_then(Value::as_array).filter(|r| !r.is_empty()) else {
            return Err(ApiError::bad_param("requests", "'requests' must be a non-empty array."));
        };
        if requests.len() > MAX_MESSAGE_BATCH_LINES {
            return Err(ApiError::bad_param(
                "requests",
                format!("At most {MAX_MESSAGE_BATCH_LINES} requests a batch."),
            ));
        }
        let mut lines = String::new();
        let mut seen = std::collections::HashSet::new();
        for (i, r) in requests.iter().enumerate() {
            let custom_id = r.get("custom_id").and_then(Value::as_str).filter(|c| is_custom_id(c));
            let Some(custom_id) = custom_id else {
                return Err(ApiError::bad_param(
                    &format!("requests[{i}].custom_id"),
                    "A custom_id of 1 to 64 letters, digits, '_' or '-' is required (^[a-zA-Z0-9_-]{1,64}$).",
                ));
            };
            if !seen.insert(custom_id) {
                return Err(ApiError::bad_param(
                    &format!("requests[{i}].custom_id"),
                    format!("custom_id '{custom_id}' is used twice."),
                ));
            }
            let Some(params @ Value::Object(_)) = r.get("params") else {
                return Err(ApiError::bad_param(&format!("requests[{i}].params"), "'params' must be an object."));
            };
            let line = json!({"custom_id": custom_id, "method": "POST", "url": MESSAGES, "body": params}).to_string();
            if line.len() > st.config.limits.max_batch_line_bytes {
                return Err(ApiError::bad_param(
                    &format!("requests[{i}].params"),
                    format!("A request of a batch may be at most {} bytes.", st.config.limits.max_batch_line_bytes),
                ));
            }
            lines.push_str(&line);
            lines.push('\n');
        }
        let chunks = stream::iter([Ok::<_, std::convert::Infallible>(Bytes::from(lines))]);
        let up = store.receive(chunks, &owner).await?;
        let file = store.keep_file(up, "message_batch.jsonl", "batch", None).await?;
        let now = items::now();
        let id = crate::ids::random_id(PREFIX.trim_end_matches('_'));
        let input = file["id"].as_str().unwrap_or_default();
        let mut batch = new_batch(&id, MESSAGES, input, json!({}), now);
        set_counts(&mut batch, requests.len() as i64, 0, 0); // known now: a batch cancelled at once counts them

        let trace_context = stored_context(&traced, "deepinfer.batch.id", &id);
        let (status, batch_text, owned_by) = ("validating".into(), batch.to_string(), owner.as_str().to_string());
        let row = StoredBatch { id, created_at: now, status, batch: batch_text, trace_context, owned_by };
        store.db.put_batch(&row).await.map_err(failed)?;
        store.batch_bell.notify_one();
        Ok(Json(message_batch(&row.status, &batch)).into_response())
    }
    .await;
    answered(traced, created, |e| Door::Messages.respond(e))
}

pub async fn retrieve(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async {
        let (status, batch) = find(store(&st)?, &id, &owner).await?;
        Ok(Json(message_batch(&status, &batch)).into_response())
    })
    .await
}

#[derive(Deserialize)]
pub struct ListQuery {
    limit: Option<usize>,
    after_id: Option<String>,
}

/// Newest first, `after_id` pages on (Anthropic's cursor); only message batches.
pub async fn list(
    State(st): State<Arc<AppState>>,
    owner: Owner,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Response {
    answer(async {
        let Query(q) = q.map_err(|e| ApiError::bad_request(format!("Invalid query string: {}", e.body_text())))?;
        let limit = q.limit.unwrap_or(20);
        if !(1..=MAX_MESSAGE_BATCHES_PAGE).contains(&limit) {
            return Err(ApiError::bad_param(
                "limit",
                format!("'limit' must be between 1 and {MAX_MESSAGE_BATCHES_PAGE}."),
            ));
        }
        let after = q.after_id.as_deref();
        let page =
            store(&st)?.db.list_batches(PREFIX, owner.as_str(), after, limit as i64 + 1).await.map_err(failed)?;
        let mut page = page.ok_or_else(|| ApiError::bad_param("after_id", "No message batch with that id."))?;
        let has_more = page.len() > limit;
        page.truncate(limit);
        let data: Vec<Value> = page
            .iter()
            .map(|b| message_batch(&b.status, &serde_json::from_str(&b.batch).unwrap_or_default()))
            .collect();
        let id_of = |i: Option<&Value>| i.and_then(|b| b.get("id")).cloned().unwrap_or(Value::Null);
        let (first_id, last_id) = (id_of(data.first()), id_of(data.last()));
        Ok(Json(json!({"data": data, "has_more": has_more, "first_id": first_id, "last_id": last_id})).into_response())
    })
    .await
}

pub async fn cancel(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async {
        let store = store(&st)?;
        find(store, &id, &owner).await?; // a message batch's id
        let cancelled = crate::workers::batches::cancel(store, &id).await.map_err(failed)?;
        let (status, batch) = cancelled.ok_or(ApiError::Internal)?;
        Ok(Json(message_batch(&status, &batch)).into_response())
    })
    .await
}

/// Only an ended batch may be deleted (Anthropic's rule); its files go with it.
pub async fn delete(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async {
        let store = store(&st)?;
        let (status, batch) = find(store, &id, &owner).await?;
        if !ended(&status) {
            return Err(ApiError::bad_request(
                "A message batch that has not ended cannot be deleted; cancel it first.",
            ));
        }
        for key in ["input_file_id", "output_file_id", "error_file_id"] {
            if let Some(file) = batch.get(key).and_then(Value::as_str) {
                let _ = store.delete_file(file, &owner).await;
            }
        }
        store.db.delete_batch(&id).await.map_err(failed)?;
        Ok(Json(json!({"id": id, "type": "message_batch_deleted"})).into_response())
    })
    .await
}

/// JSONL, one line per request: `succeeded` with its Message, `errored` with its error, or `canceled` /
/// `expired` for a request that never ran.
pub async fn results(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async {
        let store = store(&st)?;
        let (status, batch) = find(store, &id, &owner).await?;
        if !ended(&status) {
            return Err(ApiError::bad_request("The message batch has not ended: its results are not ready."));
        }
        let mut by_id: HashMap<String, Value> = HashMap::new();
        for key in ["output_file_id", "error_file_id"] {
            let Some(file) = batch.get(key).and_then(Value::as_str) else { continue };
            for line in read_file(store, file, &owner).await?.lines() {
                let Ok(r) = serde_json::from_str::<Value>(line) else { continue };
                let custom_id = r["custom_id"].as_str().unwrap_or_default().to_string();
                let body = r["response"]["body"].clone();
                let result = if r["response"]["status_code"] == 200 {
                    json!({"type": "succeeded", "message": body})
                } else {
                    json!({"type": "errored", "error": body})
                };
                by_id.insert(custom_id, result);
            }
        }
        let never = if status == "expired" { "expired" } else { "canceled" };
        let mut out = String::new();
        let input = batch["input_file_id"].as_str().unwrap_or_default();
        for line in read_file(store, input, &owner).await?.lines() {
            let Ok(r) = serde_json::from_str::<Value>(line) else { continue };
            let custom_id = r["custom_id"].as_str().unwrap_or_default().to_string();
            let result = by_id.remove(&custom_id).unwrap_or_else(|| json!({"type": never}));
            out.push_str(&json!({"custom_id": custom_id, "result": result}).to_string());
            out.push('\n');
        }
        Ok(([(header::CONTENT_TYPE, "application/binary")], out).into_response())
    })
    .await
}

/// The MessageBatch object from the batch row.
fn message_batch(status: &str, b: &Value) -> Value {
    let counts = &b["request_counts"];
    let (total, ok, failed) = (
        counts["total"].as_i64().unwrap_or(0),
        counts["completed"].as_i64().unwrap_or(0),
        counts["failed"].as_i64().unwrap_or(0),
    );
    let left = (total - ok - failed).max(0);
    let processing_status = match status {
        "cancelling" => "canceling",
        s if ended(s) => "ended",
        _ => "in_progress",
    };
    let at = |key: &str| b.get(key).and_then(Value::as_i64).map(rfc3339);
    let ended_at =
        at("completed_at").or_else(|| at("cancelled_at")).or_else(|| at("expired_at")).or_else(|| at("failed_at"));
    let id = b["id"].as_str().unwrap_or_default();
    json!({
        "id": id, "type": "message_batch", "processing_status": processing_status,
        "request_counts": {
            "processing": if ended(status) { 0 } else { left },
            "succeeded": ok, "errored": failed + if status == "failed" { left } else { 0 },
            "canceled": if status == "cancelled" { left } else { 0 },
            "expired": if status == "expired" { left } else { 0 },
        },
        "ended_at": ended_at, "created_at": at("created_at"), "expires_at": at("expires_at"),
        "cancel_initiated_at": at("cancelling_at"), "archived_at": null,
        "results_url": ended(status).then(|| format!("/v1/messages/batches/{id}/results")),
    })
}

fn ended(status: &str) -> bool {
    matches!(status, "completed" | "failed" | "cancelled" | "expired")
}

/// Unix seconds as RFC 3339 UTC, as Anthropic writes times.
fn rfc3339(secs: i64) -> String {
    super::worker::rfc3339(secs.max(0) as u64, 0)
}

async fn read_file(store: &Store, id: &str, owner: &Owner) -> Result<String, ApiError> {
    let (_, mut file) = store.file_content(id, owner).await?;
    let mut text = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut file, &mut text).await.map_err(|_| ApiError::Store)?;
    Ok(text)
}

/// `owner`'s message batch: another owner's is not found.
async fn find(store: &Store, id: &str, owner: &Owner) -> Result<(String, Value), ApiError> {
    let row = store.db.get_batch(id).await.map_err(failed)?;
    let row = row.filter(|b| b.id.starts_with(PREFIX) && b.owned_by == owner.as_str());
    let row = row.ok_or_else(|| ApiError::NotFound { what: "Message batch", id: id.to_string(), param: None })?;
    Ok((row.status, serde_json::from_str(&row.batch).unwrap_or_default()))
}

fn store(st: &AppState) -> Result<&Arc<Store>, ApiError> {
    st.store.as_ref().ok_or_else(|| ApiError::bad_request("This server keeps no batches: its state store is off."))
}

/// Errors in Anthropic's envelope.
async fn answer(f: impl Future<Output = Result<Response, ApiError>>) -> Response {
    f.await.unwrap_or_else(|e| Door::Messages.respond(e))
}

/// Anthropic's pattern for a request's `custom_id`: `^[a-zA-Z0-9_-]{1,64}$`.
fn is_custom_id(c: &str) -> bool {
    (1..=64).contains(&c.len()) && c.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

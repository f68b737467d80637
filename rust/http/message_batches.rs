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
use crate::workers::batches::object::{Batch, BatchStatus, MESSAGES};
use crate::workers::batches::result::{MessageOutcome, MessageResult, ResultLine};
use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde::{Deserialize, Serialize};
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
        let mut batch = Batch::new(&id, MESSAGES, input, Default::default(), now);
        batch.set_counts(requests.len() as i64, 0, 0); // known now: a batch cancelled at once counts them

        let trace_context = stored_context(&traced, "deepinfer.batch.id", &id);
        store.db.put_batch(&StoredBatch::new(&batch, trace_context, owner.as_str())).await.map_err(failed)?;
        store.batch_bell.notify_one();
        Ok(Json(MessageBatch::of(&batch)).into_response())
    }
    .await;
    answered(traced, created, |e| Door::Messages.respond(e))
}

pub async fn retrieve(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async { Ok(Json(MessageBatch::of(&find(store(&st)?, &id, &owner).await?)).into_response()) }).await
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
        let data = page.iter().map(|b| Ok(MessageBatch::of(&b.load()?))).collect::<Result<Vec<_>, _>>();
        let data = data.map_err(failed)?;
        let (first_id, last_id) = (data.first().map(|b| &b.id), data.last().map(|b| &b.id));
        Ok(Json(json!({"data": data, "has_more": has_more, "first_id": first_id, "last_id": last_id})).into_response())
    })
    .await
}

pub async fn cancel(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async {
        let store = store(&st)?;
        find(store, &id, &owner).await?; // a message batch's id
        let cancelled = crate::workers::batches::cancel(store, &id).await.map_err(failed)?;
        let batch = cancelled.ok_or(ApiError::Internal)?;
        Ok(Json(MessageBatch::of(&batch)).into_response())
    })
    .await
}

/// Only an ended batch may be deleted (Anthropic's rule); its files go with it.
pub async fn delete(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async {
        let store = store(&st)?;
        let batch = find(store, &id, &owner).await?;
        if !batch.status.ended() {
            return Err(ApiError::bad_request(
                "A message batch that has not ended cannot be deleted; cancel it first.",
            ));
        }
        let files = [Some(&batch.input_file_id), batch.output_file_id.as_ref(), batch.error_file_id.as_ref()];
        for file in files.into_iter().flatten() {
            let _ = store.delete_file(file, &owner).await;
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
        let batch = find(store, &id, &owner).await?;
        if !batch.status.ended() {
            return Err(ApiError::bad_request("The message batch has not ended: its results are not ready."));
        }
        let mut by_id: HashMap<String, MessageOutcome> = HashMap::new();
        for file in [&batch.output_file_id, &batch.error_file_id].into_iter().flatten() {
            for line in read_file(store, file, &owner).await?.lines() {
                let Ok(r) = serde_json::from_str::<ResultLine>(line) else { continue };
                by_id.insert(r.custom_id.clone(), MessageOutcome::of(r));
            }
        }
        let never = if batch.status == BatchStatus::Expired { "expired" } else { "canceled" };
        let mut out = String::new();
        for line in read_file(store, &batch.input_file_id, &owner).await?.lines() {
            let Ok(r) = serde_json::from_str::<Value>(line) else { continue };
            let custom_id = r["custom_id"].as_str().unwrap_or_default().to_string();
            let result = by_id.remove(&custom_id).unwrap_or_else(|| MessageOutcome::never(never));
            out.push_str(&serde_json::to_string(&MessageResult { custom_id, result }).map_err(|_| ApiError::Internal)?);
            out.push('\n');
        }
        Ok(([(header::CONTENT_TYPE, "application/binary")], out).into_response())
    })
    .await
}

/// Anthropic's MessageBatch object, as the same batch reads in its terms. Its members are declared in name order,
/// as serde_json's maps wrote them before this type, so clients read the same bytes; an unset time is `null`.
#[derive(Serialize)]
struct MessageBatch {
    /// Never: a batch here is not archived.
    archived_at: Option<String>,
    cancel_initiated_at: Option<String>,
    created_at: String,
    ended_at: Option<String>,
    expires_at: String,
    id: String,
    processing_status: ProcessingStatus,
    request_counts: MessageCounts,
    results_url: Option<String>,
    #[serde(rename = "type")]
    kind: &'static str,
}

#[derive(Serialize, PartialEq, Debug)]
#[serde(rename_all = "snake_case")]
enum ProcessingStatus {
    InProgress,
    Canceling,
    Ended,
}

/// Its requests by how they stand: each counted once.
#[derive(Serialize)]
struct MessageCounts {
    canceled: i64,
    errored: i64,
    expired: i64,
    processing: i64,
    succeeded: i64,
}

impl MessageBatch {
    /// From the batch: its lines not run yet count as processing while it runs, and at its end as it ended
    /// (errored for a failed batch, canceled, or expired).
    fn of(b: &Batch) -> MessageBatch {
        let counts = b.request_counts;
        let left = (counts.total - counts.completed - counts.failed).max(0);
        let status = b.status;
        let processing_status = match status {
            BatchStatus::Cancelling => ProcessingStatus::Canceling,
            s if s.ended() => ProcessingStatus::Ended,
            _ => ProcessingStatus::InProgress,
        };
        let left_if = |s: BatchStatus| if status == s { left } else { 0 };
        let ended = [BatchStatus::Completed, BatchStatus::Cancelled, BatchStatus::Expired, BatchStatus::Failed];
        MessageBatch {
            archived_at: None,
            cancel_initiated_at: b.cancelling_at.map(rfc3339),
            created_at: rfc3339(b.created_at),
            ended_at: ended.into_iter().find_map(|s| b.reached(s)).map(rfc3339),
            expires_at: rfc3339(b.expires_at),
            id: b.id.clone(),
            processing_status,
            request_counts: MessageCounts {
                processing: if status.ended() { 0 } else { left },
                succeeded: counts.completed,
                errored: counts.failed + left_if(BatchStatus::Failed),
                canceled: left_if(BatchStatus::Cancelled),
                expired: left_if(BatchStatus::Expired),
            },
            results_url: status.ended().then(|| format!("/v1/messages/batches/{}/results", b.id)),
            kind: "message_batch",
        }
    }
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
async fn find(store: &Store, id: &str, owner: &Owner) -> Result<Batch, ApiError> {
    let row = store.db.get_batch(id).await.map_err(failed)?;
    let row = row.filter(|b| b.id.starts_with(PREFIX) && b.owned_by == owner.as_str());
    let row = row.ok_or_else(|| ApiError::NotFound { what: "Message batch", id: id.to_string(), param: None })?;
    row.load().map_err(failed)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The view as it was built from the row's `Value` before `Batch` (the same keys, the same counts).
    fn was(status: &str, b: &Value) -> Value {
        let n = |k: &str| b["request_counts"][k].as_i64().unwrap_or(0);
        let (total, ok, failed) = (n("total"), n("completed"), n("failed"));
        let left = (total - ok - failed).max(0);
        let ended = matches!(status, "completed" | "failed" | "cancelled" | "expired");
        let at = |key: &str| b.get(key).and_then(Value::as_i64).map(rfc3339);
        let id = b["id"].as_str().unwrap_or_default();
        json!({
            "id": id, "type": "message_batch",
            "processing_status": if status == "cancelling" { "canceling" } else if ended { "ended" } else { "in_progress" },
            "request_counts": {
                "processing": if ended { 0 } else { left }, "succeeded": ok,
                "errored": failed + if status == "failed" { left } else { 0 },
                "canceled": if status == "cancelled" { left } else { 0 },
                "expired": if status == "expired" { left } else { 0 },
            },
            "ended_at": at("completed_at").or_else(|| at("cancelled_at")).or_else(|| at("expired_at")).or_else(|| at("failed_at")),
            "created_at": at("created_at"), "expires_at": at("expires_at"),
            "cancel_initiated_at": at("cancelling_at"), "archived_at": null,
            "results_url": ended.then(|| format!("/v1/messages/batches/{id}/results")),
        })
    }

    #[test]
    fn a_message_batch_reads_as_before_at_every_status() {
        for (status, stamped) in BatchStatus::ALL.into_iter().flat_map(|s| [(s, false), (s, true)]) {
            let mut b = Batch::new("msgbatch_1", MESSAGES, "file-1", Default::default(), 1_700_000_000);
            b.set_counts(5, 2, 1);
            b.status = status;
            if stamped {
                // Several ends stamped: the first of completed, cancelled, expired, failed is the one shown.
                (b.cancelling_at, b.cancelled_at, b.failed_at) = (Some(1_700_000_100), Some(1_700_000_101), Some(9));
            }
            let old = was(status.as_str(), &serde_json::from_str(&b.to_text()).unwrap());
            assert_eq!(serde_json::to_string(&MessageBatch::of(&b)).unwrap(), old.to_string(), "{status}");
        }
    }
}

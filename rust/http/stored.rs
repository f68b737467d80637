//! The stored responses' routes (OpenAI Responses API): `GET` and `DELETE /v1/responses/{id}`,
//! `GET /v1/responses/{id}/input_items` (paginated) and `POST /v1/responses/{id}/cancel`. Answered from the state
//! store (`crate::store`): no codec, no rank, no admission slot.

use super::AppState;
use crate::doors::Door;
use crate::error::ApiError;
use crate::limits::MAX_INPUT_ITEMS_PAGE;
use crate::owner::Owner;
use crate::store::StoredResponse;
use crate::workers::background::{self, Background};
use axum::Json;
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;

pub async fn get_response(
    State(st): State<Arc<AppState>>,
    State(bg): State<Option<Arc<Background>>>,
    Path(id): Path<String>,
    owner: Owner,
    q: Result<Query<GetQuery>, QueryRejection>,
) -> Response {
    answer(async {
        let Query(q) = q.map_err(bad_query)?;
        // Its owner's only, running or not (a background response is stored from the moment it is queued).
        let r = find(&st, &id, &owner).await?;
        let run = bg.as_ref().and_then(|bg| bg.runs.get(&id));
        if q.stream == Some(true) {
            // A background response's stream, from after `starting_after`, while this replica keeps it.
            let Some(run) = run else {
                let msg = "Only a background response's stream can be read again, on the replica that runs it, for \
                    up to 10 minutes after it ends.";
                return Err(ApiError::bad_param("stream", msg));
            };
            // A run keeps the latest part of its stream (`--background-replay-bytes`): no replay with a hole.
            if let Some(first) = run.kept_from()
                && q.starting_after.is_none_or(|after| after.saturating_add(1) < first)
            {
                let msg = format!(
                    "This stream's events before sequence number {first} are no longer kept (a background response \
                     keeps the latest part of its stream): read it with 'starting_after' {} or more, or read the \
                     Response without 'stream'.",
                    first.saturating_sub(1)
                );
                return Err(ApiError::bad_param("starting_after", msg));
            }
            return Ok(super::generate::sse_response(Body::from_stream(run.follow(q.starting_after))));
        }
        // A background response running here: as its stream has it now (`in_progress`).
        if let Some(latest) = run.filter(|r| !r.finished()).and_then(|r| r.latest()) {
            return Ok(([(header::CONTENT_TYPE, "application/json")], latest).into_response());
        }
        Ok(([(header::CONTENT_TYPE, "application/json")], r.response).into_response())
    })
    .await
}

pub async fn delete_response(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async {
        let deleted = match &st.store {
            Some(responses) => responses.delete(&id, &owner).await?,
            None => false,
        };
        if !deleted {
            return Err(not_found(&id));
        }
        Ok(Json(json!({"id": id, "object": "response", "deleted": true})).into_response())
    })
    .await
}

pub async fn cancel_response(
    State(st): State<Arc<AppState>>,
    State(bg): State<Option<Arc<Background>>>,
    Path(id): Path<String>,
    owner: Owner,
) -> Response {
    answer(async {
        let r = find(&st, &id, &owner).await?;
        if let Some(bg) = &bg
            && let Some(answer) = background::cancel(bg, &id).await?
        {
            return Ok(([(axum::http::header::CONTENT_TYPE, "application/json")], answer).into_response());
        }
        if r.response.contains(r#""background":true"#) {
            let msg = "This background response is no longer running: it has ended.";
            return Err(ApiError::bad_param("response_id", msg));
        }
        Err(ApiError::bad_param("response_id", "Only responses created with 'background: true' can be cancelled."))
    })
    .await
}

pub async fn input_items(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    owner: Owner,
    q: Result<Query<PageQuery>, QueryRejection>,
) -> Response {
    answer(async {
        let Query(q) = q.map_err(bad_query)?;
        let (limit, ascending) = page_bounds(&q)?;
        let r = find(&st, &id, &owner).await?;
        let mut items: Vec<Value> = serde_json::from_str(&r.input_items).map_err(|_| ApiError::Internal)?;
        if !ascending {
            items.reverse();
        }
        let start = match &q.after {
            Some(after) => match items.iter().position(|i| i.get("id").and_then(Value::as_str) == Some(after)) {
                Some(at) => at + 1,
                None => return Err(ApiError::bad_param("after", format!("No input item with id '{after}'."))),
            },
            None => 0,
        };
        let page: Vec<Value> = items.iter().skip(start).take(limit).cloned().collect();
        let has_more = start + page.len() < items.len();
        Ok(Json(list_page(page, has_more)).into_response())
    })
    .await
}

#[derive(Deserialize)]
pub struct GetQuery {
    stream: Option<bool>,
    starting_after: Option<u64>,
}

/// A list route's paging: `limit` (1 to 100, 20 by default), `order` (newest first by default), `after` an id.
/// Other parameters (`include`, which asks for fields this server has none of) are ignored.
#[derive(Deserialize)]
pub struct PageQuery {
    limit: Option<usize>,
    order: Option<String>,
    pub after: Option<String>,
}

/// OpenAI's list object: a page of objects with ids, and the ids at its ends ("" for an empty page: the schema
/// wants strings).
pub fn list_page(data: Vec<Value>, has_more: bool) -> Value {
    let id_of = |i: Option<&Value>| i.and_then(|i| i.get("id")).cloned().unwrap_or_else(|| json!(""));
    let (first_id, last_id) = (id_of(data.first()), id_of(data.last()));
    json!({"object": "list", "data": data, "first_id": first_id, "last_id": last_id, "has_more": has_more})
}

/// (limit, ascending) of a page query, checked.
pub fn page_bounds(q: &PageQuery) -> Result<(usize, bool), ApiError> {
    let limit = q.limit.unwrap_or(20);
    if !(1..=MAX_INPUT_ITEMS_PAGE).contains(&limit) {
        return Err(ApiError::bad_param("limit", format!("'limit' must be between 1 and {MAX_INPUT_ITEMS_PAGE}.")));
    }
    let ascending = match q.order.as_deref() {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(_) => return Err(ApiError::bad_param("order", "'order' must be 'asc' or 'desc'.")),
    };
    Ok((limit, ascending))
}

async fn find(st: &AppState, id: &str, owner: &Owner) -> Result<StoredResponse, ApiError> {
    let Some(store) = &st.store else { return Err(not_found(id)) };
    store.load(id, owner).await?.ok_or_else(|| not_found(id))
}

/// A query string that does not parse (`limit=ten`): a 400 in the door's envelope, not axum's plain text.
pub fn bad_query(e: QueryRejection) -> ApiError {
    ApiError::bad_request(format!("Invalid query string: {}", e.body_text()))
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound { what: "Response", id: id.to_string(), param: None }
}

pub async fn answer(f: impl Future<Output = Result<Response, ApiError>>) -> Response {
    f.await.unwrap_or_else(|e| Door::Responses.respond(e))
}

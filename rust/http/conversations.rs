//! The Conversations API's routes (OpenAI): `POST /v1/conversations`, `GET`/`POST`/`DELETE
//! /v1/conversations/{id}`, `GET`/`POST /v1/conversations/{id}/items` and `GET`/`DELETE
//! /v1/conversations/{id}/items/{item_id}`. Answered from the state store (`crate::store`): no codec, no rank, no
//! admission slot. A Responses request joins a conversation with `conversation` (`store::responses`).

use super::AppState;
use super::body::RawBody;
use super::stored::{PageQuery, answer, bad_query, list_page, page_bounds};
use crate::error::ApiError;
use crate::owner::Owner;
use crate::store::Store;
use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

pub async fn create(State(st): State<Arc<AppState>>, owner: Owner, RawBody(body): RawBody) -> Response {
    answer(async {
        let body = json_body(body?, &["items", "metadata", "safety_identifier"])?;
        let items = items_of(&body, false)?;
        Ok(Json(store(&st)?.create_conversation(&owner, &items, body.get("metadata")).await?).into_response())
    })
    .await
}

pub async fn retrieve(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async { Ok(Json(store(&st)?.conversation(&id, &owner).await?).into_response()) }).await
}

pub async fn update(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    owner: Owner,
    RawBody(body): RawBody,
) -> Response {
    answer(async {
        let body = json_body(body?, &["metadata"])?;
        let Some(metadata) = body.get("metadata") else {
            return Err(ApiError::bad_param("metadata", "Missing required parameter: 'metadata'."));
        };
        Ok(Json(store(&st)?.set_metadata(&id, &owner, Some(metadata)).await?).into_response())
    })
    .await
}

pub async fn delete(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async { Ok(Json(store(&st)?.delete_conversation(&id, &owner).await?).into_response()) }).await
}

pub async fn add_items(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    owner: Owner,
    RawBody(body): RawBody,
) -> Response {
    answer(async {
        let body = json_body(body?, &["items"])?;
        let added = store(&st)?.add_items(&id, &owner, &items_of(&body, true)?).await?;
        Ok(Json(list_page(added, false)).into_response())
    })
    .await
}

pub async fn list_items(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    owner: Owner,
    q: Result<Query<PageQuery>, QueryRejection>,
) -> Response {
    answer(async {
        let Query(q) = q.map_err(bad_query)?;
        let (limit, ascending) = page_bounds(&q)?;
        let page = store(&st)?.list_items(&id, &owner, q.after.as_deref(), limit as i64, ascending).await?;
        let items = page.items.iter().map(|i| serde_json::from_str(i).map_err(|_| ApiError::Internal));
        Ok(Json(list_page(items.collect::<Result<_, _>>()?, page.has_more)).into_response())
    })
    .await
}

pub async fn get_item(
    State(st): State<Arc<AppState>>,
    Path((id, item_id)): Path<(String, String)>,
    owner: Owner,
) -> Response {
    answer(async {
        let item = store(&st)?.item(&id, &owner, &item_id).await?;
        Ok(([(header::CONTENT_TYPE, "application/json")], item).into_response())
    })
    .await
}

pub async fn delete_item(
    State(st): State<Arc<AppState>>,
    Path((id, item_id)): Path<(String, String)>,
    owner: Owner,
) -> Response {
    answer(async { Ok(Json(store(&st)?.delete_item(&id, &owner, &item_id).await?).into_response()) }).await
}

fn store(st: &AppState) -> Result<&Arc<Store>, ApiError> {
    st.store
        .as_ref()
        .ok_or_else(|| ApiError::bad_request("This server keeps no conversations: its state store is off."))
}

/// The body as a JSON object with only the fields this route reads (an unknown one is a 400 naming it).
fn json_body(raw: bytes::Bytes, fields: &[&str]) -> Result<Value, ApiError> {
    let body: Value = if raw.is_empty() {
        json!({})
    } else {
        serde_json::from_slice(&raw).map_err(|e| ApiError::bad_request(format!("The body is not valid JSON: {e}")))?
    };
    let Some(obj) = body.as_object() else { return Err(ApiError::bad_request("The body must be a JSON object.")) };
    if let Some(unknown) = obj.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(ApiError::bad_param(unknown, format!("Unknown parameter: '{unknown}'.")));
    }
    Ok(body)
}

fn items_of(body: &Value, required: bool) -> Result<Vec<Value>, ApiError> {
    match body.get("items") {
        None | Some(Value::Null) if !required => Ok(Vec::new()),
        Some(Value::Array(items)) => Ok(items.clone()),
        _ => Err(ApiError::bad_param("items", "'items' must be an array of items.")),
    }
}

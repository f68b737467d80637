//! The Files API's routes (OpenAI): `POST /v1/files` (multipart: `file`, `purpose`, optional
//! `expires_after[anchor]` and `expires_after[seconds]`), `GET /v1/files` (paginated, by `purpose`),
//! `GET`/`DELETE /v1/files/{id}` and `GET /v1/files/{id}/content`. An upload is streamed to disk
//! (`store::files`), never held in memory; it has its own body deadline (`--upload-timeout`, listener.rs), granted
//! by the handler, so only a request the key check let in gets it; what comes before each part's content is
//! bounded (`form`). A `purpose: batch` file's lines are held to `--max-batch-line-bytes` before it is kept.

use super::AppState;
use super::form;
use super::stored::{answer, bad_query, list_page};
use crate::client_io::LongerDeadline;
use crate::error::ApiError;
use crate::limits::{MAX_FILES_PAGE, MAX_FORM_PART_HEAD_BYTES, MAX_FORM_PARTS, MAX_FORM_TEXT_BYTES};
use crate::owner::Owner;
use crate::store::Store;
use crate::store::files::{EXPIRES_AFTER_S, PURPOSES, Upload, file_object};
use crate::workers::batches::input::{Refused, scan};
use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use std::sync::Arc;

/// `longer`: the upload deadline the listener offers this request, granted here, past the key check and routing.
pub async fn upload(
    State(st): State<Arc<AppState>>,
    owner: Owner,
    longer: Option<Extension<LongerDeadline>>,
    req: Request,
) -> Response {
    if let Some(Extension(longer)) = longer {
        longer.grant();
    }
    answer(async {
        let store = store(&st)?;
        let content_type = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default();
        let boundary = multer::parse_boundary(content_type)
            .map_err(|e| ApiError::bad_request(format!("Expected a multipart form: {e}.")))?;
        let (mut form, budget) = form::multipart(req.into_body(), boundary);
        let (mut file, mut filename, mut fields) = (None::<Upload>, String::new(), Vec::new());
        for part in 0..MAX_FORM_PARTS {
            if part > 0 {
                budget.head(MAX_FORM_PART_HEAD_BYTES);
            }
            let Some(field) = form.next_field().await.map_err(bad_form)? else { break };
            budget.content();
            let name = field.name().unwrap_or_default().to_string();
            if name == "file" {
                filename = field.file_name().unwrap_or("upload").to_string();
                file = Some(store.receive(field, &owner).await?);
            } else {
                let text = small_text(field).await?.ok_or_else(|| {
                    ApiError::bad_param(&name, format!("'{name}' is not text of at most {MAX_FORM_TEXT_BYTES} bytes."))
                })?;
                fields.push((name, text));
            }
        }
        let field = |key: &str| fields.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        let Some(mut file) = file else {
            return Err(ApiError::bad_param("file", "Missing required parameter: 'file'."));
        };
        let purpose = field("purpose").unwrap_or_default();
        if !PURPOSES.contains(&purpose) {
            let msg = format!("'purpose' must be one of {}.", PURPOSES.join(", "));
            return Err(ApiError::bad_param("purpose", msg));
        }
        let expires_after = match (field("expires_after[anchor]"), field("expires_after[seconds]")) {
            (None, None) => None,
            (Some("created_at"), Some(s)) => match s.parse::<i64>() {
                Ok(s) if EXPIRES_AFTER_S.contains(&s) => Some(s),
                _ => {
                    let (min, max) = EXPIRES_AFTER_S.into_inner();
                    let msg = format!("'expires_after[seconds]' must be {min} to {max}.");
                    return Err(ApiError::bad_param("expires_after.seconds", msg));
                }
            },
            _ => {
                let msg = "'expires_after' needs 'anchor' (created_at) and 'seconds'.";
                return Err(ApiError::bad_param("expires_after", msg));
            }
        };
        if purpose == "batch" {
            // Each line within --max-batch-line-bytes (it is one request), checked on disk: the upload is dropped,
            // its bytes with it, if one is not.
            let max_line = st.config.limits.max_batch_line_bytes;
            match scan(file.reopen().await?, max_line, usize::MAX).await {
                Ok(_) => {}
                Err(Refused::Io(_)) => return Err(ApiError::Store),
                Err(e) => return Err(ApiError::bad_param("file", e.to_string().replace("input file", "file"))),
            }
        }
        Ok(Json(store.keep_file(file, &filename, purpose, expires_after).await?).into_response())
    })
    .await
}

#[derive(Deserialize)]
pub struct ListQuery {
    after: Option<String>,
    limit: Option<usize>,
    order: Option<String>,
    purpose: Option<String>,
}

pub async fn list(
    State(st): State<Arc<AppState>>,
    owner: Owner,
    q: Result<Query<ListQuery>, QueryRejection>,
) -> Response {
    answer(async {
        let Query(q) = q.map_err(bad_query)?;
        let limit = q.limit.unwrap_or(MAX_FILES_PAGE);
        if !(1..=MAX_FILES_PAGE).contains(&limit) {
            return Err(ApiError::bad_param("limit", format!("'limit' must be between 1 and {MAX_FILES_PAGE}.")));
        }
        let ascending = match q.order.as_deref() {
            None | Some("desc") => false,
            Some("asc") => true,
            Some(_) => return Err(ApiError::bad_param("order", "'order' must be 'asc' or 'desc'.")),
        };
        let (data, has_more) =
            store(&st)?.list_files(&owner, q.after.as_deref(), limit, ascending, q.purpose.as_deref()).await?;
        Ok(Json(list_page(data, has_more)).into_response())
    })
    .await
}

pub async fn retrieve(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async { Ok(Json(file_object(&store(&st)?.file(&id, &owner).await?)).into_response()) }).await
}

pub async fn delete(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async { Ok(Json(store(&st)?.delete_file(&id, &owner).await?).into_response()) }).await
}

/// The content as uploaded, streamed from disk.
pub async fn content(State(st): State<Arc<AppState>>, Path(id): Path<String>, owner: Owner) -> Response {
    answer(async {
        let (f, content) = store(&st)?.file_content(&id, &owner).await?;
        let body = Body::from_stream(tokio_util_stream(content));
        let headers = [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, f.bytes.to_string()),
        ];
        Ok((headers, body).into_response())
    })
    .await
}

/// A file's bytes as a stream of chunks.
fn tokio_util_stream(
    file: tokio::fs::File,
) -> impl futures_util::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Send + 'static {
    use tokio::io::AsyncReadExt;
    futures_util::stream::unfold(file, |mut file| async move {
        let mut buf = bytes::BytesMut::with_capacity(64 << 10);
        match file.read_buf(&mut buf).await {
            Ok(0) => None,
            Ok(_) => Some((Ok(buf.freeze()), file)),
            Err(e) => Some((Err(e), file)),
        }
    })
}

fn store(st: &AppState) -> Result<&Arc<Store>, ApiError> {
    st.store.as_ref().ok_or_else(|| ApiError::bad_request("This server keeps no files: its state store is off."))
}

/// A text part, read a chunk at a time up to `MAX_FORM_TEXT_BYTES` bytes (None past it, or not UTF-8): only the file part
/// may be large, and it goes to disk.
async fn small_text(mut field: multer::Field<'_>) -> Result<Option<String>, ApiError> {
    let mut text = Vec::new();
    while let Some(chunk) = field.chunk().await.map_err(bad_form)? {
        if text.len() + chunk.len() > MAX_FORM_TEXT_BYTES {
            return Ok(None);
        }
        text.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8(text).ok())
}

fn bad_form(e: multer::Error) -> ApiError {
    match e {
        e if form::head_too_long(&e) => {
            ApiError::bad_request(format!("The multipart form could not be read: {}.", form::HeadTooLong))
        }
        e => ApiError::bad_request(format!("The multipart form could not be read: {e}.")),
    }
}

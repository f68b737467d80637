//! Uploaded files (OpenAI's Files API) on top of the database: the metadata is a row, the content a file named by
//! its id in the files directory (`--files-dir`: a volume every replica mounts when they share a store). An
//! upload is streamed to disk under a temporary name, counted against `--max-file-bytes`, against what all files
//! may hold (`--files-max-total-bytes`) and against its owner's share (`--files-max-bytes-per-owner`), and renamed
//! once its row is in; a deleted or expired file is gone from both. A batch's results are files of its owner's,
//! counted the same way (`crate::batches`). A disk that fills as a file is written is a 503 `store_unavailable`, the partial file gone.

use super::{Store, StoredFile, failed, items};
use crate::error::ApiError;
use crate::limits::MAX_FILE_NAME_CHARS;
use crate::owner::Owner;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::io::AsyncWriteExt;

/// What OpenAI's Files API takes as `purpose`.
pub const PURPOSES: &[&str] = &["assistants", "batch", "fine-tune", "vision", "user_data", "evals"];
/// How long after its creation a file may be asked to expire (`expires_after`, a batch's `output_expires_after`):
/// OpenAI's bounds, an hour to 30 days.
pub const EXPIRES_AFTER_S: std::ops::RangeInclusive<i64> = 3600..=2_592_000;

/// Where uploads go, how large one may be, and how much all may hold.
pub struct FileRoom {
    pub dir: PathBuf,
    pub max_bytes: u64,
    /// Most bytes all stored files may hold together; None: no cap.
    pub total_max: Option<u64>,
    /// Most bytes one owner's files may hold; None: no cap.
    pub owner_max: Option<u64>,
    /// Bytes of the uploads arriving here now, not yet in a row: an upload that cannot fit beside them is refused
    /// as it arrives, not once it is whole. (Replicas sharing a store each count their own.)
    arriving: Arc<AtomicU64>,
    /// Held from the last count of what the files hold until an upload's row is in: two uploads that arrived side
    /// by side (each counted what was stored as it began) cannot both be kept past the total.
    keeping: tokio::sync::Mutex<()>,
}

impl FileRoom {
    pub fn new(dir: PathBuf, max_bytes: u64, total_max: Option<u64>, owner_max: Option<u64>) -> Self {
        let keeping = tokio::sync::Mutex::new(());
        FileRoom { dir, max_bytes, total_max, owner_max, arriving: Arc::default(), keeping }
    }
}

/// An upload's content as it arrives, written under a temporary name; removed if dropped before it is kept.
pub struct Upload {
    pub id: String,
    path: PathBuf,
    file: Option<tokio::fs::File>,
    pub bytes: u64,
    /// The room's count of arriving bytes, which this upload's bytes are in until it is kept or dropped.
    arriving: Arc<AtomicU64>,
    /// Whose it will be.
    pub owner: Owner,
}

impl Upload {
    /// Its content so far, opened again for reading (a check before it is kept); what was written is flushed
    /// first (tokio writes a file in the background).
    pub async fn reopen(&mut self) -> Result<tokio::fs::File, ApiError> {
        if let Some(file) = self.file.as_mut() {
            file.flush().await.map_err(disk)?;
        }
        tokio::fs::File::open(&self.path).await.map_err(disk)
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        self.arriving.fetch_sub(self.bytes, Ordering::Relaxed);
        if self.file.is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Store {
    fn room(&self) -> Result<&FileRoom, ApiError> {
        self.files.as_ref().ok_or_else(|| ApiError::bad_request("This server keeps no files: its state store is off."))
    }

    /// What is stored, and what `owner` stores, against the caps: a 413 if `more` bytes would pass either.
    pub async fn fits(&self, owner: &Owner, more: u64) -> Result<(), ApiError> {
        let room = self.room()?;
        if let Some(cap) = room.total_max {
            let stored = self.db.files_bytes(None).await.map_err(failed)?.max(0) as u64;
            if stored + more > cap {
                return Err(ApiError::FilesFull { stored, cap, whose: "stored here" });
            }
        }
        if let Some(cap) = room.owner_max {
            let stored = self.db.files_bytes(Some(owner.as_str())).await.map_err(failed)?.max(0) as u64;
            if stored + more > cap {
                return Err(ApiError::FilesFull { stored, cap, whose: "you store" });
            }
        }
        Ok(())
    }

    /// Write an upload's content to disk as it arrives: a 413 past `--max-file-bytes`, past what all files may hold
    /// (`--files-max-total-bytes`, with the uploads arriving beside it) or past `owner`'s share.
    pub async fn receive<E: std::fmt::Display>(
        &self,
        mut content: impl Stream<Item = Result<Bytes, E>> + Unpin,
        owner: &Owner,
    ) -> Result<Upload, ApiError> {
        let room = self.room()?;
        let capped = room.total_max.is_some() || room.owner_max.is_some();
        let (stored, mine) = match capped {
            true => (
                self.db.files_bytes(None).await.map_err(failed)?.max(0) as u64,
                self.db.files_bytes(Some(owner.as_str())).await.map_err(failed)?.max(0) as u64,
            ),
            false => (0, 0),
        };
        let id = crate::ids::random_id("file");
        let path = room.dir.join(format!("{id}.part"));
        let file = tokio::fs::File::create(&path).await.map_err(disk)?;
        let arriving = room.arriving.clone();
        let mut up = Upload { id, path, file: Some(file), bytes: 0, arriving, owner: owner.clone() };
        while let Some(chunk) = content.next().await {
            let chunk = chunk.map_err(|e| ApiError::bad_request(format!("The upload could not be read: {e}")))?;
            let n = chunk.len() as u64;
            up.bytes += n;
            let arriving = room.arriving.fetch_add(n, Ordering::Relaxed) + n;
            if up.bytes > room.max_bytes {
                return Err(ApiError::PayloadTooLarge(room.max_bytes as usize));
            }
            if let Some(cap) = room.total_max
                && stored + arriving > cap
            {
                return Err(ApiError::FilesFull { stored: stored + arriving - up.bytes, cap, whose: "stored here" });
            }
            if let Some(cap) = room.owner_max
                && mine + up.bytes > cap
            {
                return Err(ApiError::FilesFull { stored: mine, cap, whose: "you store" });
            }
            up.file.as_mut().expect("open while receiving").write_all(&chunk).await.map_err(disk)?;
        }
        Ok(up)
    }

    /// Keep a received upload: its content synced under its id, then its row. The File object.
    pub async fn keep_file(
        &self,
        mut up: Upload,
        filename: &str,
        purpose: &str,
        expires_after: Option<i64>,
    ) -> Result<Value, ApiError> {
        let room = self.room()?;
        up.file.as_mut().expect("open until kept").sync_all().await.map_err(disk)?;
        let _keeping = room.keeping.lock().await;
        // Counted again from the rows, under the lock: two uploads that arrived side by side are not both kept
        // past a cap.
        self.fits(&up.owner, up.bytes).await?;
        let now = items::now();
        let f = StoredFile {
            id: up.id.clone(),
            created_at: now,
            expires_at: expires_after.map(|s| now + s),
            bytes: up.bytes as i64,
            filename: filename.chars().take(MAX_FILE_NAME_CHARS).collect(),
            purpose: purpose.to_string(),
            owned_by: up.owner.as_str().to_string(),
        };
        tokio::fs::rename(&up.path, content_path(&room.dir, &f.id)).await.map_err(disk)?;
        up.file = None; // renamed: nothing to remove
        let put = self.db.put_file(&f).await;
        drop(up); // its bytes are in the row now (or gone): no longer arriving
        if let Err(e) = put {
            let _ = tokio::fs::remove_file(content_path(&room.dir, &f.id)).await;
            return Err(failed(e));
        }
        Ok(file_object(&f))
    }

    /// `owner`'s file (another owner's is not found).
    pub async fn file(&self, id: &str, owner: &Owner) -> Result<StoredFile, ApiError> {
        self.room()?;
        let f = self.db.get_file(id).await.map_err(failed)?;
        let live = |f: &StoredFile| f.expires_at.is_none_or(|at| at >= items::now()) && f.owned_by == owner.as_str();
        f.filter(live).ok_or_else(|| not_found(id))
    }

    /// The file and its content, open for reading.
    pub async fn file_content(&self, id: &str, owner: &Owner) -> Result<(StoredFile, tokio::fs::File), ApiError> {
        let f = self.file(id, owner).await?;
        let content = tokio::fs::File::open(content_path(&self.room()?.dir, id)).await.map_err(|e| {
            tracing::error!(file_id = %id, "the content of a stored file cannot be read: {e}");
            ApiError::Store
        })?;
        Ok((f, content))
    }

    pub async fn list_files(
        &self,
        owner: &Owner,
        after: Option<&str>,
        limit: usize,
        ascending: bool,
        purpose: Option<&str>,
    ) -> Result<(Vec<Value>, bool), ApiError> {
        self.room()?;
        let page =
            self.db.list_files(owner.as_str(), after, limit as i64 + 1, ascending, purpose).await.map_err(failed)?;
        let Some(mut page) = page else {
            return Err(ApiError::bad_param("after", format!("No file with id '{}'.", after.unwrap_or_default())));
        };
        let has_more = page.len() > limit;
        page.truncate(limit);
        Ok((page.iter().map(file_object).collect(), has_more))
    }

    pub async fn delete_file(&self, id: &str, owner: &Owner) -> Result<Value, ApiError> {
        let room = self.room()?;
        if !self.db.delete_file(id, owner.as_str()).await.map_err(failed)? {
            return Err(not_found(id));
        }
        remove_content(&room.dir, id).await;
        Ok(json!({"id": id, "object": "file", "deleted": true}))
    }

    /// Remove the files past their `expires_after`, rows and contents.
    pub(super) async fn expire_files(&self) {
        let Some(room) = &self.files else { return };
        match self.db.expire_files(items::now()).await {
            Ok(ids) => {
                for id in &ids {
                    remove_content(&room.dir, id).await;
                }
                if !ids.is_empty() {
                    tracing::info!(removed = ids.len(), "files past their expires_after removed");
                }
            }
            Err(e) => tracing::warn!("could not remove expired files: {e}"),
        }
    }
}

/// The File object (`expires_at` only for a file that expires).
pub fn file_object(f: &StoredFile) -> Value {
    let mut o = json!({
        "id": f.id, "object": "file", "bytes": f.bytes, "created_at": f.created_at, "filename": f.filename,
        "purpose": f.purpose, "status": "processed",
    });
    if let Some(at) = f.expires_at {
        o["expires_at"] = json!(at);
    }
    o
}

/// Where a file's content is: its id is the server's own (`file_` and random hex), never a client's name.
pub fn content_path(dir: &Path, id: &str) -> PathBuf {
    dir.join(id)
}

async fn remove_content(dir: &Path, id: &str) {
    if let Err(e) = tokio::fs::remove_file(content_path(dir, id)).await
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(file_id = %id, "could not remove a file's content: {e}");
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound { what: "File", id: id.to_string(), param: None }
}

/// A failure of the files directory: a 503 `store_unavailable` when it is full (ENOSPC, or a quota's EDQUOT: a
/// retry succeeds once there is room), else a 500.
fn disk(e: std::io::Error) -> ApiError {
    tracing::error!("the files directory failed: {e}");
    if is_full(&e) { ApiError::StoreUnavailable(super::DISK_FULL) } else { ApiError::Store }
}

/// Whether a write failed for want of room.
pub fn is_full(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::StorageFull || matches!(e.raw_os_error(), Some(28 | 122))
}

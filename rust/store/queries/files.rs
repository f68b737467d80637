//! Uploaded files' rows (their contents are files on disk: `store::files`).

use crate::store::db::{Db, on_pool};
use crate::store::{StoreError, StoredFile};

impl Db {
    pub async fn put_file(&self, f: &StoredFile) -> Result<(), StoreError> {
        let q = "INSERT INTO files (id, created_at, expires_at, bytes, filename, purpose, owned_by) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7)";
        on_pool!(self, |pool| {
            let q = sqlx::query(q).bind(&f.id).bind(f.created_at).bind(f.expires_at).bind(f.bytes);
            q.bind(&f.filename).bind(&f.purpose).bind(&f.owned_by).execute(pool).await?;
        });
        Ok(())
    }

    pub async fn get_file(&self, id: &str) -> Result<Option<StoredFile>, StoreError> {
        let q = "SELECT * FROM files WHERE id = $1";
        Ok(on_pool!(self, |pool| sqlx::query_as(q).bind(id).fetch_optional(pool).await?))
    }

    /// Up to `limit` of `owner`'s files made before (newest first) or after (oldest first) the file `after`, with
    /// one `purpose` or any; None when `after` is not one of its files.
    pub async fn list_files(
        &self,
        owner: &str,
        after: Option<&str>,
        limit: i64,
        ascending: bool,
        purpose: Option<&str>,
    ) -> Result<Option<Vec<StoredFile>>, StoreError> {
        let from = match after {
            Some(after) => {
                let q = "SELECT seq FROM files WHERE id = $1 AND owned_by = $2";
                let seq: Option<i64> =
                    on_pool!(self, |pool| sqlx::query_scalar(q).bind(after).bind(owner).fetch_optional(pool).await?);
                match seq {
                    Some(seq) => seq,
                    None => return Ok(None),
                }
            }
            None if ascending => 0,
            None => i64::MAX,
        };
        let q = if ascending {
            "SELECT * FROM files WHERE seq > $1 AND ($2 = '' OR purpose = $2) AND owned_by = $4 ORDER BY seq ASC LIMIT $3"
        } else {
            "SELECT * FROM files WHERE seq < $1 AND ($2 = '' OR purpose = $2) AND owned_by = $4 ORDER BY seq DESC LIMIT $3"
        };
        let purpose = purpose.unwrap_or_default();
        Ok(Some(on_pool!(self, |pool| sqlx::query_as(q)
            .bind(from)
            .bind(purpose)
            .bind(limit)
            .bind(owner)
            .fetch_all(pool)
            .await?)))
    }

    /// Whether it was there, `owner`'s.
    pub async fn delete_file(&self, id: &str, owner: &str) -> Result<bool, StoreError> {
        let q = "DELETE FROM files WHERE id = $1 AND owned_by = $2";
        Ok(on_pool!(self, |pool| sqlx::query(q).bind(id).bind(owner).execute(pool).await?.rows_affected()) > 0)
    }

    /// What stored files hold, in bytes: all of them, or one owner's.
    pub async fn files_bytes(&self, owner: Option<&str>) -> Result<i64, StoreError> {
        let q = "SELECT CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM files WHERE $1 IS NULL OR owned_by = $1";
        Ok(on_pool!(self, |pool| sqlx::query_scalar::<_, i64>(q).bind(owner).fetch_one(pool).await?))
    }

    /// The files past their `expires_at` (Unix seconds) at `now`, removed from the table: their ids, for their
    /// contents to go too.
    pub async fn expire_files(&self, now: i64) -> Result<Vec<String>, StoreError> {
        let q = "DELETE FROM files WHERE expires_at IS NOT NULL AND expires_at < $1 RETURNING id";
        Ok(on_pool!(self, |pool| sqlx::query_scalar(q).bind(now).fetch_all(pool).await?))
    }
}

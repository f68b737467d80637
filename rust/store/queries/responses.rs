//! Stored responses' rows.

use crate::store::db::{Db, on_pool};
use crate::store::{StoreError, StoredResponse};

impl Db {
    /// Insert responses, in one transaction. An id already there is replaced but for its creation time: a retried
    /// write is harmless, and a background response's finished record replaces its queued one.
    pub async fn put_responses(&self, rs: &[StoredResponse]) -> Result<(), StoreError> {
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            for r in rs {
                sqlx::query(
                    "INSERT INTO responses \
                     (id, created_at, model, previous_response_id, context, input_items, response, bytes) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
                     ON CONFLICT (id) DO UPDATE SET model = excluded.model, \
                     previous_response_id = excluded.previous_response_id, context = excluded.context, \
                     input_items = excluded.input_items, response = excluded.response, bytes = excluded.bytes",
                )
                .bind(&r.id)
                .bind(r.created_at)
                .bind(&r.model)
                .bind(&r.previous_response_id)
                .bind(&r.context)
                .bind(&r.input_items)
                .bind(&r.response)
                .bind((r.context.len() + r.input_items.len() + r.response.len()) as i64)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    pub async fn get_response(&self, id: &str) -> Result<Option<StoredResponse>, StoreError> {
        let q = "SELECT * FROM responses WHERE id = $1";
        Ok(on_pool!(self, |pool| sqlx::query_as(q).bind(id).fetch_optional(pool).await?))
    }

    /// Whether it was there.
    pub async fn delete_response(&self, id: &str) -> Result<bool, StoreError> {
        let q = "DELETE FROM responses WHERE id = $1";
        Ok(on_pool!(self, |pool| sqlx::query(q).bind(id).execute(pool).await?.rows_affected()) > 0)
    }

    /// Remove the responses created before `created_before` (Unix seconds); how many went.
    pub async fn expire_responses(&self, created_before: i64) -> Result<u64, StoreError> {
        let q = "DELETE FROM responses WHERE created_at < $1";
        Ok(on_pool!(self, |pool| sqlx::query(q).bind(created_before).execute(pool).await?.rows_affected()))
    }

    /// What stored responses and conversations hold, in bytes (the size cap's measure), read from the indexes.
    pub async fn stored_bytes(&self) -> Result<i64, StoreError> {
        let q = "SELECT CAST((SELECT COALESCE(SUM(bytes), 0) FROM responses) \
                 + (SELECT COALESCE(SUM(bytes), 0) FROM conversation_items) AS BIGINT)";
        Ok(on_pool!(self, |pool| sqlx::query_scalar::<_, i64>(q).fetch_one(pool).await?))
    }

    /// The creation time of the oldest stored response.
    pub async fn oldest_response(&self) -> Result<Option<i64>, StoreError> {
        let q = "SELECT MIN(created_at) FROM responses";
        Ok(on_pool!(self, |pool| sqlx::query_scalar(q).fetch_one(pool).await?))
    }

    /// Remove the oldest stored responses, enough to free `need` bytes, none created after `until` (Unix
    /// seconds) and at most `EVICT_CHUNK`: (bytes freed, how many went).
    pub async fn evict_oldest_responses(&self, need: i64, until: Option<i64>) -> Result<(i64, u64), StoreError> {
        const EVICT_CHUNK: i64 = 256;
        let q = "SELECT id, bytes FROM responses WHERE created_at <= $1 ORDER BY created_at, id LIMIT $2";
        let until = until.unwrap_or(i64::MAX);
        let oldest: Vec<(String, i64)> =
            on_pool!(self, |pool| sqlx::query_as(q).bind(until).bind(EVICT_CHUNK).fetch_all(pool).await?);
        let (mut freed, mut gone) = (0, 0);
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            for (id, bytes) in oldest {
                if freed >= need {
                    break;
                }
                gone += sqlx::query("DELETE FROM responses WHERE id = $1")
                    .bind(&id)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                freed += bytes;
            }
            tx.commit().await?;
        });
        Ok((freed, gone))
    }
}

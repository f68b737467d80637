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
                    "INSERT INTO responses (id, created_at, model, previous_response_id, context, input_items, response) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7) \
                     ON CONFLICT (id) DO UPDATE SET model = excluded.model, \
                     previous_response_id = excluded.previous_response_id, context = excluded.context, \
                     input_items = excluded.input_items, response = excluded.response",
                )
                .bind(&r.id)
                .bind(r.created_at)
                .bind(&r.model)
                .bind(&r.previous_response_id)
                .bind(&r.context)
                .bind(&r.input_items)
                .bind(&r.response)
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
}

//! Stored responses' rows.

use crate::store::db::{Db, Held, on_held, on_pool};
use crate::store::{StoreError, StoredResponse};

impl Db {
    /// Insert responses, in one statement (so one transaction, and one round trip), on the writer's held connection
    /// if given. An id already there is replaced but for its creation time: a retried write is harmless, and a
    /// background response's finished record replaces its queued one. An id twice in `rs` is written once, the
    /// later (one statement cannot update a row twice).
    pub async fn put_responses(&self, held: Option<&mut Held>, rs: &[&StoredResponse]) -> Result<(), StoreError> {
        let mut seen = std::collections::HashSet::new();
        let rows: Vec<&StoredResponse> = rs.iter().rev().copied().filter(|r| seen.insert(&r.id)).collect();
        if rows.is_empty() {
            return Ok(());
        }
        on_held!(self, held, |e| {
            let mut q = sqlx::QueryBuilder::new(
                "INSERT INTO responses (id, created_at, model, previous_response_id, context, input_items, response, \
                 bytes) ",
            );
            q.push_values(rows, |mut row, r| {
                row.push_bind(&r.id)
                    .push_bind(r.created_at)
                    .push_bind(&r.model)
                    .push_bind(&r.previous_response_id)
                    .push_bind(&r.context)
                    .push_bind(&r.input_items)
                    .push_bind(&r.response)
                    .push_bind((r.context.len() + r.input_items.len() + r.response.len()) as i64);
            });
            q.push(
                " ON CONFLICT (id) DO UPDATE SET model = excluded.model, \
                 previous_response_id = excluded.previous_response_id, context = excluded.context, \
                 input_items = excluded.input_items, response = excluded.response, bytes = excluded.bytes",
            );
            q.build().execute(e).await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, text: &str) -> StoredResponse {
        StoredResponse {
            id: id.into(),
            created_at: 1,
            model: "m".into(),
            previous_response_id: None,
            context: "[]".into(),
            input_items: "[]".into(),
            response: text.into(),
        }
    }

    #[tokio::test]
    async fn a_batch_is_one_statement_on_the_held_connection_and_an_id_twice_keeps_the_later() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(dir.path().join("s.sqlite3").to_str().unwrap()).await.unwrap();
        let mut held = db.hold().await.unwrap();
        assert!(held.is_some(), "a file's store holds a connection for its writer");
        let many: Vec<StoredResponse> = (0..256).map(|i| row(&format!("resp_{i}"), "{}")).collect();
        db.put_responses(held.as_mut(), &many.iter().collect::<Vec<_>>()).await.unwrap();
        let (first, again) = (row("resp_7", r#"{"v":1}"#), row("resp_7", r#"{"v":2}"#));
        db.put_responses(held.as_mut(), &[&first, &again]).await.unwrap();
        assert_eq!(db.get_response("resp_7").await.unwrap().unwrap().response, r#"{"v":2}"#);
        assert_eq!(db.get_response("resp_255").await.unwrap().unwrap().response, "{}");
        let memory = Db::open("memory").await.unwrap();
        assert!(memory.hold().await.unwrap().is_none(), "an in-memory store's one connection is everyone's");
        memory.put_responses(None, &[&first]).await.unwrap();
        assert!(memory.get_response("resp_7").await.unwrap().is_some());
    }
}

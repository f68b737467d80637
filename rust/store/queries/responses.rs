//! Stored responses' rows.

use crate::limits::MAX_CHAIN_DEPTH;
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
                 bytes, owned_by) ",
            );
            q.push_values(rows, |mut row, r| {
                row.push_bind(&r.id)
                    .push_bind(r.created_at)
                    .push_bind(&r.model)
                    .push_bind(&r.previous_response_id)
                    .push_bind(&r.context)
                    .push_bind(&r.input_items)
                    .push_bind(&r.response)
                    .push_bind((r.context.len() + r.input_items.len() + r.response.len()) as i64)
                    .push_bind(&r.owned_by);
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

    /// Whether it was there, `owner`'s.
    pub async fn delete_response(&self, id: &str, owner: &str) -> Result<bool, StoreError> {
        let q = "DELETE FROM responses WHERE id = $1 AND owned_by = $2";
        Ok(on_pool!(self, |pool| sqlx::query(q).bind(id).bind(owner).execute(pool).await?.rows_affected()) > 0)
    }

    /// The chain that ends at `id`, newest first, as (id, its bytes, whether it keeps a copy of what came before
    /// it): walked through `previous_response_id` up to the chain's start, a row that keeps such a copy, or a
    /// response no longer stored (then the last one's previous is not None). Sizes only: a chain too large to
    /// continue is refused before its text is read.
    pub async fn chain_sizes(&self, id: &str) -> Result<Vec<ChainLink>, StoreError> {
        let q = "WITH RECURSIVE chain (id, previous_response_id, bytes, copied, depth) AS ( \
                   SELECT id, previous_response_id, bytes, context <> '', 0 FROM responses WHERE id = $1 \
                   UNION ALL \
                   SELECT r.id, r.previous_response_id, r.bytes, r.context <> '', c.depth + 1 \
                   FROM responses r JOIN chain c ON r.id = c.previous_response_id \
                   WHERE NOT c.copied AND c.depth < $2) \
                 SELECT id, previous_response_id, bytes, copied FROM chain ORDER BY depth";
        Ok(on_pool!(self, |pool| sqlx::query_as(q).bind(id).bind(MAX_CHAIN_DEPTH).fetch_all(pool).await?))
    }

    /// The responses of a chain, by id, in the order given.
    pub async fn get_responses(&self, ids: &[String]) -> Result<Vec<StoredResponse>, StoreError> {
        let mut out = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(256) {
            let rows: Vec<StoredResponse> = on_pool!(self, |pool| {
                let mut q = sqlx::QueryBuilder::new("SELECT * FROM responses WHERE id IN (");
                let mut list = q.separated(", ");
                for id in chunk {
                    list.push_bind(id);
                }
                q.push(")");
                q.build_query_as().fetch_all(pool).await?
            });
            out.extend(rows);
        }
        let at: std::collections::HashMap<&str, usize> =
            ids.iter().enumerate().map(|(i, id)| (id.as_str(), i)).collect();
        out.sort_by_key(|r| at.get(r.id.as_str()).copied().unwrap_or(usize::MAX));
        Ok(out)
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

    /// What one owner's stored responses and conversations hold, in bytes (its share's measure), from the
    /// (owned_by, bytes) indexes.
    pub async fn owner_bytes(&self, owner: &str) -> Result<i64, StoreError> {
        let q = "SELECT CAST((SELECT COALESCE(SUM(bytes), 0) FROM responses WHERE owned_by = $1) \
                 + (SELECT COALESCE(SUM(bytes), 0) FROM conversation_items WHERE owned_by = $1) AS BIGINT)";
        Ok(on_pool!(self, |pool| sqlx::query_scalar::<_, i64>(q).bind(owner).fetch_one(pool).await?))
    }
}

/// One response of a chain, as `chain_sizes` reads it.
#[derive(Debug, sqlx::FromRow)]
pub struct ChainLink {
    pub id: String,
    pub previous_response_id: Option<String>,
    pub bytes: i64,
    pub copied: bool,
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
            owned_by: String::new(),
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

//! Batches' rows: the Batch object with its runner's claim, and each input line's result.

use crate::store::db::{Db, on_pool};
use crate::store::{StoreError, StoredBatch};

impl Db {
    pub async fn put_batch(&self, b: &StoredBatch) -> Result<(), StoreError> {
        let q = "INSERT INTO batches (id, created_at, status, batch, trace_context, owned_by) \
                 VALUES ($1, $2, $3, $4, $5, $6)";
        on_pool!(self, |pool| {
            let q = sqlx::query(q).bind(&b.id).bind(b.created_at).bind(&b.status).bind(&b.batch);
            q.bind(&b.trace_context).bind(&b.owned_by).execute(pool).await?;
        });
        Ok(())
    }

    /// Replace the Batch object (and its status) if its status is still `was` (a cancel asked meanwhile is never
    /// written over); with `owner`, only while this replica holds the claim. Whether it was replaced.
    pub async fn set_batch(
        &self,
        id: &str,
        was: &str,
        status: &str,
        batch: &str,
        owner: Option<&str>,
    ) -> Result<bool, StoreError> {
        let q = "UPDATE batches SET status = $2, batch = $3 WHERE id = $1 AND status = $4 AND ($5 = '' OR owner = $5)";
        let owner = owner.unwrap_or_default();
        let n = on_pool!(self, |pool| {
            let q = sqlx::query(q).bind(id).bind(status).bind(batch).bind(was).bind(owner);
            q.execute(pool).await?.rows_affected()
        });
        Ok(n > 0)
    }

    pub async fn get_batch(&self, id: &str) -> Result<Option<StoredBatch>, StoreError> {
        let q = "SELECT id, created_at, status, batch, trace_context, owned_by FROM batches WHERE id = $1";
        Ok(on_pool!(self, |pool| sqlx::query_as(q).bind(id).fetch_optional(pool).await?))
    }

    /// Up to `limit` of `owner`'s batches whose ids start with `kind` (`batch_`, or Anthropic's `msgbatch_`: each
    /// API lists its own) made before `after` (newest first); None when `after` is not such a batch.
    pub async fn list_batches(
        &self,
        kind: &str,
        owner: &str,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Option<Vec<StoredBatch>>, StoreError> {
        let from = match after {
            Some(after) => match self.get_batch(after).await?.filter(|b| b.id.starts_with(kind) && b.owned_by == owner)
            {
                Some(b) => (b.created_at, b.id),
                None => return Ok(None),
            },
            None => (i64::MAX, String::new()),
        };
        let q = "SELECT id, created_at, status, batch, trace_context, owned_by FROM batches \
                 WHERE substr(id, 1, $4) = $5 AND (created_at < $1 OR (created_at = $1 AND id < $2)) AND owned_by = $6 \
                 ORDER BY created_at DESC, id DESC LIMIT $3";
        Ok(Some(on_pool!(self, |pool| sqlx::query_as(q)
            .bind(from.0)
            .bind(&from.1)
            .bind(limit)
            .bind(kind.len() as i32)
            .bind(kind)
            .bind(owner)
            .fetch_all(pool)
            .await?)))
    }

    /// Claim (or renew the claim on) a batch that is not finished and that no live replica holds: true if this
    /// replica (`owner`) now runs it, until `until`.
    pub async fn claim_batch(&self, id: &str, owner: &str, now: i64, until: i64) -> Result<bool, StoreError> {
        let q = "UPDATE batches SET owner = $2, lease_until = $4 WHERE id = $1 \
                 AND status IN ('validating', 'in_progress', 'finalizing', 'cancelling') \
                 AND (owner IS NULL OR owner = $2 OR lease_until < $3)";
        let n = on_pool!(self, |pool| {
            sqlx::query(q).bind(id).bind(owner).bind(now).bind(until).execute(pool).await?.rows_affected()
        });
        Ok(n > 0)
    }

    /// A batch and its results; whether it was there.
    pub async fn delete_batch(&self, id: &str) -> Result<bool, StoreError> {
        let n = on_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            sqlx::query("DELETE FROM batch_results WHERE batch_id = $1").bind(id).execute(&mut *tx).await?;
            let n = sqlx::query("DELETE FROM batches WHERE id = $1").bind(id).execute(&mut *tx).await?;
            tx.commit().await?;
            n.rows_affected()
        });
        Ok(n > 0)
    }

    /// Up to `limit` unfinished batches no live replica holds (or `owner` does), oldest first.
    pub async fn claimable_batches(&self, owner: &str, now: i64, limit: i64) -> Result<Vec<String>, StoreError> {
        let q = "SELECT id FROM batches WHERE status IN ('validating', 'in_progress', 'finalizing', 'cancelling') \
                 AND (owner IS NULL OR owner = $1 OR lease_until < $2) ORDER BY created_at ASC, id ASC LIMIT $3";
        Ok(on_pool!(self, |pool| sqlx::query_scalar(q).bind(owner).bind(now).bind(limit).fetch_all(pool).await?))
    }

    /// Record lines' results; a line already recorded keeps its first result. How many were new.
    pub async fn put_results(&self, id: &str, results: &[(i64, bool, String)]) -> Result<u64, StoreError> {
        let q = "INSERT INTO batch_results (batch_id, line, ok, result) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT (batch_id, line) DO NOTHING";
        let n = on_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            let mut n = 0;
            for (line, ok, result) in results {
                n += sqlx::query(q).bind(id).bind(line).bind(ok).bind(result).execute(&mut *tx).await?.rows_affected();
            }
            tx.commit().await?;
            n
        });
        Ok(n)
    }

    /// The lines with a result, and how many of them failed.
    pub async fn done_lines(&self, id: &str) -> Result<(Vec<i64>, i64), StoreError> {
        let q = "SELECT line, ok FROM batch_results WHERE batch_id = $1";
        let rows: Vec<(i64, bool)> = on_pool!(self, |pool| sqlx::query_as(q).bind(id).fetch_all(pool).await?);
        let failed = rows.iter().filter(|(_, ok)| !ok).count() as i64;
        Ok((rows.into_iter().map(|(line, _)| line).collect(), failed))
    }

    /// The results of one kind (succeeded or failed) in line order, from line `from` on, at most `limit`.
    /// What a batch's recorded results hold, in characters (about their bytes): what its output files will.
    pub async fn results_bytes(&self, id: &str) -> Result<i64, StoreError> {
        let q = "SELECT CAST(COALESCE(SUM(LENGTH(result) + 1), 0) AS BIGINT) FROM batch_results WHERE batch_id = $1";
        Ok(on_pool!(self, |pool| sqlx::query_scalar(q).bind(id).fetch_one(pool).await?))
    }

    pub async fn results(&self, id: &str, ok: bool, from: i64, limit: i64) -> Result<Vec<(i64, String)>, StoreError> {
        let q = "SELECT line, result FROM batch_results WHERE batch_id = $1 AND ok = $2 AND line >= $3 \
                 ORDER BY line LIMIT $4";
        Ok(on_pool!(self, |pool| sqlx::query_as(q).bind(id).bind(ok).bind(from).bind(limit).fetch_all(pool).await?))
    }

    /// Remove the finished batches created before `created_before` (Unix seconds), with their results; how many
    /// went. Their output and error files are files: they go at their own time.
    pub async fn expire_batches(&self, created_before: i64) -> Result<u64, StoreError> {
        const ENDED: &str =
            "created_at < $1 AND status NOT IN ('validating', 'in_progress', 'finalizing', 'cancelling')";
        let n = on_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            let q = format!("DELETE FROM batch_results WHERE batch_id IN (SELECT id FROM batches WHERE {ENDED})");
            sqlx::query(&q).bind(created_before).execute(&mut *tx).await?;
            let q = format!("DELETE FROM batches WHERE {ENDED}");
            let n = sqlx::query(&q).bind(created_before).execute(&mut *tx).await?;
            tx.commit().await?;
            n.rows_affected()
        });
        Ok(n)
    }
}

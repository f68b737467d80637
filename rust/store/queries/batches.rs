//! Batches' rows: the Batch object with its runner's claim, and each input line's result.

use crate::store::db::{Db, on_pool};
use crate::store::{StoreError, StoredBatch};

/// A runner's claim on a batch, its fencing token: the owner (the replica's runner) and the generation it took the
/// claim under. Every write the holder makes names both, so one that lost its claim has its writes refused.
#[derive(Clone, Copy, Debug)]
pub struct Claim<'a> {
    pub owner: &'a str,
    pub generation: i64,
}

impl Db {
    pub async fn put_batch(&self, b: &StoredBatch) -> Result<(), StoreError> {
        let q = "INSERT INTO batches (id, created_at, status, batch, trace_context, owned_by) \
                 VALUES ($1, $2, $3, $4, $5, $6)";
        on_pool!(self, |pool| {
            let q = sqlx::query(q).bind(&b.id).bind(b.created_at).bind(b.status.as_str()).bind(&b.batch);
            q.bind(&b.trace_context).bind(&b.owned_by).execute(pool).await?;
        });
        Ok(())
    }

    /// Replace the Batch object (and the status column, its `status`) if its status is still `was` (a cancel asked
    /// meanwhile is never written over); with a `claim`, only while that claim (owner and generation) still holds,
    /// in the same statement. Whether it was replaced.
    pub async fn set_batch(
        &self,
        id: &str,
        was: &str,
        status: &str,
        text: &str,
        claim: Option<Claim<'_>>,
    ) -> Result<bool, StoreError> {
        let q = "UPDATE batches SET status = $2, batch = $3 WHERE id = $1 AND status = $4 \
                 AND ($5 = '' OR (owner = $5 AND claim_gen = $6))";
        let (owner, generation) = claim.map_or(("", 0), |c| (c.owner, c.generation));
        let n = on_pool!(self, |pool| {
            let q = sqlx::query(q).bind(id).bind(status).bind(text).bind(was).bind(owner).bind(generation);
            q.execute(pool).await?.rows_affected()
        });
        Ok(n > 0)
    }

    /// Move a batch to `cancelling` (any replica, holding no claim: its runner reads the status), only if neither
    /// its status nor its object changed since they were read (`was`, `was_batch`: the row's text as read): a
    /// runner's counts written meanwhile are never put back. Whether it was moved.
    pub async fn cancel_batch(&self, id: &str, was: &str, was_batch: &str, text: &str) -> Result<bool, StoreError> {
        let q = "UPDATE batches SET status = 'cancelling', batch = $2 WHERE id = $1 AND status = $3 AND batch = $4";
        let n = on_pool!(self, |pool| {
            let q = sqlx::query(q).bind(id).bind(text).bind(was).bind(was_batch);
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

    /// Take the claim on a batch that is not finished and that no live replica holds (nobody, its lease ran out,
    /// it was released, or this runner's own left over from a run that ended): this replica (`owner`) runs it until
    /// `until`, under a new generation, which it returns (None: not taken). Every write its runner makes names that
    /// generation, so the holder it was taken from has its writes refused.
    pub async fn claim_batch(&self, id: &str, owner: &str, now: i64, until: i64) -> Result<Option<i64>, StoreError> {
        let q = "UPDATE batches SET owner = $2, lease_until = $4, claim_gen = claim_gen + 1 WHERE id = $1 \
                 AND status IN ('validating', 'in_progress', 'finalizing', 'cancelling') \
                 AND (owner IS NULL OR owner = $2 OR lease_until < $3) RETURNING claim_gen";
        Ok(on_pool!(self, |pool| {
            let q = sqlx::query_scalar(q).bind(id).bind(owner).bind(now).bind(until);
            q.fetch_optional(pool).await?
        }))
    }

    /// Renew a claim until `until`, only if it still holds (same owner, same generation): false means it was lost
    /// (taken over after its lease ran out), and its holder must stop.
    pub async fn renew_batch(&self, id: &str, claim: Claim<'_>, until: i64) -> Result<bool, StoreError> {
        let q = "UPDATE batches SET lease_until = $4 WHERE id = $1 AND owner = $2 AND claim_gen = $3";
        let n = on_pool!(self, |pool| {
            let q = sqlx::query(q).bind(id).bind(claim.owner).bind(claim.generation).bind(until);
            q.execute(pool).await?.rows_affected()
        });
        Ok(n > 0)
    }

    /// Let a claim go (a drain): the next replica to look takes the batch at once, without waiting for a lease.
    /// Only the claim's holder can; whether it still held it.
    pub async fn release_batch(&self, id: &str, claim: Claim<'_>) -> Result<bool, StoreError> {
        let q = "UPDATE batches SET owner = NULL, lease_until = 0 WHERE id = $1 AND owner = $2 AND claim_gen = $3";
        let n = on_pool!(self, |pool| {
            let q = sqlx::query(q).bind(id).bind(claim.owner).bind(claim.generation);
            q.execute(pool).await?.rows_affected()
        });
        Ok(n > 0)
    }

    /// Whether a claim still holds.
    pub async fn holds_batch(&self, id: &str, claim: Claim<'_>) -> Result<bool, StoreError> {
        let q = "SELECT COUNT(*) FROM batches WHERE id = $1 AND owner = $2 AND claim_gen = $3";
        let n: i64 = on_pool!(self, |pool| {
            sqlx::query_scalar(q).bind(id).bind(claim.owner).bind(claim.generation).fetch_one(pool).await?
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

    /// Record lines' results, only while `claim` holds: each insert names the claim in its own statement, and the
    /// transaction begins by touching the claim's row (in PostgreSQL that locks it, so a takeover waits for the
    /// commit and then reads these results as done). A line already recorded keeps its first result. Whether they
    /// were accepted (false: the claim was lost, and nothing was written).
    pub async fn put_results(
        &self,
        id: &str,
        claim: Claim<'_>,
        results: &[(i64, bool, String)],
    ) -> Result<bool, StoreError> {
        let hold = "UPDATE batches SET lease_until = lease_until WHERE id = $1 AND owner = $2 AND claim_gen = $3";
        let q = "INSERT INTO batch_results (batch_id, line, ok, result) SELECT $1, $2, $3, $4 \
                 WHERE EXISTS (SELECT 1 FROM batches WHERE id = $1 AND owner = $5 AND claim_gen = $6) \
                 ON CONFLICT (batch_id, line) DO NOTHING";
        let (owner, generation) = (claim.owner, claim.generation);
        Ok(on_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            let held = sqlx::query(hold).bind(id).bind(owner).bind(generation).execute(&mut *tx).await?;
            if held.rows_affected() == 0 {
                tx.rollback().await?;
                false
            } else {
                for (line, ok, result) in results {
                    let q = sqlx::query(q).bind(id).bind(line).bind(ok).bind(result).bind(owner).bind(generation);
                    q.execute(&mut *tx).await?;
                }
                tx.commit().await?;
                true
            }
        }))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workers::batches::object::{Batch, BatchStatus};

    #[tokio::test]
    async fn a_claim_taken_over_has_every_write_of_its_old_holder_refused() {
        let db = Db::open("memory").await.unwrap();
        let mut batch = Batch::new("batch_1", "/v1/responses", "file-1", Default::default(), 1);
        batch.set_status(BatchStatus::InProgress, 1).unwrap();
        db.put_batch(&StoredBatch::new(&batch, None, "")).await.unwrap();
        assert_eq!(db.get_batch("batch_1").await.unwrap().unwrap().load().unwrap(), batch, "it loads as it was kept");
        let first = db.claim_batch("batch_1", "a", 100, 110).await.unwrap().unwrap();
        let a = Claim { owner: "a", generation: first };
        assert_eq!(db.claim_batch("batch_1", "b", 105, 115).await.unwrap(), None, "a live claim is not taken");
        assert!(db.renew_batch("batch_1", a, 120).await.unwrap());
        assert!(db.put_results("batch_1", a, &[(0, true, "r0".into())]).await.unwrap());

        // a's lease runs out (it was paused): b takes the batch over, under the next generation.
        let second = db.claim_batch("batch_1", "b", 121, 131).await.unwrap().unwrap();
        assert_eq!(second, first + 1);
        let b = Claim { owner: "b", generation: second };
        assert!(!db.renew_batch("batch_1", a, 140).await.unwrap(), "a's renewal finds its claim lost");
        assert!(!db.put_results("batch_1", a, &[(1, true, "stale".into())]).await.unwrap());
        assert!(
            !db.set_batch("batch_1", "in_progress", batch.status.as_str(), &batch.to_text(), Some(a)).await.unwrap()
        );
        assert!(!db.release_batch("batch_1", a).await.unwrap());
        assert!(!db.holds_batch("batch_1", a).await.unwrap() && db.holds_batch("batch_1", b).await.unwrap());
        assert_eq!(db.done_lines("batch_1").await.unwrap(), (vec![0], 0), "nothing of a's was written");

        // The holder's results: a line already recorded keeps its first.
        assert!(db.put_results("batch_1", b, &[(0, false, "again".into()), (1, true, "r1".into())]).await.unwrap());
        assert_eq!(db.results("batch_1", true, 0, 10).await.unwrap(), vec![(0, "r0".into()), (1, "r1".into())]);
        assert!(db.release_batch("batch_1", b).await.unwrap());
        assert_eq!(db.claimable_batches("c", 122, 10).await.unwrap(), vec!["batch_1".to_string()], "released: at once");
        assert_eq!(db.claim_batch("batch_1", "c", 122, 132).await.unwrap(), Some(second + 1));

        // A cancel names no claim, and goes only over the object it read.
        let (read, mut cancelling) = (batch.to_text(), batch.clone());
        cancelling.set_status(BatchStatus::Cancelling, 130).unwrap();
        let in_progress = BatchStatus::InProgress;
        assert!(!db.cancel_batch("batch_1", in_progress.as_str(), "{\"old\":1}", &cancelling.to_text()).await.unwrap());
        assert!(db.cancel_batch("batch_1", in_progress.as_str(), &read, &cancelling.to_text()).await.unwrap());
        assert_eq!(db.get_batch("batch_1").await.unwrap().unwrap().load().unwrap(), cancelling);
    }
}

//! Background responses' claims: which replica runs each, until when, under which generation, and whether a cancel
//! was asked elsewhere.
//!
//! A claim is fenced (issue 40): (owner, claim_gen). `queue_run` starts it at generation 0, a take-over adds one,
//! and every write its holder makes names both in the same statement or transaction, so a replica that lost its
//! claim (paused past its lease, cut off from the store) has its writes refused. A run's final state is one
//! transaction that removes its claim and, only if it did, writes the final Response: whoever ends it first
//! (its holder, a canceller, a DELETE) wins, and nothing overwrites a final Response.

use crate::store::background::{Claim, Renewed, TakenOver};
use crate::store::db::{Db, on_pool};
use crate::store::{StoreError, StoredResponse};

impl Db {
    /// A background response as it is queued: its queued Response and its claim (generation 0, with the request
    /// to run again if its replica dies), in one transaction, so a store that fails between the two never leaves
    /// a `queued` Response that nobody will run.
    pub async fn queue_run(&self, row: &StoredResponse, body: &str, owner: &str, until: i64) -> Result<(), StoreError> {
        let response = "INSERT INTO responses (id, created_at, model, previous_response_id, context, input_items, \
                        response, bytes, owned_by) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)";
        let run = "INSERT INTO background_runs (id, body, owner, lease_until, claim_gen) VALUES ($1, $2, $3, $4, 0)";
        let bytes = (row.context.len() + row.input_items.len() + row.response.len()) as i64;
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            sqlx::query(response)
                .bind(&row.id)
                .bind(row.created_at)
                .bind(&row.model)
                .bind(&row.previous_response_id)
                .bind(&row.context)
                .bind(&row.input_items)
                .bind(&row.response)
                .bind(bytes)
                .bind(&row.owned_by)
                .execute(&mut *tx)
                .await?;
            sqlx::query(run).bind(&row.id).bind(body).bind(owner).bind(until).execute(&mut *tx).await?;
            tx.commit().await?;
        });
        Ok(())
    }

    /// Renew every claim `owner` holds: the claims renewed (a run here that is not among them lost its claim).
    pub async fn renew_runs(&self, owner: &str, until: i64) -> Result<Vec<Renewed>, StoreError> {
        let q = "UPDATE background_runs SET lease_until = $2 WHERE owner = $1 RETURNING id, claim_gen, cancel_asked, \
                 NOT EXISTS (SELECT 1 FROM responses r WHERE r.id = background_runs.id) AS deleted";
        Ok(on_pool!(self, |pool| sqlx::query_as(q).bind(owner).bind(until).fetch_all(pool).await?))
    }

    /// Take over the runs whose claim ran out before `now` (or was released: its lease is 0), each under a new
    /// generation.
    pub async fn claim_orphan_runs(&self, owner: &str, now: i64, until: i64) -> Result<Vec<TakenOver>, StoreError> {
        let q = "UPDATE background_runs SET owner = $1, lease_until = $3, claim_gen = claim_gen + 1 \
                 WHERE lease_until < $2 RETURNING id, body, claim_gen, cancel_asked";
        Ok(on_pool!(self, |pool| sqlx::query_as(q).bind(owner).bind(now).bind(until).fetch_all(pool).await?))
    }

    /// Give up a held claim without ending the run (a drain hands it over): another replica takes it at its next
    /// look. Whether it was still held.
    pub async fn release_run(&self, id: &str, owner: &str, generation: i64) -> Result<bool, StoreError> {
        let q = "UPDATE background_runs SET owner = '', lease_until = 0 \
                 WHERE id = $1 AND owner = $2 AND claim_gen = $3";
        let n = on_pool!(self, |pool| {
            sqlx::query(q).bind(id).bind(owner).bind(generation).execute(pool).await?.rows_affected()
        });
        Ok(n > 0)
    }

    /// Write a running Response (`in_progress`) if `owner` still holds the claim at `generation`; whether it did (false:
    /// the claim was lost, or the run ended or was deleted meanwhile).
    pub async fn put_running(
        &self,
        id: &str,
        owner: &str,
        generation: i64,
        response: &str,
    ) -> Result<bool, StoreError> {
        // Its size measure (`bytes`) is left as the queued Response's: the final write sets it.
        let q = "UPDATE responses SET response = $4 WHERE id = $1 AND EXISTS \
                 (SELECT 1 FROM background_runs b WHERE b.id = $1 AND b.owner = $2 AND b.claim_gen = $3)";
        let n = on_pool!(self, |pool| {
            let query = sqlx::query(q).bind(id).bind(owner).bind(generation).bind(response);
            query.execute(pool).await?.rows_affected()
        });
        Ok(n > 0)
    }

    /// End a run under `claim`: its claim removed and, only if it was there, its final Response written (None:
    /// nothing written, the run just ends, as when its Response was deleted). Whether this ended it (false: it
    /// was ended already, or taken over).
    pub async fn end_run(&self, id: &str, claim: Claim<'_>, response: Option<&str>) -> Result<bool, StoreError> {
        let ended = on_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            let removed = match claim {
                Claim::Held { owner, generation } => {
                    let q = "DELETE FROM background_runs WHERE id = $1 AND owner = $2 AND claim_gen = $3";
                    sqlx::query(q).bind(id).bind(owner).bind(generation).execute(&mut *tx).await?
                }
                Claim::Lapsed { now } => {
                    let q = "DELETE FROM background_runs WHERE id = $1 AND lease_until < $2";
                    sqlx::query(q).bind(id).bind(now).execute(&mut *tx).await?
                }
            };
            let ended = removed.rows_affected() > 0;
            if ended && let Some(response) = response {
                let q = "SELECT context, input_items FROM responses WHERE id = $1";
                let row: Option<(String, String)> = sqlx::query_as(q).bind(id).fetch_optional(&mut *tx).await?;
                if let Some((context, input_items)) = row {
                    let bytes = (context.len() + input_items.len() + response.len()) as i64;
                    let q = "UPDATE responses SET response = $2, bytes = $3 WHERE id = $1";
                    sqlx::query(q).bind(id).bind(response).bind(bytes).execute(&mut *tx).await?;
                }
            }
            tx.commit().await?;
            ended
        });
        Ok(ended)
    }

    /// Ask the replica running `id` to cancel it: whether its claim is still live (false: no run, or a lapsed
    /// one).
    pub async fn ask_cancel(&self, id: &str, now: i64) -> Result<bool, StoreError> {
        let q = "UPDATE background_runs SET cancel_asked = TRUE WHERE id = $1 AND lease_until >= $2";
        Ok(on_pool!(self, |pool| sqlx::query(q).bind(id).bind(now).execute(pool).await?.rows_affected()) > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn db_with(id: &str) -> Db {
        let db = Db::open("memory").await.unwrap();
        let row = StoredResponse {
            id: id.into(),
            created_at: 1,
            model: "m".into(),
            previous_response_id: None,
            context: String::new(),
            input_items: "[]".into(),
            response: r#"{"status":"queued"}"#.into(),
            owned_by: String::new(),
        };
        db.queue_run(&row, "{}", "a", 100).await.unwrap();
        db
    }

    #[tokio::test]
    async fn a_claim_lost_to_a_take_over_has_its_writes_refused_and_the_first_final_wins() {
        let db = db_with("r").await;
        let a = Claim::Held { owner: "a", generation: 0 };
        assert!(db.put_running("r", "a", 0, r#"{"status":"in_progress"}"#).await.unwrap());
        // a is paused past its lease: b takes the run over under generation 1.
        let taken = db.claim_orphan_runs("b", 200, 300).await.unwrap();
        assert_eq!((taken.len(), taken[0].claim_gen), (1, 1));
        assert!(db.renew_runs("a", 400).await.unwrap().is_empty(), "a no longer holds it");
        assert!(!db.put_running("r", "a", 0, r#"{"status":"stale"}"#).await.unwrap());
        assert!(
            db.end_run("r", Claim::Held { owner: "b", generation: 1 }, Some(r#"{"status":"completed"}"#))
                .await
                .unwrap()
        );
        assert!(!db.end_run("r", a, Some(r#"{"status":"late"}"#)).await.unwrap(), "a final is never overwritten");
        let stored = db.get_response("r").await.unwrap().unwrap();
        assert_eq!(stored.response, r#"{"status":"completed"}"#);
    }

    #[tokio::test]
    async fn a_released_claim_is_taken_at_once_and_a_deleted_response_shows_as_its_claim_renews() {
        let db = db_with("r").await;
        assert!(db.release_run("r", "a", 0).await.unwrap());
        assert!(!db.release_run("r", "a", 0).await.unwrap(), "released already");
        assert!(db.renew_runs("a", 100).await.unwrap().is_empty());
        let taken = db.claim_orphan_runs("b", 50, 150).await.unwrap();
        assert_eq!(taken[0].claim_gen, 1, "taken before any lease ran out");
        assert!(db.delete_response("r", "").await.unwrap());
        let renewed = db.renew_runs("b", 160).await.unwrap();
        assert!(renewed[0].deleted);
        // Its end writes nothing back: the DELETE sticks.
        assert!(db.end_run("r", Claim::Held { owner: "b", generation: 1 }, Some("{}")).await.unwrap());
        assert!(db.get_response("r").await.unwrap().is_none());
    }
}

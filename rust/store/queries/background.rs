//! Background responses' claims: which replica runs each, until when, and whether a cancel was asked elsewhere.

use crate::store::StoreError;
use crate::store::db::{Db, on_pool};

impl Db {
    /// A background response `owner` runs from now, with the request to run again if it dies.
    pub async fn put_run(&self, id: &str, body: &str, owner: &str, until: i64) -> Result<(), StoreError> {
        let q = "INSERT INTO background_runs (id, body, owner, lease_until) VALUES ($1, $2, $3, $4)";
        on_pool!(self, |pool| {
            sqlx::query(q).bind(id).bind(body).bind(owner).bind(until).execute(pool).await?;
        });
        Ok(())
    }

    /// Renew every claim `owner` holds; the ids among them whose cancel was asked.
    pub async fn renew_runs(&self, owner: &str, until: i64) -> Result<Vec<String>, StoreError> {
        let q = "UPDATE background_runs SET lease_until = $2 WHERE owner = $1 RETURNING id, cancel_asked";
        let rows: Vec<(String, bool)> =
            on_pool!(self, |pool| sqlx::query_as(q).bind(owner).bind(until).fetch_all(pool).await?);
        Ok(rows.into_iter().filter(|(_, asked)| *asked).map(|(id, _)| id).collect())
    }

    /// Take over the runs whose claim ran out before `now`: their ids, requests, and whether a cancel was asked
    /// (of a replica that died before it read it).
    pub async fn claim_orphan_runs(
        &self,
        owner: &str,
        now: i64,
        until: i64,
    ) -> Result<Vec<(String, String, bool)>, StoreError> {
        let q = "UPDATE background_runs SET owner = $1, lease_until = $3 WHERE lease_until < $2 \
                 RETURNING id, body, cancel_asked";
        Ok(on_pool!(self, |pool| sqlx::query_as(q).bind(owner).bind(now).bind(until).fetch_all(pool).await?))
    }

    /// Ask the replica running `id` to cancel it: whether its claim is still live (false: no run, or a dead one).
    pub async fn ask_cancel(&self, id: &str, now: i64) -> Result<bool, StoreError> {
        let q = "UPDATE background_runs SET cancel_asked = TRUE WHERE id = $1 AND lease_until >= $2";
        Ok(on_pool!(self, |pool| sqlx::query(q).bind(id).bind(now).execute(pool).await?.rows_affected()) > 0)
    }

    /// End a run whose claim ran out before `now` (its replica is dead); false if there is none, or if another
    /// replica took it over first (its claim is live again: ask that one).
    pub async fn end_dead_run(&self, id: &str, now: i64) -> Result<bool, StoreError> {
        let q = "DELETE FROM background_runs WHERE id = $1 AND lease_until < $2";
        Ok(on_pool!(self, |pool| sqlx::query(q).bind(id).bind(now).execute(pool).await?.rows_affected()) > 0)
    }

    /// The run is over (or was never to be run again); whether it was there.
    pub async fn end_run(&self, id: &str) -> Result<bool, StoreError> {
        let q = "DELETE FROM background_runs WHERE id = $1";
        Ok(on_pool!(self, |pool| sqlx::query(q).bind(id).execute(pool).await?.rows_affected()) > 0)
    }
}

//! The batch lane (OpenAI's Batch API): batches created through any replica are run by one at a time, claimed
//! in the store with a lease that the runner renews; a replica that dies lets another take its batches over
//! once their leases run out, and the results recorded per line make each `custom_id` appear once.
//!
//! - `object`: the Batch object, the input lines' checks, the output lines;
//! - `line`: one input line: the next not done yet, and its run in a batch line's slot;
//! - `run`: running one batch: its lines through the one request path in idle slots only (`Admission::
//!   try_admit_batch`), given up to any client's request that needs one;
//! - `traced`: a line's span, linked to the request that created the batch.

mod line;
pub mod object;
mod run;
mod traced;

use crate::http::AppState;
use crate::store::{Store, items};
use std::sync::Arc;
use std::time::Duration;

/// How long a claim on a batch holds without renewal (a running batch renews it every second).
pub const LEASE_S: i64 = 15;
/// How often the runner looks for batches to run when nobody rang (another replica's, or one left over).
const LOOK_EVERY: Duration = Duration::from_secs(2);

/// Ask a batch to stop: `cancelling` if it had not finished (its runner, on any replica, stops its lines and
/// writes what they made). The runner's own writes go only over the status they read, so one that moves the batch
/// meanwhile (validating to in_progress) makes this try again. The batch row's status and object after it; None if
/// there is no such batch.
pub async fn cancel(store: &Store, id: &str) -> Result<Option<(String, serde_json::Value)>, crate::store::StoreError> {
    loop {
        let Some(row) = store.db.get_batch(id).await? else { return Ok(None) };
        let mut batch: serde_json::Value = serde_json::from_str(&row.batch).unwrap_or_default();
        if !matches!(row.status.as_str(), "validating" | "in_progress" | "finalizing") {
            return Ok(Some((row.status, batch)));
        }
        object::set_status(&mut batch, "cancelling", items::now());
        if store.db.set_batch(id, &row.status, "cancelling", &batch.to_string(), None).await? {
            store.batch_bell.notify_one();
            return Ok(Some(("cancelling".into(), batch)));
        }
    }
}

/// Run batches from now on: this replica's own as they are created, and any left unfinished by a replica
/// (itself before a restart included) whose claim ran out.
pub fn start(st: Arc<AppState>, store: Arc<Store>) {
    let owner = crate::ids::random_id("runner");
    tokio::spawn(async move {
        let runner = run::Runner { st, store: store.clone(), owner };
        loop {
            let now = items::now();
            match store.db.claimable_batches(&runner.owner, now).await {
                Ok(ids) => {
                    for id in ids {
                        match store.db.claim_batch(&id, &runner.owner, items::now(), items::now() + LEASE_S).await {
                            Ok(true) => {
                                if let Err(e) = runner.run(&id).await {
                                    tracing::error!(batch_id = %id, "a batch stopped on a store error: {e}");
                                }
                            }
                            Ok(false) => {}
                            Err(e) => tracing::warn!("could not claim a batch: {e}"),
                        }
                    }
                }
                Err(e) => tracing::warn!("could not look for batches: {e}"),
            }
            let _ = tokio::time::timeout(LOOK_EVERY, store.batch_bell.notified()).await;
        }
    });
}

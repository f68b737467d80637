//! The batch lane (OpenAI's Batch API): batches created through any replica are run by one at a time, claimed
//! in the store with a lease that the runner renews; a replica that dies lets another take its batches over
//! once their leases run out, and the results recorded per line make each `custom_id` appear once.
//!
//! - `object`: the Batch object, the input lines' checks, the output lines;
//! - `run`: running one batch: its lines through the one request path in idle slots only (`Admission::
//!   try_admit_batch`), given up to any client's request that needs one.

pub mod object;
mod run;

use crate::http::AppState;
use crate::store::{Store, items};
use std::sync::Arc;
use std::time::Duration;

/// How long a claim on a batch holds without renewal (a running batch renews it every second).
pub const LEASE_S: i64 = 15;
/// How often the runner looks for batches to run when nobody rang (another replica's, or one left over).
const LOOK_EVERY: Duration = Duration::from_secs(2);

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

//! The batch lane (OpenAI's Batch API, and Anthropic's Message Batches over it): batches created through any
//! replica are run by one, claimed in the store with a lease (`--claim-lease`) that the runner renews; a replica
//! that dies lets another take its batches over once their leases run out, and the results recorded per line make
//! each `custom_id` appear once. A claim is fenced (issue 40): taking it adds one to its generation, and every
//! write its runner makes names the owner and generation in the same statement, so a runner that lost its claim
//! (paused, or cut off from the store, past its lease) has its writes refused and stops. A drain releases the
//! claims held here as it begins, so another replica takes the batches at its next look. A replica runs its batches side by side, sharing the lane's slots round-robin
//! (`lane`), and claims at most as many as it has slots, so it never holds batches it cannot run.
//!
//! - `input`: the input file's lines, each read only up to `--max-batch-line-bytes`;
//! - `object`: the Batch object (`Batch`), the input lines' checks, the output lines;
//! - `result`: the result lines it writes (OpenAI's), and a Message Batch's view of them (Anthropic's);
//! - `status`: a batch's status (`BatchStatus`) and the moves between them, each stamping its time;
//! - `finish`: a batch's end: its results files and final status;
//! - `lane`: the batch lane's slots, dealt round-robin to the batches running here;
//! - `line`: one input line: the next not done yet, and its run in a batch line's slot;
//! - `run`: running one batch: its lines through the one request path in idle slots only (`Admission::
//!   try_admit_batch`), given up to any client's request that needs one;
//! - `traced`: a line's span, linked to the request that created the batch.

mod finish;
pub mod input;
mod lane;
mod line;
pub mod object;
pub mod result;
mod run;
pub mod status;
mod traced;

use crate::path::AppState;
use crate::store::{Store, items};
use object::{Batch, BatchStatus};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often the runner looks for batches to run when nobody rang (another replica's, or one left over).
const LOOK_EVERY: Duration = Duration::from_secs(2);

/// Ask a batch to stop: `cancelling` if it had not finished (its runner, on any replica, stops its lines and
/// writes what they made). This write goes only over the status and object it read, so a runner's write meanwhile
/// (validating to in_progress, or its counts) makes this try again. The batch after it (its status the row's); None
/// if there is no such batch.
pub async fn cancel(store: &Store, id: &str) -> Result<Option<Batch>, crate::store::StoreError> {
    loop {
        let Some(row) = store.db.get_batch(id).await? else { return Ok(None) };
        let read = row.load()?;
        let mut batch = read.clone();
        // Only a batch running moves to `cancelling`: one ended, or cancelling already, is answered as it is.
        if batch.set_status(BatchStatus::Cancelling, items::now()).is_err() {
            return Ok(Some(read));
        }
        // No claim named: any replica may ask. Only over the object as read, so a runner's counts are never put back.
        if store.db.cancel_batch(id, read.status.as_str(), &row.batch, &batch.to_text()).await? {
            store.batch_bell.notify_one();
            return Ok(Some(batch));
        }
    }
}

/// Run batches from now on: this replica's own as they are created, and any left unfinished by a replica
/// (itself before a restart included) whose claim ran out. At most as many at once as the lane has slots: a batch
/// beyond that would hold a claim, and keep another replica from running it, without a slot of its own.
pub fn start(st: Arc<AppState>, store: Arc<Store>) {
    let lane = Arc::new(lane::Lane::default());
    tokio::spawn(lane.clone().deal_forever(st.clone()));
    let most = st.admission.capacity().max(1);
    let runner = Arc::new(run::Runner { st, store: store.clone(), owner: crate::ids::random_id("runner"), lane });
    let running: Arc<Mutex<HashSet<String>>> = Arc::default();
    tokio::spawn(async move {
        loop {
            let room = most.saturating_sub(running.lock().unwrap().len());
            // Once the drain began this replica takes nothing: what it held is being released for the others.
            if room > 0 && !store.hand_over.has_begun() {
                claim(&runner, &store, &running, room).await;
            }
            let _ = tokio::time::timeout(LOOK_EVERY, store.batch_bell.notified()).await;
        }
    });
}

/// Claim up to `room` batches not running here, oldest first, and run each in a task of its own.
async fn claim(runner: &Arc<run::Runner>, store: &Arc<Store>, running: &Arc<Mutex<HashSet<String>>>, room: usize) {
    // Those running here are claimable by this runner too: ask for enough to see `room` others past them.
    let ask = (room + running.lock().unwrap().len()) as i64;
    let ids = match store.db.claimable_batches(&runner.owner, items::now(), ask).await {
        Ok(ids) => ids,
        Err(e) => return tracing::warn!("could not look for batches: {e}"),
    };
    let mut room = room;
    for id in ids {
        if room == 0 {
            break;
        }
        if running.lock().unwrap().contains(&id) {
            continue;
        }
        let taken = Instant::now(); // before the claim is asked: its lease counts from no later than this
        match store.db.claim_batch(&id, &runner.owner, items::now(), items::now() + store.lease_s).await {
            Ok(Some(generation)) => {
                room -= 1;
                tracing::info!(batch_id = %id, generation, "took the claim on a batch");
                running.lock().unwrap().insert(id.clone());
                let (runner, running, store) = (runner.clone(), running.clone(), store.clone());
                tokio::spawn(async move {
                    if let Err(e) = runner.run(&id, generation, taken).await {
                        tracing::error!(batch_id = %id, "a batch stopped on a store error: {e}");
                    }
                    running.lock().unwrap().remove(&id);
                    store.batch_bell.notify_one(); // its room goes to the next batch at once
                });
            }
            Ok(None) => {}
            Err(e) => tracing::warn!("could not claim a batch: {e}"),
        }
    }
}

//! Background responses across replicas and restarts. The replica that runs one holds a claim on it in the store
//! (this replica's name and a generation, `store::background::Claim`), renewed every few seconds with the request
//! kept beside it:
//! - a replica that dies (or restarts) lets its claims run out; the first replica to see that takes the claim
//!   under the next generation and runs the request again from the start, so a background response that was
//!   accepted finishes even if its replica does not. A replica that was only paused finds, at its next renewal,
//!   that its claim is no longer among those it holds: it stops the run and writes nothing (its writes name the
//!   old generation, and are refused anyway);
//! - a cancel asked through a replica that does not run it is written to the claim; the replica that runs it
//!   reads it as it renews and cancels there. A run whose claim lapsed is cancelled by the asker itself, and one
//!   whose replica died after the cancel was asked is recorded as cancelled by whoever takes it over, never run
//!   again. A DELETE of its Response shows as it renews: the run stops there;
//! - a drain hands the runs over (`store::hand_over`): those waiting for a slot as it begins, those still running
//!   shortly before its end; their claims are released, and another replica takes them at its next look. A
//!   draining replica takes over no run.

use super::Background;
use super::run::{cancel_here, hand_over, run_in_background, stop};
use super::runs::Stage;
use crate::doors::Door;
use crate::error::ApiError;
use crate::path::AppState;
use crate::store::background::{Claim, is_running};
use crate::store::hand_over::Phase;
use crate::store::{Store, failed, items};
use bytes::Bytes;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often this replica renews its claims, reads the cancels asked of it, and looks for runs left behind.
const RENEW_EVERY: Duration = Duration::from_secs(2);

/// Keep this replica's claims, take over those that ran out, and hand them over as a drain goes, from now on.
pub fn start(st: Arc<AppState>, bg: Arc<Background>) {
    tokio::spawn(hand_over_on_drain(bg.clone()));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(RENEW_EVERY);
        loop {
            tick.tick().await;
            renew(&bg).await;
            // A draining replica takes nothing over: what it would run, another will.
            if !bg.store.hand_over.has_begun() {
                take_over(&st, &bg).await;
            }
        }
    });
}

/// Renew the claims held here; stop the runs whose claim was lost or whose Response was deleted, cancel those
/// asked to, and release a claim held with no run here (its run ended without writing its end).
async fn renew(bg: &Background) {
    let store = &bg.store;
    // Runs whose claim was in the store before the renewal: each must be among those renewed.
    let mine = bg.runs.claimed();
    let now = items::now();
    let renewed = match store.db.renew_runs(&store.instance, now + store.lease_s).await {
        Ok(renewed) => renewed,
        Err(e) => return tracing::warn!("could not renew background responses' claims: {e}"),
    };
    let held: HashSet<&str> = renewed.iter().map(|r| r.id.as_str()).collect();
    for run in mine.iter().filter(|r| !held.contains(r.id.as_str())) {
        stop(bg, run, false).await;
    }
    for r in &renewed {
        let here = bg.runs.get(&r.id).filter(|run| run.generation == r.claim_gen && !run.finished());
        match here {
            Some(run) if r.deleted => stop(bg, &run, true).await,
            Some(run) if r.cancel_asked => {
                cancel_here(bg, &run).await;
            }
            Some(_) => {}
            None if mine.iter().any(|run| run.id == r.id) => {} // it ended as the claims were renewed
            None if bg.runs.get(&r.id).is_some_and(|run| !run.finished()) => {} // claimed as they were renewed
            None => {
                if let Err(e) = store.db.release_run(&r.id, &store.instance, r.claim_gen).await {
                    tracing::warn!(response_id = %r.id, "could not release a background response's claim: {e}");
                }
            }
        }
    }
}

/// Take over the runs whose claims ran out (or were released by a drain).
async fn take_over(st: &Arc<AppState>, bg: &Arc<Background>) {
    let store = &bg.store;
    let now = items::now();
    let runs = match store.db.claim_orphan_runs(&store.instance, now, now + store.lease_s).await {
        Ok(runs) => runs,
        Err(e) => return tracing::warn!("could not look for background responses left behind: {e}"),
    };
    for run in runs {
        let claim = Claim::Held { owner: &store.instance, generation: run.claim_gen };
        if run.cancel_asked {
            if let Err(e) = end_cancelled(store, &run.id, claim).await {
                tracing::warn!(response_id = %run.id, "could not record a cancelled background response: {e}");
            }
        } else {
            resume(st, bg, run.id, run.body, run.claim_gen).await;
        }
    }
}

/// Hand the runs held here over as the drain goes: at `Phase::Draining` those still waiting for a slot, at
/// `Phase::Cut` all that still run. (A run refused a slot because of the drain hands itself over.)
async fn hand_over_on_drain(bg: Arc<Background>) {
    let store = &bg.store;
    let mut phase = store.hand_over.phase();
    while phase.changed().await.is_ok() {
        let now = *phase.borrow_and_update();
        if now == Phase::Serving {
            continue;
        }
        let _writing = store.hand_over.handing(); // the drain waits for these releases
        for run in bg.runs.claimed() {
            if (now == Phase::Cut || run.stage() == Stage::Waiting) && run.stop() {
                hand_over(&bg, &run).await;
            }
        }
    }
}

/// Run again a background response whose replica stopped (or handed it over), unless it ended after all.
async fn resume(st: &Arc<AppState>, bg: &Arc<Background>, id: String, body: String, generation: i64) {
    let store = &bg.store;
    let claim = Claim::Held { owner: &store.instance, generation };
    let (running, owner) = match store.load_any(&id).await {
        Ok(Some(row)) => (is_running(&row.response), crate::owner::Owner::from_stored(&row.owned_by)),
        Ok(None) => (false, Default::default()), // deleted meanwhile
        Err(_) => return,                        // the claim runs out again; whoever holds it then tries again
    };
    if !running {
        let _ = store.db.end_run(&id, claim, None).await;
        return;
    }
    // Full here: released at once for another replica. Its owner is not known here: it counts in all only.
    let Ok(run) = bg.runs.start(&id, None, generation) else {
        let _ = store.db.release_run(&id, &store.instance, generation).await;
        return;
    };
    run.set_claimed();
    let request_id = crate::ids::random_id("req");
    tracing::info!(response_id = %id, request_id = %request_id, generation,
        "running again a background response whose replica stopped");
    let task = tokio::spawn(run_in_background(
        st.clone(),
        bg.clone(),
        Door::Responses,
        Bytes::from(body),
        owner,
        Instant::now(),
        request_id,
        run.clone(),
        None, // its creator's span is gone with its replica
    ));
    run.set_task(task.abort_handle());
}

/// Cancel a background response that does not run here: asked of the replica that runs it (answered once that
/// replica has recorded it, or as it stands after a while), or done here if its claim lapsed (its replica is
/// dead, or a drain released it). None: it runs nowhere.
pub async fn cancel_elsewhere(store: &Store, id: &str) -> Result<Option<String>, ApiError> {
    // Twice: a lapsed run that another takes over between the two queries below is asked of that one.
    for _ in 0..2 {
        let now = items::now();
        if store.db.ask_cancel(id, now).await.map_err(failed)? {
            let deadline = Instant::now() + 3 * RENEW_EVERY;
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let row = store.db.get_response(id).await.map_err(failed)?;
                let Some(row) = row else { return Ok(None) };
                if !is_running(&row.response) || Instant::now() > deadline {
                    return Ok(Some(row.response));
                }
            }
        }
        if let Some(cancelled) = end_cancelled(store, id, Claim::Lapsed { now }).await? {
            // Its replica is gone and nobody took it over yet: it ends here, as cancelled.
            return Ok(Some(cancelled.to_string()));
        }
    }
    Ok(None)
}

/// End as cancelled a background response that runs nowhere, under `claim` (taken over here, or lapsed): the
/// Response, or None if there was no such claim (or the Response was deleted meanwhile).
async fn end_cancelled(store: &Store, id: &str, claim: Claim<'_>) -> Result<Option<Value>, ApiError> {
    let Some(row) = store.db.get_response(id).await.map_err(failed)? else {
        store.db.end_run(id, claim, None).await.map_err(failed)?;
        return Ok(None);
    };
    let mut response: Value = serde_json::from_str(&row.response).map_err(|_| ApiError::Internal)?;
    let running = is_running(&row.response);
    if running {
        response["status"] = json!("cancelled");
    }
    let text = response.to_string();
    if !store.db.end_run(id, claim, running.then_some(text.as_str())).await.map_err(failed)? {
        return Ok(None);
    }
    if running {
        tracing::info!(response_id = %id, "a background response whose replica stopped was cancelled");
    }
    Ok(Some(response))
}

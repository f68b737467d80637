//! Background responses across replicas and restarts. The replica that runs one holds a claim on it in the store,
//! renewed every few seconds with the request kept beside it:
//! - a replica that dies (or restarts) lets its claims run out; the first replica to see that runs the request
//!   again from the start, so a background response that was accepted finishes even if its replica does not;
//! - a cancel asked through a replica that does not run it is written to the claim; the replica that runs it
//!   reads it as it renews and cancels there. A run whose replica is dead is cancelled by the asker itself, and
//!   one whose replica died after the cancel was asked is recorded as cancelled by whoever takes it over, never
//!   run again.

use super::AppState;
use super::background::{cancel, run_in_background};
use crate::doors::Door;
use crate::error::ApiError;
use crate::store::{Store, failed, items};
use axum::Json;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a claim holds without renewal.
pub const LEASE_S: i64 = 15;
/// How often this replica renews its claims, reads the cancels asked of it, and looks for runs left behind.
const RENEW_EVERY: Duration = Duration::from_secs(2);

/// Keep this replica's claims, and take over those that ran out, from now on.
pub fn start(st: Arc<AppState>, store: Arc<Store>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(RENEW_EVERY);
        loop {
            tick.tick().await;
            let now = items::now();
            match store.db.renew_runs(&store.instance, now + LEASE_S).await {
                Ok(asked) => {
                    for id in asked {
                        if let Err(e) = cancel(&store, &id).await {
                            tracing::warn!(response_id = %id, "could not cancel a background response: {e}");
                        }
                    }
                }
                Err(e) => tracing::warn!("could not renew background responses' claims: {e}"),
            }
            match store.db.claim_orphan_runs(&store.instance, now, now + LEASE_S).await {
                Ok(runs) => {
                    for (id, body, cancel_asked) in runs {
                        if cancel_asked {
                            let _ = store.db.end_run(&id).await;
                            if let Err(e) = end_cancelled(&store, &id).await {
                                tracing::warn!(response_id = %id, "could not record a cancelled background response: {e}");
                            }
                        } else {
                            resume(&st, &store, id, body).await;
                        }
                    }
                }
                Err(e) => tracing::warn!("could not look for background responses left behind: {e}"),
            }
        }
    });
}

/// Run again a background response whose replica stopped, unless it ended after all.
async fn resume(st: &Arc<AppState>, store: &Arc<Store>, id: String, body: String) {
    let (running, owner) = match store.load_any(&id).await {
        Ok(Some(row)) => (is_running(&row.response), crate::owner::Owner::from_stored(&row.owned_by)),
        Ok(None) => (false, Default::default()), // deleted meanwhile
        Err(_) => return,                        // the claim runs out again; whoever holds it then tries again
    };
    if !running {
        let _ = store.db.end_run(&id).await;
        return;
    }
    // Full here: the claim runs out, another may take it. Its owner is not known here: it counts in all only.
    let Ok(run) = store.runs.start(&id, None) else { return };
    let request_id = crate::ids::random_id("req");
    tracing::info!(response_id = %id, request_id = %request_id,
        "running again a background response whose replica stopped");
    let task = tokio::spawn(run_in_background(
        st.clone(),
        store.clone(),
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
/// replica has recorded it, or as it stands after a while), or done here if its replica is dead. None: it runs
/// nowhere.
pub async fn cancel_elsewhere(store: &Store, id: &str) -> Result<Option<Response>, ApiError> {
    // Twice: a dead replica's run that another takes over between the two queries below is asked of that one.
    for _ in 0..2 {
        let now = items::now();
        if store.db.ask_cancel(id, now).await.map_err(failed)? {
            let deadline = Instant::now() + 3 * RENEW_EVERY;
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let row = store.db.get_response(id).await.map_err(failed)?;
                let Some(row) = row else { return Ok(None) };
                if !is_running(&row.response) || Instant::now() > deadline {
                    let json = [(axum::http::header::CONTENT_TYPE, "application/json")];
                    return Ok(Some((json, row.response).into_response()));
                }
            }
        }
        if store.db.end_dead_run(id, now).await.map_err(failed)? {
            // Its replica is gone and nobody took it over yet: it ends here, as cancelled.
            return Ok(end_cancelled(store, id).await?.map(|r| Json(r).into_response()));
        }
    }
    Ok(None)
}

/// Record as cancelled a background response whose run ended without its replica (its claim already removed):
/// the Response, or None if it was deleted meanwhile.
async fn end_cancelled(store: &Store, id: &str) -> Result<Option<Value>, ApiError> {
    let Some(mut row) = store.db.get_response(id).await.map_err(failed)? else { return Ok(None) };
    let mut response: Value = serde_json::from_str(&row.response).map_err(|_| ApiError::Internal)?;
    if is_running(&row.response) {
        response["status"] = json!("cancelled");
        row.response = response.to_string();
        store.db.put_responses(None, &[&row]).await.map_err(failed)?;
        tracing::info!(response_id = %id, "a background response whose replica stopped was cancelled");
    }
    Ok(Some(response))
}

/// Whether a stored Response has yet to end (its own `status`, not a `status` its metadata may hold).
fn is_running(response: &str) -> bool {
    let status = serde_json::from_str::<Value>(response).ok().and_then(|r| r.get("status").cloned());
    matches!(status.as_ref().and_then(Value::as_str), Some("queued" | "in_progress"))
}

//! A background response's run: queued and answered at once, then run through the request path as a stream whose
//! events it keeps; its writes, its end, its cancel and its hand-over.

use super::Background;
use super::lease::cancel_elsewhere;
use super::queued::queued_response;
use super::runs::Run;
use crate::doors::{Door, GenerateRequest};
use crate::error::ApiError;
use crate::path::{Answer, AppState, BackgroundRun, Call, Origin, Unary, serve};
use crate::store::background::is_running;
use crate::store::responses::{Keep, response_text};
use crate::store::{Store, StoredResponse, failed, items};
use crate::stream::Deliver;
use crate::trace::body::TracedStream;
use crate::trace::{Outcome, RequestTrace, ResponseGuard, StopCause, Traced};
use bytes::Bytes;
use futures_util::StreamExt;
use opentelemetry::KeyValue;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a background response at a full server asks again for a slot: it waits, it is not refused after it
/// was accepted.
const RETRY: Duration = Duration::from_millis(500);

pub async fn start(
    background: Option<&Arc<Background>>,
    st: &Arc<AppState>,
    door: Door,
    req: GenerateRequest,
    arrival: Instant,
    request_id: String,
    traced: Traced,
) -> Result<Answer, ApiError> {
    let Some(bg) = background else {
        let msg = "This server keeps no responses (its state store is off): background responses need it.";
        return Err(ApiError::bad_param("background", msg));
    };
    let store = &bg.store;
    // Room for what it will store, and what it names must be there now: a 4xx at once, not a failed response later.
    store.room_for(&req.owner).await?;
    let asked = req.keeping.clone().unwrap_or_default();
    if let Some(prev) = &asked.previous_response_id
        && store.load(prev, &req.owner).await?.is_none()
    {
        return Err(ApiError::PreviousResponseNotFound(prev.clone()));
    }
    if let Some(conv) = &asked.conversation {
        store.conversation(conv, &req.owner).await.map_err(|_| ApiError::NotFound {
            what: "Conversation",
            id: conv.clone(),
            param: Some("conversation"),
        })?;
    }
    let response_id = format!("{}{:016x}", door.id_prefix(), crate::ids::random_u64());
    // A place in the background lane, or its own 429 (`runs`).
    let run = bg.runs.start(&response_id, Some(&req.owner), 0)?;
    let mut body: Value = serde_json::from_slice(&req.body).map_err(|_| ApiError::Internal)?;
    let queued = queued_response(&body, &response_id);
    let row = StoredResponse {
        id: response_id.clone(),
        created_at: items::now(),
        model: req.model.clone(),
        previous_response_id: asked.previous_response_id,
        context: crate::store::CHAINED.into(),
        input_items: Value::Array(items::own_items(body.get("input"))).to_string(),
        response: queued.to_string(),
        owned_by: req.owner.as_str().to_string(),
    };
    body["stream"] = json!(true);
    let body = Bytes::from(serde_json::to_vec(&body).map_err(|_| ApiError::Internal)?);
    // In the store before the client has its id (`GET` answers from any replica), claimed with its request kept
    // (if this replica dies, another runs it: `super::lease`), both in one commit.
    let until = items::now() + store.lease_s;
    let kept = std::str::from_utf8(&body).map_err(|_| ApiError::Internal)?;
    if let Err(e) = store.db.queue_run(&row, kept, &store.instance, until).await {
        bg.runs.forget(&response_id);
        return Err(failed(e));
    }
    run.set_claimed();
    let (guard, run_trace) = traces(st, traced, &req, &response_id, arrival, door, &request_id);
    let (owner, ran) = (req.owner.clone(), run.clone());
    let task =
        tokio::spawn(run_in_background(st.clone(), bg.clone(), door, body, owner, arrival, request_id, ran, run_trace));
    run.set_task(task.abort_handle());
    if req.stream {
        let events = run.follow(None).map(|chunk| chunk.map_err(|never| match never {}));
        return Ok(Answer::Stream(match guard {
            Some(guard) => Box::pin(TracedStream::new(events, guard)),
            None => Box::pin(events),
        }));
    }
    let json = Bytes::from(serde_json::to_vec(&queued).map_err(|_| ApiError::Internal)?);
    Ok(Answer::Unary(Unary { json, guard }))
}

/// The `POST`'s span, ended as it answers (its guard goes with its body), and the run's trace, linked to it.
fn traces(
    st: &AppState,
    traced: Traced,
    req: &GenerateRequest,
    response_id: &str,
    arrival: Instant,
    door: Door,
    request_id: &str,
) -> (Option<ResponseGuard>, Option<Arc<RequestTrace>>) {
    let Some((post, guard)) = traced else { return (None, None) };
    let background = || vec![KeyValue::new("deepinfer.background", true)];
    post.requested(&req.model, response_id);
    background().into_iter().for_each(|kv| post.attribute(kv));
    post.ended(Outcome::of(200, ""));
    let run = st.traces.as_ref().map(|traces| {
        let run = traces.begin_linked(Some(post.span_context()), arrival, door.operation(), request_id, background());
        run.requested(&req.model, response_id); // named even if it is cancelled before it reaches a rank
        run
    });
    (Some(guard), run)
}

#[allow(clippy::too_many_arguments)]
pub(super) async fn run_in_background(
    st: Arc<AppState>,
    bg: Arc<Background>,
    door: Door,
    body: Bytes,
    owner: crate::owner::Owner,
    arrival: Instant,
    request_id: String,
    run: Arc<Run>,
    trace: Option<Arc<RequestTrace>>,
) {
    // Dropped last: a run cancelled before it reached a rank still ends its trace.
    let mut unfinished = StopCause::end_if_dropped(trace.clone(), "cancelled");
    let outcome = loop {
        let traced = trace.as_ref().map(|t| (t.clone(), ResponseGuard::new(t.clone())));
        let served = match door.parse(&body, (&st.config).into()) {
            Ok(mut req) => {
                req.owner = owner.clone();
                let origin = Origin::Background(run.clone());
                let request_id = request_id.clone();
                serve(&st, Call { door, req, origin, arrival, request_id, traced }).await
            }
            Err(e) => Err(e),
        };
        match served {
            Err(ApiError::Overloaded(_) | ApiError::QueueFull(_) | ApiError::QueueTimeout(_)) => {
                tokio::time::sleep(RETRY).await
            }
            other => break other,
        }
    };
    match outcome {
        Ok(Answer::Stream(mut data)) if run.generating() => {
            // Dropped before `data` (the request's body, whose drop aborts it): a cancel names itself first.
            let mut cancel = StopCause::new(trace.clone(), "cancelled");
            let mut announced = false;
            while let Some(Ok(chunk)) = data.next().await {
                run.push(&chunk);
                if !announced && let Some(latest) = run.latest() {
                    announced = true;
                    if !mark_running(&bg.store, &run, &latest).await && run.give_up() {
                        // Its claim is gone (taken over, or its Response deleted): it stops, and writes nothing.
                        tracing::info!(response_id = %run.id, "a background response's claim was lost: stopped here");
                        break;
                    }
                }
            }
            cancel.disarm();
            drop(data);
            if run.begin_end() {
                // Its stream ended without a final state (cut on its way): that is its end.
                let error = json!({"code": "server_error", "message": "The response ended before it finished."});
                end_as(&bg.store, &run, "failed", Some(error)).await;
            }
        }
        Ok(_) => {} // stopped as it reached a rank: its stopper ended it
        Err(_) if bg.store.hand_over.has_begun() && run.give_up() => {
            // Refused because this replica drains: handed over to another, not failed.
            hand_over(&bg, &run).await;
        }
        Err(e) => {
            run.release(); // before it reads as failed
            if let Some(t) = &trace {
                t.ended(Outcome::of(e.status().as_u16(), e.code()));
            }
            tracing::info!(target: "deepinfer_server::request", request_id = %request_id, response_id = %run.id,
                status = e.status().as_u16(), reason = e.code(), "background response failed: {e}");
            if run.begin_end() {
                let error = json!({"code": e.code(), "message": e.to_string()});
                end_as(&bg.store, &run, "failed", Some(error)).await;
            }
        }
    }
    unfinished.disarm();
    ended(&bg, &run);
}

/// Write the Response as it runs (`in_progress`), so any replica reads it so; false if the run's claim is gone.
async fn mark_running(store: &Store, run: &Run, latest: &[u8]) -> bool {
    let Ok(mut response) = serde_json::from_slice::<Value>(latest) else { return true };
    response["status"] = json!("in_progress");
    match store.db.put_running(&run.id, &store.instance, run.generation, &response.to_string()).await {
        Ok(held) => held,
        Err(e) => {
            tracing::warn!(response_id = %run.id, "could not record a background response as in progress: {e}");
            true // the store is down, not the claim: its final write says
        }
    }
}

impl BackgroundRun for Run {
    fn id(&self) -> &str {
        &self.id
    }

    fn release(&self) {
        Run::release(self);
    }

    fn record(self: Arc<Self>, store: &Arc<Store>, keep: Keep, last: Bytes, deliver: Deliver) {
        record_then(store, self, keep, last, deliver);
    }
}

/// The run has ended here (its final state written, or not its to write): its events kept for replay, and a
/// chain waiting on it told (`Store::until_ended`).
fn ended(bg: &Background, run: &Run) {
    bg.runs.ended(run);
    bg.store.run_ended.notify_waiters();
}

/// A background run's request has finished (called where it finishes, on its rank's thread): its final Response
/// from `last`, written under its claim if it still holds it, then `deliver`ed (the stream's readers see its end
/// once it is stored; an error instead if the store could not take it: the claim, kept, is released once the run
/// has ended here, and the run runs again). A run stopped meanwhile writes nothing: its stopper ended it.
fn record_then(store: &Arc<Store>, run: Arc<Run>, mut keep: Keep, last: Bytes, deliver: Deliver) {
    let Some(response) = response_text(&last, true).map(<[u8]>::to_vec) else {
        // Its run records it as failed once its stream ends.
        tracing::warn!(response_id = %run.id, "a background response's last bytes held no Response");
        return deliver(Ok(last));
    };
    if !run.begin_end() {
        return deliver(Ok(last));
    }
    let held = store.clone();
    store.spawn(async move {
        let store = held;
        let text = String::from_utf8_lossy(&response);
        match end_with(&store, &run, Some(&text)).await {
            Ok(true) => {}
            Ok(false) => return deliver(Ok(last)), // another ended it: what the store holds is its end
            Err(e) => return deliver(Err(failed(e))),
        }
        store.retention.grew(&keep.owner, text.len());
        if keep.conversation.is_some() {
            // Its conversation gains its input and output, as any response's does (the Response row is written).
            keep.store = false;
            store.record_then(run.id.clone(), keep, last, true, deliver);
        } else {
            deliver(Ok(last));
        }
    });
}

/// End the run in the store under its claim, with its final Response (None: none, as for a deleted one); whether
/// this ended it. A store that fails is asked again a few times: a final state is not given up lightly.
async fn end_with(store: &Store, run: &Run, response: Option<&str>) -> Result<bool, crate::store::StoreError> {
    let mut attempt = 0;
    loop {
        match store.db.end_run(&run.id, run.claim(&store.instance), response).await {
            Ok(ended) => {
                if !ended {
                    tracing::info!(response_id = %run.id, "a background response's claim was lost: its end not written");
                }
                return Ok(ended);
            }
            Err(e) if attempt >= 4 => return Err(e),
            Err(e) => tracing::warn!(response_id = %run.id, attempt, "could not end a background response: {e}"),
        }
        attempt += 1;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Give the run's claim up for another replica (a drain): it is not failed, and runs again there from its start.
pub(super) async fn hand_over(bg: &Background, run: &Run) {
    let store = &bg.store;
    let _writing = store.hand_over.handing();
    run.release();
    match store.db.release_run(&run.id, &store.instance, run.generation).await {
        Ok(_) => tracing::info!(response_id = %run.id, "a background response was handed over by the drain"),
        Err(e) => tracing::warn!(response_id = %run.id, "could not hand over a background response: {e}"),
    }
    ended(bg, run);
}

/// `POST /v1/responses/{id}/cancel` for a background response: stopped if it runs here, recorded as cancelled;
/// one that already ended is answered as it is. One stopped here that runs elsewhere now (its claim was lost, or
/// handed over) is asked of that replica.
/// The answer is the Response's JSON.
pub async fn cancel(bg: &Background, id: &str) -> Result<Option<String>, ApiError> {
    let store = &bg.store;
    let Some(run) = bg.runs.get(id) else { return cancel_elsewhere(store, id).await };
    if let Some(cancelled) = cancel_here(bg, &run).await {
        return Ok(Some(cancelled.to_string()));
    }
    run.wait_finished(crate::store::WRITE_WAIT).await; // its final state is being written
    let stored = store.load_any(id).await?.ok_or(ApiError::Internal)?;
    if run.is_stopped() && is_running(&stored.response) {
        return cancel_elsewhere(store, id).await;
    }
    Ok(Some(stored.response))
}

/// Cancel a run here: the cancelled Response, or None if it had ended or was stopped already.
pub(super) async fn cancel_here(bg: &Background, run: &Run) -> Option<Value> {
    if !run.stop() {
        return None;
    }
    run.release(); // before it reads as cancelled
    let cancelled = end_as(&bg.store, run, "cancelled", None).await;
    ended(bg, run);
    Some(cancelled)
}

/// Stop a run here from outside (its claim lost, its Response deleted): nothing more is written for it, but for
/// a deleted one's claim, removed.
pub(super) async fn stop(bg: &Background, run: &Run, deleted: bool) {
    if !run.stop() {
        return;
    }
    run.release();
    if deleted {
        let _ = end_with(&bg.store, run, None).await; // else its claim lapses, and whoever takes it finds it deleted
        tracing::info!(response_id = %run.id, "a background response was deleted: stopped");
    } else {
        tracing::info!(response_id = %run.id, "a background response's claim was lost: stopped here");
    }
    ended(bg, run);
}

/// Record the Response as it stands with `status` (and its error), under the run's claim, and tell readers of its
/// stream. The caller made sure it may end it (`Run::begin_end`, or `Run::stop`).
async fn end_as(store: &Store, run: &Run, status: &str, error: Option<Value>) -> Value {
    let stored = store.load_any(&run.id).await.ok().flatten();
    let mut response: Value = match run.latest() {
        Some(text) => serde_json::from_slice(&text).unwrap_or_default(),
        None => stored.as_ref().and_then(|r| serde_json::from_str(&r.response).ok()).unwrap_or_default(),
    };
    response["status"] = json!(status);
    if let Some(error) = error {
        response["error"] = error;
    }
    if !matches!(end_with(store, run, Some(&response.to_string())).await, Ok(true)) {
        // Another ended it first (or its claim is gone): what the store holds is its state.
        if let Some(row) = store.load_any(&run.id).await.ok().flatten() {
            response = serde_json::from_str(&row.response).unwrap_or(response);
        }
    }
    if status == "failed" {
        let event = json!({"type": "response.failed", "response": response, "sequence_number": 0});
        run.push(format!("event: response.failed\ndata: {event}\n\n").as_bytes());
    }
    response
}

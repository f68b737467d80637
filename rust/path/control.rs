//! What the control routes do to the request path (`http::control` parses and answers): abort requests by their
//! request id, pause and resume generation. The same for every door: a request is known by its request id
//! (`Call::request_id`: the `X-Request-Id`, or `/generate`'s `rid`) wherever it is on the path.
//!
//! Only clients' requests are aborted here, `abort_all` included: a batch line or a background run is cancelled
//! through its own route (`/v1/batches/{id}/cancel`, `/v1/responses/{id}/cancel`), which records why it ended;
//! ended here, it would be recorded as a finished answer cut short.

use super::AppState;
use std::time::Duration;

/// How a pause treats the requests already running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    /// End them now, finish reason `abort` (SGLang's `abort`, vLLM's `abort`).
    Abort,
    /// Keep them, frozen with their KV, until the resume (SGLang's `in_place` and `retract`, vLLM's `keep`).
    InPlace,
    /// Let them finish; the answer comes once they have (vLLM's `wait`).
    Wait,
}

/// How often a waiting pause looks at the requests in flight.
const DRAIN_POLL: Duration = Duration::from_millis(10);

/// End the clients' requests whose request id is `rid` (every one for None), on a rank or not yet: each ends at
/// once, finish reason `abort`, with what it has. How many there were.
pub fn abort(st: &AppState, rid: Option<&str>) -> usize {
    st.dispatcher.abort_requests(rid) + st.pending.abort(rid)
}

/// Stop admitting (new requests wait at the admission gate), then treat the running ones as `mode` says; how
/// many requests were running or waiting for a slot when it took effect.
pub async fn pause(st: &AppState, mode: PauseMode) -> usize {
    st.admission.pause();
    let held = st.admission.in_flight() + st.admission.queued();
    match mode {
        PauseMode::Abort => {
            abort(st, None);
        }
        PauseMode::InPlace => st.dispatcher.ranks.iter().for_each(|r| r.freeze(true)),
        PauseMode::Wait => {
            st.dispatcher.ranks.iter().for_each(|r| r.freeze(false)); // a paused in place before runs again
            while st.admission.in_flight() > 0 && st.admission.is_paused() {
                tokio::time::sleep(DRAIN_POLL).await;
            }
        }
    }
    held
}

/// Run the frozen requests again and admit the waiting ones; false (nothing done) while a weight reload runs: it
/// resumes once every rank is ready (`path::reload`), so no request reaches a rank in the middle.
pub fn resume(st: &AppState) -> bool {
    if st.weights.is_reloading() {
        return false;
    }
    resume_now(st);
    true
}

pub(super) fn resume_now(st: &AppState) {
    st.dispatcher.ranks.iter().for_each(|r| r.freeze(false));
    st.admission.resume();
}

pub fn is_paused(st: &AppState) -> bool {
    st.admission.is_paused()
}

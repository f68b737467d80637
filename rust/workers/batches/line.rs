//! One input line of a batch: reading the next one not done yet, and running it through the request path in a batch
//! line's slot.

use super::input::InputLines;
use super::object::{Line, parse_line};
use super::result::ResultLine;
use super::traced::LineTraces;
use crate::admission::Permit;
use crate::doors::{Body, Door};
use crate::error::ApiError;
use crate::json_bounds::JsonBounds;
use crate::owner::Owner;
use crate::path::{Answer, AppState, Call, Origin, serve};
use crate::trace::{Outcome, ResponseGuard, StopCause};
use bytes::Bytes;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// The next input line not done yet. A line past the bounds ends the input (the
/// batch was validated under them; a bound lowered since stops it there, never reading the line whole).
pub(super) async fn next_line(
    input: &mut InputLines<tokio::fs::File>,
    line_no: &mut i64,
    done: &HashSet<i64>,
    endpoint: &str,
    bounds: JsonBounds,
) -> Option<Line> {
    while let Ok(Some(text)) = input.next_line().await {
        *line_no += 1;
        if done.contains(line_no) {
            continue;
        }
        if let Ok((custom_id, body)) = parse_line(&text, endpoint, bounds) {
            return Some(Line { no: *line_no, custom_id, body });
        }
    }
    None
}

/// Run one line through the request path in its slot: (succeeded, its result line), or None if a client's
/// request took the slot first (the line runs again later, with a span of its own).
#[allow(clippy::too_many_arguments)]
pub(super) async fn run_line(
    st: &Arc<AppState>,
    door: Door,
    custom_id: &str,
    mut body: Value,
    whose: Owner,
    slot: Permit,
    mut stopped: oneshot::Receiver<()>,
    traces: Option<Arc<LineTraces>>,
) -> Option<(bool, String)> {
    body["stream"] = json!(false);
    let request_id = crate::ids::random_id("batch_req");
    let arrival = Instant::now();
    let trace = traces.and_then(|t| t.begin(st, door, custom_id, &request_id, arrival));
    let traced = trace.as_ref().map(|t| (t.clone(), ResponseGuard::new(t.clone())));
    let served = async {
        // The line was parsed as it was read: its body goes to the door as JSON, never back through bytes.
        let mut req = door.parse_body(Body::parsed(body), (&st.config).into())?;
        req.owner = whose;
        let (origin, request_id) = (Origin::BatchLine(slot), request_id.clone());
        serve(st, Call { door, req, origin, arrival, request_id, traced }).await
    };
    tokio::pin!(served);
    // Dropped before `served` (whose drop aborts the request): a line the runner stops (its batch cancelled or
    // expired, or its slot given up) says so in its span.
    let mut stop = StopCause::new(trace.clone(), "batch_stopped");
    let answered = tokio::select! {
        answered = &mut served => answered,
        // A closed channel is the slot's normal end, not a preemption: keep waiting for the answer then.
        Ok(()) = &mut stopped => {
            stop.cause = "batch_preempted";
            return None;
        }
    };
    stop.disarm(); // it ran to its end: it ends as its request did
    let (status, bytes) = match answered {
        Err(ApiError::Unavailable(_)) => return None, // draining, or a rank down: not the line's fault
        Ok(Answer::Unary(unary)) => (200, unary.delivered()),
        Ok(Answer::Stream(_)) => (500, Bytes::from(door.envelope(&ApiError::Internal))), // its body said no stream
        Err(e) => {
            if let Some(t) = &trace {
                t.ended(Outcome::of(e.status().as_u16(), e.code()));
            }
            (e.status().as_u16(), Bytes::from(door.envelope(&e)))
        }
    };
    let line = ResultLine::new(custom_id, &request_id, status, &bytes);
    Some((line.succeeded(), line.to_text()))
}

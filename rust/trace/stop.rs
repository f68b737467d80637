//! A request run by a task of the server's own, with no client (a background response's run, a batch line), can be
//! stopped by the server: a cancel, a batch line given up to a client's request, a batch cancelled or expired. The
//! task is dropped; the request path sees its consumer go and ends the request as a client disconnect. A guard,
//! held by the task, says what happened instead. A task that runs to its end disarms it: its request may end (its
//! log line) a moment after the task read the last of its answer, and must end as itself.

use super::record::{Outcome, RequestTrace};
use std::sync::Arc;

/// What a stopped task tells its trace as it drops.
pub struct StopCause {
    trace: Option<Arc<RequestTrace>>,
    pub cause: &'static str,
    /// End the trace (as `cause`, status 499) unless something ended it, rather than only name the cause.
    end: bool,
}

impl StopCause {
    /// Declared after the request's future, so that it drops first (a suspended task drops its locals in reverse
    /// order): the trace learns why it stops before the request's abort ends it.
    pub fn new(trace: Option<Arc<RequestTrace>>, cause: &'static str) -> Self {
        StopCause { trace, cause, end: false }
    }

    /// Declared before the request's future, so that it drops last: a task dropped before its request reached a
    /// rank (a background response cancelled while it waited for a slot) still ends its trace, as `cause` with
    /// status 499 (the client's own doing: not a server error).
    pub fn end_if_dropped(trace: Option<Arc<RequestTrace>>, cause: &'static str) -> Self {
        StopCause { trace, cause, end: true }
    }

    pub fn disarm(&mut self) {
        self.trace = None;
    }
}

impl Drop for StopCause {
    fn drop(&mut self) {
        match (&self.trace, self.end) {
            (Some(t), false) => t.stopped_by(self.cause),
            (Some(t), true) => t.end_unless_ended(Outcome::of(499, self.cause)),
            (None, _) => {}
        }
    }
}

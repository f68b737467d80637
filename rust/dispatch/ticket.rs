//! A request's claim on its rank, held by whoever waits for its answer (the handler, or its SSE body).

use super::rank::RankLink;
use crate::metrics::Metrics;
use std::sync::Arc;

/// A request's claim on its rank. Dropping it (client gone, handler finished) aborts the request on its rank if
/// it is still running there, which frees its admission slot.
pub struct Ticket {
    pub(super) link: Arc<RankLink>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) id: u64,
    /// Why the request stops if the ticket is dropped while it still runs.
    pub(super) abort_reason: &'static str,
}

impl Ticket {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn rank(&self) -> usize {
        self.link.index
    }

    /// End it now as `/abort_request` does (`RankLink::abort`): it was aborted while still on its way to its rank.
    pub fn abort_request(&self) {
        self.link.abort(self.id);
    }

    /// Abort now, counting it under `reason`.
    pub fn abort(mut self, reason: &'static str) {
        self.abort_reason = reason;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let link = &self.link;
        if let Some(entry) = link.take(self.id) {
            self.metrics.aborted.with_label_values(&[self.abort_reason]).inc();
            let status = if self.abort_reason == "timeout" { 504 } else { 499 };
            entry.log_end(status, self.abort_reason);
            if link.is_alive() {
                link.send_abort(self.id);
            }
        }
    }
}

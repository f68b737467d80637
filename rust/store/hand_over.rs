//! The drain's hand-over (issue 40): work this replica holds claims on (batches, background responses) is
//! released in the store during a SIGTERM's drain, so another replica (or this one restarted) takes it at once
//! instead of after a lease. Two moments:
//! - `Phase::Draining`, as the drain begins: batches are released, and so are background responses still waiting
//!   for a slot (neither has a client waiting on this replica);
//! - `Phase::Cut`, shortly before the drain's timeout: background responses still running are stopped and
//!   released (they were let run for as long as the drain allowed: most finish).
//!
//! Each holder watches the phase, releases what it holds, and keeps a `Handing` while it writes, which the drain
//! waits for (within its timeout) before the process exits.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, watch};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    #[default]
    Serving,
    Draining,
    Cut,
}

#[derive(Default)]
pub struct HandOver {
    phase: watch::Sender<Phase>,
    writing: Arc<Writing>,
}

#[derive(Default)]
struct Writing {
    n: AtomicUsize,
    idle: Notify,
}

/// A hand-over still writing its release: the drain waits until it is dropped.
pub struct Handing(Arc<Writing>);

impl Drop for Handing {
    fn drop(&mut self) {
        if self.0.n.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl HandOver {
    /// What a holder watches.
    pub fn phase(&self) -> watch::Receiver<Phase> {
        self.phase.subscribe()
    }

    /// Whether the drain has begun: work that stops now is released, not failed.
    pub fn has_begun(&self) -> bool {
        *self.phase.borrow() >= Phase::Draining
    }

    /// Kept while a release is being written.
    pub fn handing(&self) -> Handing {
        self.writing.n.fetch_add(1, Ordering::AcqRel);
        Handing(self.writing.clone())
    }

    /// Begin the drain's hand-over: from now on, what a holder stops is released, not failed or run here.
    pub fn begin(&self) {
        self.phase.send_replace(Phase::Draining);
    }

    /// The drain is about to end: release what still runs.
    pub fn cut(&self) {
        self.phase.send_replace(Phase::Cut);
    }

    /// Wait (at most `within`) for the releases the drain started; whether all were written. The holders are given
    /// a moment to start theirs before the count is read.
    pub async fn wait(&self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        tokio::time::sleep(Duration::from_millis(50).min(within)).await;
        loop {
            let idle = self.writing.idle.notified();
            if self.writing.n.load(Ordering::Acquire) == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_drain_waits_for_the_releases_being_written() {
        let h = Arc::new(HandOver::default());
        let mut phase = h.phase();
        let holder = {
            let h = h.clone();
            tokio::spawn(async move {
                phase.wait_for(|p| *p == Phase::Cut).await.unwrap();
                let _writing = h.handing();
                tokio::time::sleep(Duration::from_millis(200)).await;
            })
        };
        h.begin();
        assert!(!holder.is_finished());
        h.cut();
        assert!(h.wait(Duration::from_secs(5)).await);
        assert!(holder.is_finished());
        let _stuck = h.handing();
        assert!(!h.wait(Duration::from_millis(100)).await, "bounded by its time");
    }
}

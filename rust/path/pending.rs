//! Clients' requests not yet on a rank (waiting for a slot, or at the paused gate, or being converted), by their
//! request id, so that `/abort_request` finds them too. Once on its rank a request is found in its rank's map
//! (`Dispatcher::abort_requests`), the one place that says how it ends; this registry only signals the path.

use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

#[derive(Default)]
pub struct Pending {
    waiting: Mutex<FxHashMap<u64, (String, Arc<Signal>)>>,
    next: AtomicU64,
}

/// Fired once, by an abort.
#[derive(Default)]
pub struct Signal {
    fired: AtomicBool,
    notify: Notify,
}

/// A request's place in the registry, for as long as the path holds it.
pub struct Entered<'a> {
    pending: &'a Pending,
    key: u64,
    signal: Arc<Signal>,
}

impl Pending {
    pub fn enter(&self, request_id: &str) -> Entered<'_> {
        let key = self.next.fetch_add(1, Ordering::Relaxed);
        let signal = Arc::new(Signal::default());
        self.waiting.lock().unwrap().insert(key, (request_id.to_string(), signal.clone()));
        Entered { pending: self, key, signal }
    }

    /// Signal the requests with this id (all for None); how many.
    pub fn abort(&self, rid: Option<&str>) -> usize {
        let waiting = self.waiting.lock().unwrap();
        let mut n = 0;
        for (id, signal) in waiting.values().filter(|(id, _)| rid.is_none_or(|r| crate::ids::aborts(r, id))) {
            if !signal.fired.swap(true, Ordering::AcqRel) {
                tracing::debug!(request_id = %id, "aborted before its rank");
                signal.notify.notify_one(); // kept for a waiter that comes later
                n += 1;
            }
        }
        n
    }
}

impl Entered<'_> {
    pub fn is_aborted(&self) -> bool {
        self.signal.fired.load(Ordering::Acquire)
    }

    /// Resolves once the request is aborted.
    pub async fn aborted(&self) {
        self.signal.notify.notified().await
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.pending.waiting.lock().unwrap().remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_abort_finds_its_id_once_and_an_unknown_id_nothing() {
        let p = Pending::default();
        let (a, b) = (p.enter("a"), p.enter("b"));
        assert_eq!(p.abort(Some("zz")), 0);
        assert_eq!(p.abort(Some("a")), 1);
        assert_eq!(p.abort(Some("a")), 0, "fired once");
        a.aborted().await; // the signal waits for a waiter that comes after it
        assert!(a.is_aborted() && !b.is_aborted());
        assert_eq!(p.abort(None), 1);
        drop((a, b));
        assert!(p.waiting.lock().unwrap().is_empty());
    }
}

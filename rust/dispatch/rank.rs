//! One data-parallel rank as the server sees it: its two rings, and its `inflight` map, the single point of truth
//! of the requests on it. Whoever removes a request's entry (the rank_io thread on finish, a dropped ticket, a
//! timeout, a rank failure) decides how it ends, so it ends exactly once.

use super::inflight::Inflight;
use crate::metrics::RankView;
use crate::ring::records::{self, Abort};
use crate::ring::{Doorbell, Ring, Sender};
use crate::ttft::RankClock;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// One data-parallel rank as the server sees it.
pub struct RankLink {
    pub index: usize,
    pub requests: Sender,
    pub output: Arc<Ring>,
    /// Keyed by the dispatcher's own sequential ids (never client input), so a fast non-keyed hash is safe.
    pub(super) inflight: Mutex<FxHashMap<u64, Arc<Inflight>>>,
    pub(super) count: AtomicUsize,
    alive: AtomicBool,
    /// When the rank last went from no requests to some (`monotonic_ms`): a rank asleep on its doorbell stamps
    /// no heartbeat, so the watchdog measures a stall from the later of this and its last heartbeat.
    pub(super) busy_since_ms: AtomicU64,
    /// What the control routes ask of the rank's output thread (`crate::rank_io`), and its wake-up.
    hold: Mutex<Hold>,
    held: Condvar,
}

/// Paused in place, the output thread reads nothing more from the rank, which then stops stepping within the few
/// steps it may run ahead of the server (`engine/loop.py`, `publish`): its requests are frozen, their KV kept.
/// Aborted requests (`/abort_request`) are ended by that thread too, the one that touches their decoders.
#[derive(Default)]
struct Hold {
    frozen: bool,
    aborted: Vec<Arc<Inflight>>,
}

impl RankLink {
    /// `bell`: the rank group's doorbell when its ranks step together.
    pub fn new(index: usize, requests: Arc<Ring>, output: Arc<Ring>, bell: Option<Arc<Doorbell>>) -> Self {
        // Once a record is in the ring, wake the rank wherever it sleeps: waiting for us to drain its output, or
        // (ranks that step together) on the group's doorbell. Its own ring's futex wakes it when idle otherwise.
        let waiting_rank = output.clone();
        let on_push = Box::new(move || {
            waiting_rank.wake_producer();
            if let Some(bell) = &bell {
                bell.ring();
            }
        });
        RankLink {
            index,
            requests: Sender::new(requests, on_push),
            output,
            inflight: Mutex::new(FxHashMap::default()),
            count: AtomicUsize::new(0),
            alive: AtomicBool::new(true),
            busy_since_ms: AtomicU64::new(0),
            hold: Mutex::default(),
            held: Condvar::new(),
        }
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    pub fn in_flight(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// See `busy_since_ms`.
    pub fn busy_since_ms(&self) -> u64 {
        self.busy_since_ms.load(Ordering::Relaxed)
    }

    /// Keep the rank's times of first tokens (its TIMING records) with their requests.
    pub fn note_rank_stamps(&self, stamps: &[records::RankStamps]) {
        let clock = RankClock::now();
        let map = self.inflight.lock().unwrap();
        for s in stamps {
            if let Some(entry) = map.get(&s.request_id) {
                entry.stamps.rank(s, &clock);
            }
        }
    }

    /// Look up the requests of a batch under one lock.
    pub fn lookup(&self, ids: impl Iterator<Item = u64>) -> Vec<Option<Arc<Inflight>>> {
        let map = self.inflight.lock().unwrap();
        ids.map(|id| map.get(&id).cloned()).collect()
    }

    /// Remove a request and free its admission slot; `Some` means the caller now owns its ending.
    pub fn take(&self, id: u64) -> Option<Arc<Inflight>> {
        let got = self.inflight.lock().unwrap().remove(&id);
        if let Some(entry) = &got {
            self.count.fetch_sub(1, Ordering::Relaxed);
            entry.release_slot();
        }
        got
    }

    /// Tell the rank to stop generating for `id`.
    pub fn send_abort(&self, id: u64) {
        // Only fails once the ring is closed, i.e. the rank is gone: nothing left to abort.
        let _ = self.requests.send(records::ABORT, Abort { request_id: id }.encode().to_vec());
    }

    /// Freeze (or thaw) the rank's requests: see `Hold`.
    pub fn freeze(&self, frozen: bool) {
        self.hold.lock().unwrap().frozen = frozen;
        self.held.notify_all();
        self.output.wake_consumer();
    }

    pub fn is_frozen(&self) -> bool {
        self.hold.lock().unwrap().frozen
    }

    /// Take a request off this rank for `/abort_request`: its slot frees now, the rank stops it, and the output
    /// thread ends it with what it has (`take_aborted`). False if it had already ended.
    pub fn abort(&self, id: u64) -> bool {
        let Some(entry) = self.take(id) else { return false };
        if self.is_alive() {
            self.send_abort(id);
        }
        self.hold.lock().unwrap().aborted.push(entry);
        self.held.notify_all();
        self.output.wake_consumer();
        true
    }

    /// Whether the output thread has something to do besides reading the ring.
    pub fn has_work(&self) -> bool {
        let hold = self.hold.lock().unwrap();
        !hold.aborted.is_empty()
    }

    /// The aborted requests the output thread has yet to end.
    pub fn take_aborted(&self) -> Vec<Arc<Inflight>> {
        std::mem::take(&mut self.hold.lock().unwrap().aborted)
    }

    /// While frozen, wait (at most `timeout`) for a thaw or an abort.
    pub fn wait_frozen(&self, timeout: Duration) {
        let hold = self.hold.lock().unwrap();
        let _ = self.held.wait_timeout_while(hold, timeout, |h| h.frozen && h.aborted.is_empty());
    }

    /// The ids of the requests here that `matches` picks (by their client-facing id).
    pub fn find(&self, matches: impl Fn(&Inflight) -> bool) -> Vec<u64> {
        self.inflight.lock().unwrap().values().filter(|e| matches(e)).map(|e| e.id).collect()
    }

    /// No new requests go to a dead rank, and /health reports it.
    pub fn mark_dead(&self) {
        self.alive.store(false, Ordering::Release);
    }

    /// What a metrics scrape reads of this rank.
    pub fn view(&self) -> RankView<'_> {
        RankView {
            index: self.index,
            in_flight: self.in_flight(),
            requests: self.requests.ring(),
            output: &self.output,
        }
    }

    /// Take every request on this rank (rank failure, shutdown).
    pub fn take_all(&self) -> Vec<Arc<Inflight>> {
        let drained: Vec<_> = self.inflight.lock().unwrap().drain().map(|(_, v)| v).collect();
        self.count.fetch_sub(drained.len(), Ordering::Relaxed);
        for entry in &drained {
            entry.release_slot();
        }
        drained
    }
}

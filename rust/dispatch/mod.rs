//! Dispatch: pick a rank for each request, register it there, send it, and abort it when its ticket is dropped.
//!
//! Per-request state is `inflight`, each rank's is `rank` (its `inflight` map is the single point of truth of how
//! a request ends), a request's claim on its rank is `ticket`, and `gather` holds long prompts for a moment so that
//! a burst's prefills share a step. The gather hands its windows back through a closure, never naming the
//! dispatcher.

pub mod gather;
mod inflight;
mod rank;
#[cfg(test)]
pub mod testing;
mod ticket;

use crate::admission::Permit;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::ring::RingError;
use crate::ring::records::{self, ImageSet, Submit};
use crate::ring::status::{AUX_QUEUED_TOKENS, monotonic_ms};
use crate::stream::Outlet;
use crate::ttft::Stamps;
use gather::{Gather, GatherPolicy, Waiting};
use pyo3::prelude::*;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

pub use inflight::{Inflight, OnFinish, TokenLogprobs};
pub use rank::RankLink;
pub use ticket::Ticket;

/// Who the request is, for the dispatcher.
pub struct RequestMeta {
    pub id: u64,
    pub request_id: String,
    pub arrival: Instant,
    /// When its body had been checked, and when it got its admission slot.
    pub parsed: Instant,
    pub admitted: Instant,
    /// Called with its last bytes as it succeeds (`Inflight::finished_with`).
    pub on_finish: Option<OnFinish>,
    /// Its OpenTelemetry trace, when tracing is on.
    pub trace: Option<Arc<crate::trace::RequestTrace>>,
    /// A client's request, which `/abort_request` may end (batch lines and background runs have their own cancel).
    pub abortable: bool,
}

pub struct Dispatcher {
    pub ranks: Vec<Arc<RankLink>>,
    pub metrics: Arc<Metrics>,
    next_id: AtomicU64,
    /// Requests the server ended itself before their rank finished them (a rank failure, a drain that timed
    /// out): the exit status reports them.
    lost: AtomicUsize,
    /// Long prompts wait here a moment so that a burst's prefills share a step (`gather`).
    pub gather: Arc<Gather>,
}

/// What the codec prepared, ready to go to a rank.
pub struct Job<'a> {
    /// The SUBMIT record (its `request_id` is the dispatcher id from `next_id`).
    pub submit: Submit<&'a [u32]>,
    /// Decode as tokens arrive, or once at the end (see `Inflight::incremental`).
    pub incremental: bool,
}

impl Dispatcher {
    pub fn new(ranks: Vec<RankLink>, metrics: Arc<Metrics>) -> Arc<Self> {
        Self::with_gather(ranks, metrics, GatherPolicy::OFF)
    }

    pub fn with_gather(ranks: Vec<RankLink>, metrics: Arc<Metrics>, policy: GatherPolicy) -> Arc<Self> {
        Arc::new_cyclic(|me: &Weak<Dispatcher>| {
            // The gather's thread hands back what a window held, for as long as the dispatcher lives.
            let me = me.clone();
            let release = move |batch| me.upgrade().map(|d| d.send_gathered(batch)).is_some();
            Dispatcher {
                ranks: ranks.into_iter().map(Arc::new).collect(),
                metrics,
                next_id: AtomicU64::new(1),
                lost: AtomicUsize::new(0),
                gather: Gather::start(policy, release),
            }
        })
    }

    pub fn count_lost(&self, n: usize) {
        self.lost.fetch_add(n, Ordering::Relaxed);
    }

    pub fn lost(&self) -> usize {
        self.lost.load(Ordering::Relaxed)
    }

    pub fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The least loaded live rank: fewest requests in flight, then fewest prompt tokens still to prefill (a rank
    /// busy prefilling long prompts would delay a new request's first token). Not round-robin.
    fn pick(&self) -> Option<&Arc<RankLink>> {
        self.ranks.iter().filter(|r| r.is_alive()).min_by_key(|r| (r.in_flight(), r.output.aux(AUX_QUEUED_TOKENS)))
    }

    /// Register the request, then send it: the rank's first token can never beat its registration.
    pub fn submit(
        &self,
        meta: RequestMeta,
        job: Job<'_>,
        decoder: Py<PyAny>,
        outlet: Outlet,
        permit: Permit,
    ) -> Result<Ticket, ApiError> {
        let rank = self.pick().ok_or_else(|| ApiError::Unavailable("no engine rank is running".into()))?;
        let encoded = Instant::now(); // the codec calls this right after converting and encoding the request
        let RequestMeta { id, request_id, arrival, parsed, admitted, on_finish, trace, abortable } = meta;
        // The tokens the engine prefills: an image's placeholder stands for many (as usage counts them).
        let images = job.submit.images.as_ref().map_or(0, |im| im.extra_tokens as usize);
        let prompt_tokens = job.submit.prompt.len() + images;
        let entry = Arc::new(Inflight {
            id,
            request_id,
            rank: rank.index,
            prompt_tokens,
            decoder,
            outlet,
            arrival,
            stamps: Stamps::new(parsed, admitted, encoded),
            incremental: job.incremental,
            held: Mutex::default(),
            timing: Mutex::default(),
            permit: Mutex::new(Some(permit)),
            on_finish: Mutex::new(on_finish),
            trace,
            abortable,
        });
        rank.inflight.lock().unwrap().insert(id, entry.clone());
        // Stored before the count rises, so a watchdog that sees the new count sees the new time too.
        if rank.count.load(Ordering::Relaxed) == 0 {
            rank.busy_since_ms.store(monotonic_ms(), Ordering::Relaxed);
        }
        rank.count.fetch_add(1, Ordering::Release);
        let held_images = job.submit.images.clone();
        let record = Submit { request_id: id, ..job.submit }.encode();
        if self.gather.policy.holds(prompt_tokens) {
            self.gather.hold(Waiting { entry, record, images: held_images });
        } else if let Err(e) = self.send(rank, &entry, record, true) {
            rank.take(id);
            return Err(e);
        }
        Ok(Ticket { link: rank.clone(), metrics: self.metrics.clone(), id, abort_reason: "client_disconnect" })
    }

    /// `/abort_request`: end the clients' requests on a rank whose id is `rid` (all of them for None) at once, with
    /// what they have (`RankLink::abort`). How many it ended.
    pub fn abort_requests(&self, rid: Option<&str>) -> usize {
        let mut n = 0;
        for link in &self.ranks {
            for id in link.find(|e| e.abortable && rid.is_none_or(|r| crate::ids::aborts(r, &e.request_id))) {
                n += usize::from(link.abort(id));
            }
        }
        n
    }

    /// Put a registered request's SUBMIT in its rank's ring; `notify: false` leaves waking the rank to the caller.
    fn send(&self, rank: &RankLink, entry: &Inflight, record: Vec<u8>, notify: bool) -> Result<(), ApiError> {
        // Stamped before the send: once in the ring the rank may take the request before this thread runs again,
        // and its `taken` must not come before `written`.
        let written = Instant::now();
        entry.stamps.written(written);
        match rank.requests.send_then(records::SUBMIT, record, notify) {
            Ok(()) => {}
            // The launcher sizes the rings for the largest request the limits allow, so this is a limit missed: the
            // request is too large for this server (a 413), never a sign the replica is failing (a 503 would take it
            // out of a gateway's rotation).
            Err(RingError::TooLarge { len, max }) => {
                tracing::error!(rank = rank.index, len, max, "a request's record does not fit its ring");
                return Err(ApiError::RecordTooLarge(max));
            }
            Err(e) => {
                tracing::error!(rank = rank.index, "cannot send request to rank: {e}");
                return Err(ApiError::Unavailable(format!("Engine rank {} is not accepting requests.", rank.index)));
            }
        }
        self.metrics.queue.observe((written - entry.arrival).as_secs_f64());
        self.metrics.prompt_tokens.inc_by(entry.prompt_tokens as u64);
        Ok(())
    }

    /// Send the requests a gather window held, unless they ended meanwhile (the client left, the rank failed),
    /// then wake their ranks once: a rank group woken by the first record would start its step without the rest.
    /// The check and the send happen under the rank's map lock, so an abort from a dropped ticket always follows
    /// its SUBMIT.
    pub fn send_gathered(&self, batch: Vec<Waiting>) {
        let mut woken = vec![false; self.ranks.len()];
        for held in batch {
            let rank = &self.ranks[held.entry.rank];
            let map = rank.inflight.lock().unwrap();
            if !map.contains_key(&held.entry.id) {
                held.images.iter().for_each(ImageSet::discard); // it ended while held: no rank will read them
                continue;
            }
            let sent = self.send(rank, &held.entry, held.record, false);
            drop(map);
            woken[rank.index] = true;
            // Only a closed ring refuses it (the rank is failing): end it as the immediate path would.
            if let Err(e) = sent {
                held.images.iter().for_each(ImageSet::discard);
                if let Some(entry) = rank.take(held.entry.id) {
                    entry.fail(e);
                }
            }
        }
        for rank in self.ranks.iter().filter(|r| woken[r.index]) {
            rank.requests.notify();
        }
    }
}

impl Drop for Dispatcher {
    fn drop(&mut self) {
        self.gather.stop();
    }
}

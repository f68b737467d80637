//! Dispatch: pick a rank for each request, track what is in flight per rank, abort on drop.
//!
//! The per-rank `inflight` map is the single point of truth: whoever removes a request's entry (the rank_io
//! thread on finish, a dropped ticket, a timeout, a rank failure) decides how it ends, so it ends exactly once.

use crate::admission::Permit;
use crate::error::ApiError;
use crate::gather::{Gather, GatherPolicy, Waiting};
use crate::metrics::Metrics;
use crate::ring::records::{self, Abort, ImageSet, Submit};
use crate::ring::status::{AUX_QUEUED_TOKENS, monotonic_ms};
use crate::ring::{Doorbell, Ring, RingError, Sender};
use crate::stream::Outlet;
use crate::ttft::{RankClock, Stamps};
use pyo3::prelude::*;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A request running on a rank.
pub struct Inflight {
    pub id: u64,
    /// The client-facing id (`X-Request-Id`), for logs.
    pub request_id: String,
    pub rank: usize,
    pub prompt_tokens: usize,
    /// The Python `codec.Decoder`; only touched with the GIL, on the rank_io thread.
    pub decoder: Py<PyAny>,
    pub outlet: Outlet,
    pub arrival: Instant,
    /// Where its time to first token goes (`ttft`).
    pub stamps: Stamps,
    /// False for a non-stream without stop sequences: its tokens are held here and decoded once at the end.
    pub incremental: bool,
    held: Mutex<Held>,
    /// Token timing, written by the rank_io thread only.
    timing: Mutex<Timing>,
    /// The admission slot: freed as the request leaves its rank (`RankLink::take`), however it ends, and before
    /// its last bytes go to the client, who may send its next request the moment it has them. A client that is
    /// still (slowly) reading must not hold engine capacity either.
    permit: Mutex<Option<Permit>>,
}

/// Tokens held for a later decode.
#[derive(Default)]
struct Held {
    tokens: Vec<u32>,
    logprobs: Option<TokenLogprobs>,
    /// The prompt's logprobs, until the first decode hands them to the decoder.
    prompt_logprobs: Option<Vec<u8>>,
}

/// The logprobs of a run of tokens, in the output record's byte layout (`ring::records::Logprobs`), owned.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenLogprobs {
    pub top: u32,
    pub values: Vec<u8>,
    pub alternatives: Vec<u8>,
}

impl TokenLogprobs {
    pub fn new(top: u32) -> Self {
        TokenLogprobs { top, ..Default::default() }
    }

    pub fn extend(&mut self, other: &TokenLogprobs) {
        self.values.extend_from_slice(&other.values);
        self.alternatives.extend_from_slice(&other.alternatives);
    }

    pub fn extend_from_record(&mut self, lp: &records::Logprobs<'_>) {
        self.values.extend_from_slice(lp.values);
        self.alternatives.extend_from_slice(lp.alternatives);
    }

    pub fn view(&self) -> records::Logprobs<'_> {
        records::Logprobs { top: self.top, values: &self.values, alternatives: &self.alternatives }
    }
}

#[derive(Default)]
struct Timing {
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
    /// When the last token event with visible output left for the client.
    sent: Option<Instant>,
}

impl Inflight {
    /// Record that tokens arrived now; returns (time to first token if this was the first, gap since the last).
    pub fn tokens_arrived(&self, now: Instant, n: usize) -> (Option<Duration>, Option<Duration>) {
        let mut t = self.timing.lock().unwrap();
        t.tokens += n;
        let gap = t.last.map(|l| now - l);
        t.last = Some(now);
        if t.first.is_none() {
            t.first = Some(now);
            return (Some(now - self.arrival), None);
        }
        (None, gap)
    }

    /// When the client was last sent visible token output; None before any (the role chunk does not count).
    pub fn last_sent(&self) -> Option<Instant> {
        self.timing.lock().unwrap().sent
    }

    /// When the server read its first token.
    pub fn first_token_at(&self) -> Option<Instant> {
        self.timing.lock().unwrap().first
    }

    pub fn mark_sent(&self, now: Instant) {
        self.timing.lock().unwrap().sent = Some(now);
    }

    /// Keep tokens (and their logprobs) for a later decode.
    pub fn hold(&self, tokens: &[u32], logprobs: Option<&TokenLogprobs>) {
        let mut held = self.held.lock().unwrap();
        held.tokens.extend_from_slice(tokens);
        if let Some(lp) = logprobs {
            held.logprobs.get_or_insert_with(|| TokenLogprobs::new(lp.top)).extend(lp);
        }
    }

    /// Keep the prompt's logprobs (they come with the first token) for the next decode.
    pub fn keep_prompt_logprobs(&self, values: Vec<u8>) {
        self.held.lock().unwrap().prompt_logprobs = Some(values);
    }

    pub fn take_prompt_logprobs(&self) -> Option<Vec<u8>> {
        self.held.lock().unwrap().prompt_logprobs.take()
    }

    /// Everything held so far followed by `tokens` (and their logprobs).
    pub fn held_then(&self, tokens: Vec<u32>, logprobs: Option<TokenLogprobs>) -> (Vec<u32>, Option<TokenLogprobs>) {
        let mut held = {
            let mut guard = self.held.lock().unwrap();
            let prompt_logprobs = guard.prompt_logprobs.take();
            let held = std::mem::take(&mut *guard);
            guard.prompt_logprobs = prompt_logprobs; // taken by the decode, not here
            held
        };
        if held.tokens.is_empty() {
            return (tokens, logprobs);
        }
        held.tokens.extend_from_slice(&tokens);
        if let Some(lp) = &logprobs {
            held.logprobs.get_or_insert_with(|| TokenLogprobs::new(lp.top)).extend(lp);
        }
        (held.tokens, held.logprobs.or(logprobs))
    }

    /// Free the admission slot now, before the client hears the request ended: a client that sends its next
    /// request the moment it has the answer must find the slot free, not wait for the last reference to go.
    pub fn release_slot(&self) {
        self.permit.lock().unwrap().take();
    }

    /// End it with `err` before its rank finished it: the log line, then the error to its client (a stream's error
    /// event and `[DONE]`, else the door's envelope).
    pub fn fail(&self, err: ApiError) {
        self.log_end(err.status().as_u16(), err.code());
        self.outlet.fail(err);
    }

    /// One structured log line for the request's end.
    pub fn log_end(&self, status: u16, reason: &str) {
        let t = self.timing.lock().unwrap();
        let ttft_ms = t.first.map(|f| (f - self.arrival).as_secs_f64() * 1e3);
        tracing::info!(
            target: "deepinfer_server::request",
            request_id = %self.request_id,
            rank = self.rank,
            prompt_tokens = self.prompt_tokens,
            output_tokens = t.tokens,
            ttft_ms,
            e2e_ms = self.arrival.elapsed().as_secs_f64() * 1e3,
            status,
            reason,
            "request finished"
        );
    }
}

/// Who the request is, for the dispatcher.
pub struct RequestMeta {
    pub id: u64,
    pub request_id: String,
    pub arrival: Instant,
    /// When its body had been checked, and when it got its admission slot.
    pub parsed: Instant,
    pub admitted: Instant,
}

/// One data-parallel rank as the server sees it.
pub struct RankLink {
    pub index: usize,
    pub requests: Sender,
    pub output: Arc<Ring>,
    /// Keyed by the dispatcher's own sequential ids (never client input), so a fast non-keyed hash is safe.
    inflight: Mutex<FxHashMap<u64, Arc<Inflight>>>,
    count: AtomicUsize,
    alive: AtomicBool,
    /// When the rank last went from no requests to some (`monotonic_ms`): a rank asleep on its doorbell stamps
    /// no heartbeat, so the watchdog measures a stall from the later of this and its last heartbeat.
    busy_since_ms: AtomicU64,
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

    /// No new requests go to a dead rank, and /health reports it.
    pub fn mark_dead(&self) {
        self.alive.store(false, Ordering::Release);
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

pub struct Dispatcher {
    pub ranks: Vec<RankLink>,
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
        Arc::new_cyclic(|me| Dispatcher {
            ranks,
            metrics,
            next_id: AtomicU64::new(1),
            lost: AtomicUsize::new(0),
            gather: Gather::start(policy, me.clone()),
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
    fn pick(&self) -> Option<&RankLink> {
        self.ranks.iter().filter(|r| r.is_alive()).min_by_key(|r| (r.in_flight(), r.output.aux(AUX_QUEUED_TOKENS)))
    }

    /// Register the request, then send it: the rank's first token can never beat its registration.
    pub fn submit(
        self: &Arc<Self>,
        meta: RequestMeta,
        job: Job<'_>,
        decoder: Py<PyAny>,
        outlet: Outlet,
        permit: Permit,
    ) -> Result<Ticket, ApiError> {
        let rank = self.pick().ok_or_else(|| ApiError::Unavailable("no engine rank is running".into()))?;
        let encoded = Instant::now(); // the codec calls this right after converting and encoding the request
        let RequestMeta { id, request_id, arrival, parsed, admitted } = meta;
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
        Ok(Ticket { dispatcher: self.clone(), rank: rank.index, id, abort_reason: "client_disconnect" })
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

/// A request's claim on its rank. Dropping it (client gone, handler finished) aborts the request on its rank if
/// it is still running there, which frees its admission slot.
pub struct Ticket {
    dispatcher: Arc<Dispatcher>,
    rank: usize,
    id: u64,
    /// Why the request stops if the ticket is dropped while it still runs.
    abort_reason: &'static str,
}

impl Ticket {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Abort now, counting it under `reason`.
    pub fn abort(mut self, reason: &'static str) {
        self.abort_reason = reason;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let link = &self.dispatcher.ranks[self.rank];
        if let Some(entry) = link.take(self.id) {
            self.dispatcher.metrics.aborted.with_label_values(&[self.abort_reason]).inc();
            let status = if self.abort_reason == "timeout" { 504 } else { 499 };
            entry.log_end(status, self.abort_reason);
            if link.is_alive() {
                link.send_abort(self.id);
            }
        }
    }
}

/// A dispatcher over real rings in a temporary directory, and a request for it, for the tests of its users.
#[cfg(test)]
pub mod testing {
    use super::*;
    use crate::admission::Admission;
    use crate::gather::GatherPolicy;

    pub fn dispatcher(dir: &std::path::Path, ranks: usize) -> Arc<Dispatcher> {
        gathering(dir, ranks, GatherPolicy::OFF)
    }

    pub fn gathering(dir: &std::path::Path, ranks: usize, policy: GatherPolicy) -> Arc<Dispatcher> {
        let links = (0..ranks)
            .map(|i| {
                let req = Arc::new(Ring::create(dir.join(format!("q{i}")), 1 << 16).unwrap());
                let out = Arc::new(Ring::create(dir.join(format!("o{i}")), 1 << 16).unwrap());
                RankLink::new(i, req, out, None)
            })
            .collect();
        Dispatcher::with_gather(links, Arc::new(Metrics::new("m")), policy)
    }

    /// Submit a three-token prompt.
    pub fn submit(d: &Arc<Dispatcher>, admission: &Admission) -> Ticket {
        let (outlet, _) = Outlet::unary();
        let decoder = Python::attach(|py| py.None());
        let prompt = [1u32, 2, 3];
        let submit = Submit {
            request_id: 0,
            prompt: &prompt[..],
            max_tokens: 4,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            seed: None,
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: false,
            constraint: None,
            images: None,
        };
        let now = Instant::now();
        let meta = RequestMeta { id: d.next_id(), request_id: "r".into(), arrival: now, parsed: now, admitted: now };
        let permit = admission.try_admit().unwrap();
        d.submit(meta, Job { submit, incremental: true }, decoder, outlet, permit).unwrap()
    }
}

//! One thread per rank reads its output ring: wait (futex, no spinning), drain every batch that is ready,
//! decode them in one Python call (first tokens in a call of their own, ahead of the bulk), and hand the bytes
//! to each request's outlet.
//!
//! Draining everything at once is what batches work across the GIL boundary: when the server falls behind, each
//! request's tokens from several engine steps go through the codec together and leave as one SSE event. A stream
//! that sent an event less than `stream_interval_ms` ago holds its tokens until its next event is due, so an
//! engine faster than that interval cannot make every token an event of its own.

use crate::codec::{Codec, DecodeItem, DecodeState};
use crate::dispatch::{Dispatcher, Inflight, RankLink, TokenLogprobs};
use crate::error::ApiError;
use crate::limits::MAX_RANK_DRAIN_BYTES;
use crate::metrics::Metrics;
use crate::ring::records::{self, FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_NONE, RankStamps};
use crate::stream::Outlet;
use bytes::Bytes;
use pyo3::prelude::*;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Under CPU saturation, converting new requests (codec threads) and the HTTP threads go before bulk decoding:
/// time to first token matters more than a few microseconds of inter-token latency.
const DECODE_NICE: i32 = 3;
/// A bounded wait so a closed ring (shutdown, dead rank) is noticed even if no wake-up arrives.
const IDLE_WAIT: Duration = Duration::from_millis(500);

/// The tokens one request got in this wake-up, merged across engine steps.
struct Batch {
    id: u64,
    tokens: Vec<u32>,
    finish: u32,
    reason: Option<String>,
    /// Only for a request that asked for them.
    logprobs: Option<TokenLogprobs>,
    /// The prompt's logprobs (f32 little-endian), with the first token of a request that asked for them.
    prompt_logprobs: Option<Vec<u8>>,
}

impl Batch {
    fn new(id: u64) -> Self {
        Batch { id, tokens: Vec::new(), finish: FINISH_NONE, reason: None, logprobs: None, prompt_logprobs: None }
    }
}

/// Streams whose tokens wait for their next event (`stream_interval_ms`), by request id, with when it is due.
type Waiting = FxHashMap<u64, Instant>;

pub fn spawn(dispatcher: Arc<Dispatcher>, codec: Arc<Codec>, rank: usize, interval: Duration) -> JoinHandle<()> {
    thread::Builder::new()
        .name(format!("rank{rank}-out"))
        .spawn(move || crate::codec::with_thread_state(|| run(&dispatcher, &codec, rank, interval)))
        .expect("spawn rank_io thread")
}

fn run(dispatcher: &Dispatcher, codec: &Codec, rank: usize, interval: Duration) {
    let link = &dispatcher.ranks[rank];
    crate::supervisor::lower_thread_priority(DECODE_NICE);
    let mut waiting = Waiting::default();
    loop {
        let aborted = link.take_aborted();
        if !aborted.is_empty() {
            end_aborted(link, &dispatcher.metrics, codec, aborted);
        }
        if link.is_frozen() {
            // Paused in place: read nothing, so the rank stops within its few steps ahead (`RankLink::freeze`).
            if link.output.is_closed() {
                return;
            }
            link.wait_frozen(IDLE_WAIT);
            continue;
        }
        let next_due = waiting.values().min().map(|d| d.saturating_duration_since(Instant::now()));
        let wait = next_due.map_or(IDLE_WAIT, |d| d.min(IDLE_WAIT));
        let readable = link.output.wait_readable_or_woken(wait, || link.has_work() || link.is_frozen());
        if !readable && waiting.is_empty() {
            if link.output.is_closed() {
                return;
            }
            continue;
        }
        let mut batches = Vec::new();
        if readable {
            let stamps;
            (batches, stamps) = drain(link);
            if !stamps.is_empty() {
                link.note_rank_stamps(&stamps);
            }
        }
        add_due(&mut waiting, &mut batches);
        if batches.is_empty() {
            if link.output.is_closed() {
                return;
            }
            continue;
        }
        deliver(link, &dispatcher.metrics, codec, batches, interval, &mut waiting);
    }
}

/// Streams whose wait is over get an empty batch, which sends what they hold; a stream with new tokens in this
/// drain is decided again in `deliver`.
fn add_due(waiting: &mut Waiting, batches: &mut Vec<Batch>) {
    if waiting.is_empty() {
        return;
    }
    for b in batches.iter() {
        waiting.remove(&b.id);
    }
    let now = Instant::now();
    waiting.retain(|id, due| {
        if *due > now {
            return true;
        }
        batches.push(Batch::new(*id));
        false
    });
}

/// Everything ready in the output ring: each request's tokens merged across steps, and the rank's TIMING stamps.
fn drain(link: &RankLink) -> (Vec<Batch>, Vec<RankStamps>) {
    let mut out: Vec<Batch> = Vec::new();
    let mut stamps: Vec<RankStamps> = Vec::new();
    let mut index: FxHashMap<u64, usize> = FxHashMap::default();
    let drained = link.output.drain(MAX_RANK_DRAIN_BYTES, |kind, payload| {
        if kind == records::TIMING {
            match records::decode_timing(payload) {
                Ok(s) => stamps.extend(s),
                Err(err) => tracing::error!(rank = link.index, "malformed timing record: {err}"),
            }
            return;
        }
        if kind != records::TOKENS {
            tracing::error!(rank = link.index, kind, "unexpected record kind on the output ring");
            return;
        }
        let entries = match records::decode_tokens(payload) {
            Ok(entries) => entries,
            Err(err) => {
                tracing::error!(rank = link.index, "malformed output record: {err}");
                return;
            }
        };
        for e in entries {
            let e = match e {
                Ok(e) => e,
                Err(err) => {
                    tracing::error!(rank = link.index, "malformed output entry: {err}");
                    break;
                }
            };
            let slot = *index.entry(e.request_id).or_insert_with(|| {
                out.push(Batch::new(e.request_id));
                out.len() - 1
            });
            let b = &mut out[slot];
            if b.finish == FINISH_NONE {
                b.tokens.extend(e.tokens.iter());
                b.finish = e.finish;
                b.reason = e.reason.map(str::to_owned);
                if let Some(lp) = &e.logprobs {
                    b.logprobs.get_or_insert_with(TokenLogprobs::default).extend_from_record(lp);
                }
                if let Some(p) = e.prompt_logprobs {
                    b.prompt_logprobs = Some(p.to_vec());
                }
            }
        }
    });
    if let Err(err) = drained {
        tracing::error!(rank = link.index, "output ring unreadable: {err}; closing it");
        link.output.close();
    }
    (out, stamps)
}

fn deliver(
    link: &RankLink,
    metrics: &Metrics,
    codec: &Codec,
    batches: Vec<Batch>,
    interval: Duration,
    waiting: &mut Waiting,
) {
    let now = Instant::now();
    let found = link.lookup(batches.iter().map(|b| b.id));
    // First tokens go out before the bulk: a new request's time to first token should not wait for the decoding
    // of every other stream's backlog, nor yield to conversions the way bulk decoding does.
    let mut first: Vec<Work> = Vec::new();
    let mut bulk: Vec<Work> = Vec::with_capacity(batches.len());
    for (entry, mut b) in found.into_iter().zip(batches) {
        let Some(entry) = entry else { continue }; // aborted or timed out: drop late tokens
        if let Some(p) = b.prompt_logprobs.take() {
            entry.keep_prompt_logprobs(p); // decoded with the first tokens that go out, held or not
        }
        if b.finish == FINISH_ERROR || b.finish == FINISH_ABORT {
            if let Some(e) = link.take(b.id) {
                let reason = b.reason.clone().unwrap_or_else(|| "abort".into());
                let (err, label) = ApiError::from_engine(&reason);
                metrics.aborted.with_label_values(&[label]).inc();
                tracing::warn!(rank = link.index, request = b.id, "engine ended the request: {reason}");
                e.fail_as(err, label);
            }
            continue;
        }
        if !b.tokens.is_empty() {
            if crate::fatal::fail_point("rank-out") {
                panic!("fail point: rank-out");
            }
            let (ttft, gap) = entry.tokens_arrived(now, b.tokens.len());
            if let Some(t) = ttft {
                metrics.observe_ttft(t);
                let stages = entry.stamps.stages(entry.arrival, now);
                metrics.observe_ttft_stages(&stages);
                if let Some(trace) = &entry.trace {
                    trace.first_token(now, stages);
                }
            }
            metrics.observe_tokens(b.tokens.len(), gap);
        }
        // Hold the tokens: a non-stream without stop sequences until it ends (one decode, in one push), a stream
        // that sent an event less than `interval` ago until its next event is due.
        let sent = entry.last_sent();
        if b.finish == FINISH_NONE {
            if !entry.incremental {
                entry.hold(&b.tokens, b.logprobs.as_ref());
                continue;
            }
            if let Some(due) = sent.map(|t| t + interval).filter(|due| *due > now) {
                entry.hold(&b.tokens, b.logprobs.as_ref());
                waiting.insert(b.id, due);
                continue;
            }
        }
        (b.tokens, b.logprobs) = entry.held_then(b.tokens, b.logprobs.take());
        // A stream whose client has seen no token output yet: its first tokens may decode to nothing visible (a
        // leading newline the parser drops, half a character), so it stays in the fast lane until something shows.
        if entry.incremental && sent.is_none() { first.push((entry, b)) } else { bulk.push((entry, b)) }
    }
    if !first.is_empty() {
        decode_and_send(link, metrics, codec, first);
    }
    if !bulk.is_empty() {
        codec.yield_to_prepares();
        decode_and_send(link, metrics, codec, bulk);
    }
}

type Work = (Arc<Inflight>, Batch);

/// End requests `/abort_request` took off this rank (`RankLink::abort`): what they hold is decoded with the finish
/// `FINISH_ABORT`, which the codec reports as finish reason `abort`, and goes to the client as their end.
fn end_aborted(link: &RankLink, metrics: &Metrics, codec: &Codec, entries: Vec<Arc<Inflight>>) {
    Python::attach(|py| {
        let held: Vec<_> = entries.iter().map(|e| (e.held_then(Vec::new(), None), e.take_prompt_logprobs())).collect();
        let items: Vec<_> = entries
            .iter()
            .zip(&held)
            .map(|(e, ((tokens, logprobs), p))| DecodeItem {
                decoder: &e.decoder,
                tokens: tokens.as_slice(),
                finish: FINISH_ABORT,
                logprobs: logprobs.as_ref().map(TokenLogprobs::view),
                prompt_logprobs: p.as_deref(),
            })
            .collect();
        let decoded = codec.decode(py, &items);
        for (i, entry) in entries.iter().enumerate() {
            metrics.aborted.with_label_values(&["abort_request"]).inc();
            match &decoded {
                Ok(d) => {
                    entry.log_end(200, "abort");
                    entry.finish(Bytes::copy_from_slice(&d[i].bytes));
                }
                Err(_) => entry.fail(ApiError::Internal),
            }
        }
        if let Err(err) = decoded {
            crate::codec::log_python_error(py, &err, &format!("rank {}: decode_batch raised on abort", link.index));
        }
        drop(entries); // release decoder references while attached
    });
}

/// One Python call for the whole batch, then each request's bytes to its outlet.
fn decode_and_send(link: &RankLink, metrics: &Metrics, codec: &Codec, work: Vec<Work>) {
    Python::attach(|py| {
        let prompts: Vec<_> = work.iter().map(|(e, _)| e.take_prompt_logprobs()).collect();
        let items: Vec<_> = work
            .iter()
            .zip(&prompts)
            .map(|((e, b), p)| DecodeItem {
                decoder: &e.decoder,
                tokens: b.tokens.as_slice(),
                finish: b.finish,
                logprobs: b.logprobs.as_ref().map(TokenLogprobs::view),
                prompt_logprobs: p.as_deref(),
            })
            .collect();
        match codec.decode(py, &items) {
            Ok(decoded) => {
                let now = Instant::now();
                for ((entry, b), d) in work.iter().zip(decoded) {
                    if entry.incremental && !d.bytes.is_empty() {
                        if let (Outlet::Stream(s), None, Some(read)) =
                            (&entry.outlet, entry.last_sent(), entry.first_token_at())
                        {
                            let sse = metrics.sse_stage(); // the first visible event: time its write
                            let trace = entry.trace.clone();
                            s.on_written(Box::new(move |at| {
                                sse.observe((at - read).as_secs_f64());
                                if let Some(trace) = trace {
                                    trace.sse_written(at);
                                }
                            }));
                        }
                        entry.mark_sent(now); // the stream interval counts from events the client can see
                    }
                    if finish_one(link, metrics, entry, d.state, d.bytes.freeze()) {
                        metrics.e2e.observe(entry.arrival.elapsed().as_secs_f64());
                        if let Some(trace) = entry.trace.as_ref().filter(|t| t.wants_reasoning_tokens()) {
                            // The decoder's own count of the engine's reasoning tokens, read once while attached.
                            let n =
                                entry.decoder.bind(py).getattr("reasoning").and_then(|v| v.extract::<Option<u64>>());
                            if let Ok(Some(n)) = n {
                                trace.reasoning_tokens(n);
                            }
                        }
                        let reason = if b.finish == FINISH_LENGTH { "length" } else { "stop" };
                        metrics.observe_success(reason);
                        entry.log_end(200, reason);
                    }
                }
            }
            Err(err) => {
                crate::codec::log_python_error(py, &err, &format!("rank {}: decode_batch raised", link.index));
                for (entry, _) in &work {
                    if let Some(e) = link.take(entry.id) {
                        link.send_abort(e.id); // the rank would otherwise keep generating for nobody
                        e.fail(ApiError::Internal);
                    }
                }
            }
        }
        drop(work); // release decoder references while attached
    });
}

/// Hand decoded bytes to the request; true if this ended it as a success.
fn finish_one(link: &RankLink, metrics: &Metrics, entry: &Inflight, state: DecodeState, bytes: Bytes) -> bool {
    match state {
        DecodeState::Running => {
            if let Outlet::Stream(s) = &entry.outlet
                && !bytes.is_empty()
                && !s.push(&bytes, false)
                && let Some(e) = link.take(entry.id)
            {
                // The client is more than --max-stream-buffer-bytes behind: the stream was cut, which closes its
                // connection; stop generating for it now rather than when the write timeout notices.
                link.send_abort(e.id);
                metrics.aborted.with_label_values(&["slow_reader"]).inc();
                e.log_end(499, "slow_reader");
            }
            false
        }
        DecodeState::Finished | DecodeState::StoppedEarly => {
            if link.take(entry.id).is_none() {
                return false; // the client left in the meantime; its ticket already aborted it
            }
            if state == DecodeState::StoppedEarly {
                link.send_abort(entry.id); // a stop sequence matched: the rank is still generating
            }
            entry.finish(bytes); // a stored response is in the store before the client has its end
            true
        }
    }
}

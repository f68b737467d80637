//! One thread per rank reads its output ring: wait (futex, no spinning), drain every batch that is ready,
//! decode them all in one Python call, and hand the bytes to each request's outlet.
//!
//! Draining everything at once is what batches work across the GIL boundary: when the server falls behind, each
//! request's tokens from several engine steps go through the codec together and leave as one SSE event.

use crate::codec::{Codec, DecodeState};
use crate::dispatch::{Dispatcher, Inflight, RankLink};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::ring::records::{self, FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_NONE};
use crate::stream::{DONE, Outlet};
use bytes::Bytes;
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Under CPU saturation, converting new requests (codec threads) and the HTTP threads go before bulk decoding:
/// time to first token matters more than a few microseconds of inter-token latency.
const DECODE_NICE: i32 = 3;
/// Bytes drained per wake-up; bounds the latency of the first request in a huge backlog.
const DRAIN_MAX_BYTES: usize = 1 << 20;
/// A bounded wait so a closed ring (shutdown, dead rank) is noticed even if no wake-up arrives.
const IDLE_WAIT: Duration = Duration::from_millis(500);

/// The tokens one request got in this wake-up, merged across engine steps.
struct Batch {
    id: u64,
    tokens: Vec<u32>,
    finish: u32,
    reason: Option<String>,
}

pub fn spawn(dispatcher: Arc<Dispatcher>, codec: Arc<Codec>, rank: usize) -> JoinHandle<()> {
    thread::Builder::new()
        .name(format!("rank{rank}-out"))
        .spawn(move || run(&dispatcher, &codec, rank))
        .expect("spawn rank_io thread")
}

fn run(dispatcher: &Dispatcher, codec: &Codec, rank: usize) {
    let link = &dispatcher.ranks[rank];
    crate::supervisor::lower_thread_priority(DECODE_NICE);
    loop {
        if !link.output.wait_readable(Some(IDLE_WAIT)) {
            if link.output.is_closed() {
                return;
            }
            continue;
        }
        let batches = drain(link);
        if batches.is_empty() {
            if link.output.is_closed() {
                return;
            }
            continue;
        }
        deliver(link, &dispatcher.metrics, codec, batches);
    }
}

fn drain(link: &RankLink) -> Vec<Batch> {
    let mut out: Vec<Batch> = Vec::new();
    let mut index: HashMap<u64, usize> = HashMap::new();
    let drained = link.output.drain(DRAIN_MAX_BYTES, |kind, payload| {
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
                out.push(Batch { id: e.request_id, tokens: Vec::new(), finish: FINISH_NONE, reason: None });
                out.len() - 1
            });
            let b = &mut out[slot];
            if b.finish == FINISH_NONE {
                b.tokens.extend(e.tokens.iter());
                b.finish = e.finish;
                b.reason = e.reason.map(str::to_owned);
            }
        }
    });
    if let Err(err) = drained {
        tracing::error!(rank = link.index, "output ring unreadable: {err}; closing it");
        link.output.close();
    }
    out
}

fn deliver(link: &RankLink, metrics: &Metrics, codec: &Codec, batches: Vec<Batch>) {
    let now = Instant::now();
    let found = link.lookup(batches.iter().map(|b| b.id));
    let mut work: Vec<(Arc<Inflight>, Batch)> = Vec::with_capacity(batches.len());
    for (entry, mut b) in found.into_iter().zip(batches) {
        let Some(entry) = entry else { continue }; // aborted or timed out: drop late tokens
        if b.finish == FINISH_ERROR || b.finish == FINISH_ABORT {
            if let Some(e) = link.take(b.id) {
                metrics.aborted.with_label_values(&["engine_error"]).inc();
                e.log_end(500, "engine_error");
                let reason = b.reason.clone().unwrap_or_else(|| "the engine aborted the request".into());
                tracing::warn!(rank = link.index, request = b.id, "engine ended the request: {reason}");
                e.outlet.fail(ApiError::Engine(format!("The engine could not complete the request: {reason}")));
            }
            continue;
        }
        if !b.tokens.is_empty() {
            let (ttft, gap) = entry.tokens_arrived(now, b.tokens.len());
            if let Some(t) = ttft {
                metrics.ttft.observe(t.as_secs_f64());
            }
            metrics.observe_tokens(b.tokens.len(), gap);
        }
        // A non-stream without stop sequences needs no text before it ends: decode it once, in one push.
        if !entry.incremental {
            if b.finish == FINISH_NONE {
                entry.hold(&b.tokens);
                continue;
            }
            b.tokens = entry.held_then(b.tokens);
        }
        work.push((entry, b));
    }
    if work.is_empty() {
        return;
    }
    codec.yield_to_prepares();
    Python::attach(|py| {
        let items: Vec<_> = work.iter().map(|(e, b)| (&e.decoder, b.tokens.as_slice(), b.finish)).collect();
        match codec.decode(py, &items) {
            Ok(decoded) => {
                for ((entry, b), d) in work.iter().zip(decoded) {
                    if finish_one(link, entry, d.state, d.bytes.freeze()) {
                        metrics.e2e.observe(entry.arrival.elapsed().as_secs_f64());
                        let reason = if b.finish == FINISH_LENGTH { "length" } else { "stop" };
                        metrics.success.with_label_values(&[reason]).inc();
                        entry.log_end(200, reason);
                    }
                }
            }
            Err(err) => {
                err.print(py);
                tracing::error!(rank = link.index, "decode_batch raised: {err}");
                for (entry, _) in &work {
                    if let Some(e) = link.take(entry.id) {
                        link.send_abort(e.id); // the rank would otherwise keep generating for nobody
                        e.log_end(500, "internal_error");
                        e.outlet.fail(ApiError::Internal);
                    }
                }
            }
        }
        drop(work); // release decoder references while attached
    });
}

/// Hand decoded bytes to the request; true if this ended it.
fn finish_one(link: &RankLink, entry: &Inflight, state: DecodeState, bytes: Bytes) -> bool {
    match state {
        DecodeState::Running => {
            if let Outlet::Stream(s) = &entry.outlet
                && !bytes.is_empty()
            {
                s.push(&bytes, false);
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
            match &entry.outlet {
                Outlet::Stream(s) => s.with_buf(true, |buf| {
                    buf.extend_from_slice(&bytes);
                    buf.extend_from_slice(DONE);
                }),
                unary => unary.complete(bytes),
            }
            true
        }
    }
}

//! A request in flight on a rank: what its rank's output thread needs to deliver its tokens (its decoder and outlet),
//! the tokens it holds for a later decode, its timing, and its admission slot until it leaves its rank.

use crate::admission::Permit;
use crate::error::ApiError;
use crate::ring::records;
use crate::stream::{Deliver, Outlet};
use crate::trace::{Outcome, RequestTrace};
use crate::ttft::Stamps;
use bytes::Bytes;
use pyo3::prelude::*;
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
    pub(super) held: Mutex<Held>,
    /// Token timing, written by the rank_io thread only.
    pub(super) timing: Mutex<Timing>,
    /// The admission slot: freed as the request leaves its rank (`RankLink::take`), however it ends, and before
    /// its last bytes go to the client, who may send its next request the moment it has them. A client that is
    /// still (slowly) reading must not hold engine capacity either.
    pub(super) permit: Mutex<Option<Permit>>,
    /// Called with its last bytes as it succeeds, before they go to the client (a stored response is recorded),
    /// with what sends them.
    pub(super) on_finish: Mutex<Option<OnFinish>>,
    /// Its OpenTelemetry trace (`crate::trace`), when tracing is on: told of its first token and its end.
    pub trace: Option<Arc<RequestTrace>>,
    /// A client's request: `/abort_request` may end it (`RequestMeta::abortable`).
    pub abortable: bool,
}

/// What to do with a request's last bytes as it succeeds: it hands the bytes to send in their place to `Deliver`,
/// now or once something they promise is done (a stored response is in the database).
pub type OnFinish = Box<dyn FnOnce(Bytes, Deliver) + Send>;

/// Tokens held for a later decode.
#[derive(Default)]
pub(super) struct Held {
    tokens: Vec<u32>,
    logprobs: Option<TokenLogprobs>,
    /// The prompt's logprobs, until the first decode hands them to the decoder.
    prompt_logprobs: Option<Vec<u8>>,
}

/// The logprobs of a run of tokens merged across engine steps, owned: the output record's byte layout
/// (`ring::records::Logprobs`) with each token's own count of alternatives. One request's steps may carry
/// different counts (an engine that finds fewer candidates than asked for at some step), so the count is kept per
/// token rather than per run: a run is never read with another step's stride.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenLogprobs {
    pub values: Vec<u8>,
    pub alternatives: Vec<u8>,
    /// Alternatives per token, one per value.
    pub counts: Vec<u16>,
}

impl TokenLogprobs {
    pub fn extend(&mut self, other: &TokenLogprobs) {
        self.values.extend_from_slice(&other.values);
        self.alternatives.extend_from_slice(&other.alternatives);
        self.counts.extend_from_slice(&other.counts);
    }

    pub fn extend_from_record(&mut self, lp: &records::Logprobs<'_>) {
        let n = lp.values.len() / 4;
        self.values.extend_from_slice(lp.values);
        self.alternatives.extend_from_slice(lp.alternatives);
        self.counts.extend(std::iter::repeat_n(lp.top as u16, n));
    }

    pub fn view(&self) -> records::LogprobsRun<'_> {
        records::LogprobsRun { values: &self.values, alternatives: &self.alternatives, counts: &self.counts }
    }
}

#[derive(Default)]
pub(super) struct Timing {
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: usize,
    /// When the last token event with visible output left for the client.
    sent: Option<Instant>,
}

impl Inflight {
    /// End the request with its last bytes: through its finish hook, if it has one (a stored response is written
    /// before the client has its end), else to the client now.
    pub fn finish(&self, last: Bytes) {
        let deliver = self.outlet.last_bytes();
        match self.on_finish.lock().unwrap().take() {
            Some(f) => f(last, deliver),
            None => deliver(Ok(last)),
        }
    }

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
            held.logprobs.get_or_insert_with(TokenLogprobs::default).extend(lp);
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
            held.logprobs.get_or_insert_with(TokenLogprobs::default).extend(lp);
        }
        (held.tokens, held.logprobs.or(logprobs))
    }

    /// Free the admission slot now, before the client hears the request ended: a client that sends its next
    /// request the moment it has the answer must find the slot free, not wait for the last reference to go.
    pub fn release_slot(&self) {
        self.permit.lock().unwrap().take();
    }

    /// End it with `err` before its rank finished it: the log line, then the error to its client (a stream's error
    /// event and `[DONE]`, else the door's envelope). The one place a request ends in an error; its caller took it
    /// off its rank (`RankLink::take`), so it ends once.
    pub fn fail(&self, err: ApiError) {
        let code = err.code();
        self.fail_as(err, code);
    }

    /// `fail`, logged under `reason` (the engine's finish reason, finer than the error's code).
    pub fn fail_as(&self, err: ApiError, reason: &str) {
        self.log_end(err.status().as_u16(), reason);
        self.outlet.fail(err);
    }

    /// One structured log line for the request's end, and the end of its trace.
    pub fn log_end(&self, status: u16, reason: &str) {
        let t = self.timing.lock().unwrap();
        let ttft_ms = t.first.map(|f| (f - self.arrival).as_secs_f64() * 1e3);
        let trace_id = self.trace.as_ref().map(|trace| {
            trace.ended(Outcome {
                status,
                reason: reason.to_string(),
                rank: Some(self.rank),
                prompt_tokens: Some(self.prompt_tokens),
                output_tokens: Some(t.tokens),
                last_token: t.last,
            });
            tracing::field::display(trace.trace_id())
        });
        tracing::info!(
            target: "deepinfer_server::request",
            request_id = %self.request_id,
            trace_id,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::Admission;
    use crate::doors::Door;
    use crate::stream::StreamBuf;

    fn entry(outlet: Outlet, admission: &Admission) -> Inflight {
        let now = Instant::now();
        Inflight {
            id: 1,
            request_id: "r".into(),
            rank: 0,
            prompt_tokens: 3,
            decoder: Python::attach(|py| py.None()),
            outlet,
            arrival: now,
            stamps: Stamps::new(now, now, now),
            incremental: true,
            held: Mutex::default(),
            timing: Mutex::default(),
            permit: Mutex::new(Some(admission.try_admit().unwrap())),
            on_finish: Mutex::default(),
            trace: None,
            abortable: true,
        }
    }

    #[test]
    fn failing_ends_the_request_once_in_its_doors_words() {
        let admission = Admission::new(1);
        let (outlet, mut rx) = Outlet::unary();
        let e = entry(outlet, &admission);
        e.release_slot();
        assert_eq!(admission.in_flight(), 0, "the slot is free before the client hears");
        e.fail_as(ApiError::from_engine("prompt_length_exceeded").0, "prompt_length_exceeded");
        e.fail(ApiError::Internal); // a second ending finds nobody to tell
        let err = rx.try_recv().unwrap().unwrap_err();
        assert_eq!((err.status().as_u16(), err.code()), (400, "context_length_exceeded"));

        let buf = StreamBuf::new(Door::Messages, 1 << 16);
        let e = entry(Outlet::Stream(buf.clone()), &admission);
        e.fail(ApiError::Unavailable("rank 0 died".into()));
        assert!(buf.is_done());
    }

    #[test]
    fn held_tokens_come_back_before_new_ones() {
        let admission = Admission::new(1);
        let e = entry(Outlet::unary().0, &admission);
        let mut lp = TokenLogprobs::default();
        lp.extend_from_record(&records::Logprobs { top: 0, values: &1f32.to_le_bytes(), alternatives: &[] });
        e.hold(&[1], Some(&lp));
        e.keep_prompt_logprobs(vec![0; 4]);
        let (tokens, logprobs) = e.held_then(vec![2], Some(lp.clone()));
        assert_eq!(tokens, [1, 2]);
        assert_eq!(logprobs.unwrap().values.len(), 8);
        assert_eq!(e.take_prompt_logprobs(), Some(vec![0; 4]), "left for the decode");
        assert_eq!(e.held_then(vec![3], None).0, [3]);
    }
}

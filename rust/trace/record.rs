//! What a traced request notes on its way: what it asked for, its TTFT stages at its first token, how it ended,
//! and when its response's last byte left. Two parties end a request, in either order: its outcome (the request
//! log line: `Inflight::log_end`, or a refusal) and its response (`ResponseGuard`, dropped with the body). The
//! second hands the record to the export thread, which builds the spans (`spans`); nothing is built here.

use super::export::Sink;
use opentelemetry::trace::{SpanContext, SpanId, TraceId, TraceState};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// The request span's ids, chosen as it arrives so that its log lines can name the trace.
pub(super) struct Ids {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub parent: Option<SpanContext>,
    pub trace_state: TraceState,
}

/// How a request ended, as its log line says it.
pub struct Outcome {
    pub status: u16,
    /// The finish reason (`stop`, `length`) or the error code (`queue_full`, `client_disconnect`, ...).
    pub reason: String,
    pub rank: Option<usize>,
    pub prompt_tokens: Option<usize>,
    pub output_tokens: Option<usize>,
    /// When its last token was read.
    pub last_token: Option<Instant>,
}

impl Outcome {
    /// A request that never reached a rank: refused (`status`, the error's code), or answered without one.
    pub fn of(status: u16, code: &str) -> Self {
        let reason = code.to_string();
        Outcome { status, reason, rank: None, prompt_tokens: None, output_tokens: None, last_token: None }
    }
}

#[derive(Default)]
pub(super) struct Record {
    pub model: Option<String>,
    pub response_id: Option<String>,
    /// max_tokens, temperature, top_p, as the codec set them for the engine.
    pub sampling: Option<(u32, f32, f32)>,
    pub reasoning_tokens: Option<u64>,
    /// The TTFT stages (`Stamps::stages`) and when the first token was read.
    pub stages: Vec<(&'static str, Duration)>,
    pub first_token: Option<Instant>,
    /// When the first token's event was written (streams): the `sse` stage.
    pub sse_written: Option<Instant>,
    pub outcome: Option<Outcome>,
    /// When the response's last byte was handed to the connection (or the response was dropped), and whether the
    /// client took it whole.
    pub responded: Option<(Instant, bool)>,
    sent: bool,
}

/// A request's trace. Unsampled (`sink` None), it only names its trace id; it records nothing.
pub struct RequestTrace {
    pub(super) ids: Ids,
    sink: Option<Arc<Sink>>,
    pub(super) start: Instant,
    /// `start` on the wall clock: spans carry wall-clock times, the stamps are `Instant`s.
    pub(super) wall: SystemTime,
    pub(super) operation: &'static str,
    pub(super) route: &'static str,
    pub(super) request_id: String,
    pub(super) record: Mutex<Record>,
}

impl RequestTrace {
    pub(super) fn new(
        ids: Ids,
        sink: Option<Arc<Sink>>,
        start: Instant,
        operation: &'static str,
        route: &'static str,
        request_id: &str,
    ) -> Arc<Self> {
        let wall = SystemTime::now() - start.elapsed();
        let request_id = if sink.is_some() { request_id.to_string() } else { String::new() };
        Arc::new(RequestTrace { ids, sink, start, wall, operation, route, request_id, record: Mutex::default() })
    }

    /// The trace id, for the request's log lines (displayed as 32 hex digits, only if the line is written).
    pub fn trace_id(&self) -> TraceId {
        self.ids.trace_id
    }

    fn note(&self, f: impl FnOnce(&mut Record)) {
        if self.sink.is_some() {
            f(&mut self.record.lock().unwrap());
        }
    }

    pub fn requested(&self, model: &str, response_id: &str) {
        self.note(|r| {
            r.model = Some(model.to_string());
            r.response_id = Some(response_id.to_string());
        });
    }

    pub fn sampling(&self, max_tokens: u32, temperature: f32, top_p: f32) {
        self.note(|r| r.sampling = Some((max_tokens, temperature, top_p)));
    }

    pub fn first_token(&self, at: Instant, stages: Vec<(&'static str, Duration)>) {
        self.note(|r| {
            r.first_token = Some(at);
            r.stages = stages;
        });
    }

    pub fn sse_written(&self, at: Instant) {
        self.note(|r| r.sse_written = Some(at));
    }

    pub fn reasoning_tokens(&self, n: u64) {
        self.note(|r| r.reasoning_tokens = Some(n));
    }

    pub fn wants_reasoning_tokens(&self) -> bool {
        self.sink.is_some()
    }

    /// The request ended (its log line): half of what sends the record.
    pub fn ended(self: &Arc<Self>, outcome: Outcome) {
        self.finish(|r| r.outcome = Some(outcome));
    }

    fn finish(self: &Arc<Self>, f: impl FnOnce(&mut Record)) {
        let Some(sink) = &self.sink else { return };
        let count = {
            let mut r = self.record.lock().unwrap();
            f(&mut r);
            if r.sent || r.outcome.is_none() || r.responded.is_none() {
                return;
            }
            r.sent = true;
            super::spans::count(&r)
        };
        sink.send(self.clone(), count);
    }
}

/// Held by whatever sends the response (the handler, then its body): dropped as the last byte leaves, or as the
/// client goes away, it records when, the other half of what sends the record.
pub struct ResponseGuard {
    trace: Arc<RequestTrace>,
    complete: bool,
}

impl ResponseGuard {
    pub fn new(trace: Arc<RequestTrace>) -> Self {
        ResponseGuard { trace, complete: false }
    }

    /// The client has the whole response.
    pub fn complete(&mut self) {
        self.complete = true;
    }
}

impl Drop for ResponseGuard {
    fn drop(&mut self) {
        let at = (Instant::now(), self.complete);
        self.trace.finish(|r| r.responded = Some(at));
    }
}

//! What a traced request notes on its way: what it asked for, its TTFT stages at its first token, how it ended,
//! and when its response's last byte left. Two parties end a request, in either order: its outcome (the request
//! log line: `Inflight::log_end`, or a refusal) and its response (`ResponseGuard`, dropped with the body). The
//! second hands the record to the export thread, which builds the spans (`spans`); nothing is built here. The
//! first outcome counts, and nothing changes once the record is sent: a handler that also reports an error the
//! request's log line already ended with adds nothing, and cannot race the export thread.

use super::export::Sink;
use opentelemetry::KeyValue;
use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// The request span's ids, chosen as it arrives so that its log lines can name the trace.
pub(super) struct Ids {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub parent: Option<SpanContext>,
    pub trace_state: TraceState,
}

/// What a span stands for.
pub(super) enum Origin {
    /// An HTTP request: a SERVER span, a child of the caller's span if it sent one.
    Request { route: &'static str },
    /// Work a request left to run later (a background response's run, a batch line): an INTERNAL span, the root of
    /// a trace of its own, linked to the span of the request that created it (when that one was traced).
    Linked { creator: Option<SpanContext> },
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
    /// Attributes of its own (a batch line's batch and custom_id, a background response's flag).
    pub attributes: Vec<KeyValue>,
    /// Why the server stopped it, when it did (`stopped_by`): its `error.type`, rather than the client disconnect
    /// its abort looks like to the request path.
    pub cause: Option<&'static str>,
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
    pub(super) origin: Origin,
    pub(super) request_id: String,
    pub(super) record: Mutex<Record>,
}

impl RequestTrace {
    pub(super) fn new(
        ids: Ids,
        sink: Option<Arc<Sink>>,
        start: Instant,
        operation: &'static str,
        origin: Origin,
        request_id: &str,
        attributes: Vec<KeyValue>,
    ) -> Arc<Self> {
        let wall = SystemTime::now() - start.elapsed();
        let request_id = if sink.is_some() { request_id.to_string() } else { String::new() };
        let record = Mutex::new(Record { attributes, ..Record::default() });
        Arc::new(RequestTrace { ids, sink, start, wall, operation, origin, request_id, record })
    }

    /// The trace id, for the request's log lines (displayed as 32 hex digits, only if the line is written).
    pub fn trace_id(&self) -> TraceId {
        self.ids.trace_id
    }

    /// Its span, as work it leaves behind links to it (sampled or not: the flag carries its sampling decision).
    pub fn span_context(&self) -> SpanContext {
        let flags = if self.sink.is_some() { TraceFlags::SAMPLED } else { TraceFlags::default() };
        SpanContext::new(self.ids.trace_id, self.ids.span_id, flags, false, self.ids.trace_state.clone())
    }

    pub fn attribute(&self, kv: KeyValue) {
        self.note(|r| r.attributes.push(kv));
    }

    /// The server is stopping it for `cause` (a batch line given up to a client's request, a cancelled background
    /// response), before the request path ends it as a disconnect; nothing once it ended.
    pub fn stopped_by(&self, cause: &'static str) {
        self.note(|r| {
            if r.outcome.is_none() {
                r.cause = Some(cause);
            }
        });
    }

    fn note(&self, f: impl FnOnce(&mut Record)) {
        if self.sink.is_some() {
            let mut r = self.record.lock().unwrap();
            if !r.sent {
                f(&mut r);
            }
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
        self.finish(|r| {
            r.outcome.get_or_insert(outcome);
        });
    }

    /// End it now unless it ended already: for a task that was dropped before its request did (a background
    /// response cancelled while it waited for a slot).
    pub fn end_unless_ended(self: &Arc<Self>, outcome: Outcome) {
        self.ended(outcome);
        drop(ResponseGuard::new(self.clone()));
    }

    fn finish(self: &Arc<Self>, f: impl FnOnce(&mut Record)) {
        let Some(sink) = &self.sink else { return };
        let count = {
            let mut r = self.record.lock().unwrap();
            if r.sent {
                return;
            }
            f(&mut r);
            if r.outcome.is_none() || r.responded.is_none() {
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

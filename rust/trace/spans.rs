//! A finished request's record as span data, on the export thread: the request span (a SERVER span with the
//! OpenTelemetry `gen_ai` attributes, never prompt or output text; or, for work a request left behind, an
//! INTERNAL root span linked to that request's span) and its children, built after the fact with explicit times.
//! The TTFT stages tile arrival → first token exactly (they are `Stamps::stages`), `decode` tiles first → last
//! token and `stream` last token → last byte written, so the children cover the span end to end; `sse` (first
//! token read → its event written) overlaps `decode`.
//!
//! Status, as OpenTelemetry's HTTP conventions have it for a server: Error only for a failure of the server's
//! (5xx); a refusal of the client's request (4xx, 429 included) and a client that went away (499) leave it Unset,
//! and say what happened in `error.type` (the error's code) beside the status code.

use super::record::{Origin, Record, RequestTrace};
use opentelemetry::trace::{Event, Link, SpanContext, SpanId, SpanKind, Status, TraceFlags};
use opentelemetry::{InstrumentationScope, KeyValue, Value};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SpanData, SpanEvents, SpanLinks};
use std::time::Instant;
#[cfg(test)]
use std::time::SystemTime;

/// The DeepSeek models this server runs (`gen_ai.provider.name`'s well-known value).
const PROVIDER: &str = "deepseek";

/// How many spans a record makes (for the drop counter when the queue is full).
pub(super) fn count(r: &Record) -> u64 {
    let first = r.first_token.is_some() as u64;
    let sse = (first == 1 && r.sse_written.is_some()) as u64;
    1 + r.stages.len() as u64 + sse + 2 * first
}

/// The request span, then its children in time order.
pub(super) fn build(t: &RequestTrace, scope: &InstrumentationScope) -> Vec<SpanData> {
    let r = t.record.lock().unwrap();
    let at = |i: Instant| match i.checked_duration_since(t.start) {
        Some(d) => t.wall + d,
        None => t.wall - (t.start - i),
    };
    let outcome = r.outcome.as_ref();
    let last = r.first_token.map(|first| outcome.and_then(|o| o.last_token).unwrap_or(first).max(first));
    // The last byte leaves after the last token; clocks read on two threads may say otherwise by microseconds.
    let (end, complete) = r.responded.unwrap_or((t.start, false));
    let end = end.max(last.unwrap_or(end));
    let status = outcome.map_or(0, |o| o.status);
    // A stop the server chose is not the client disconnect the request path saw.
    let reason = r.cause.unwrap_or_else(|| outcome.map_or("", |o| o.reason.as_str()));
    let disconnected = r.cause.is_none() && (reason == "client_disconnect" || (status == 200 && !complete));

    let mut attrs =
        vec![KeyValue::new("gen_ai.operation.name", t.operation), KeyValue::new("gen_ai.provider.name", PROVIDER)];
    let (kind, parent, links) = match &t.origin {
        Origin::Request { route } => {
            attrs.push(KeyValue::new("http.request.method", "POST"));
            attrs.push(KeyValue::new("http.route", *route));
            attrs.push(KeyValue::new("http.response.status_code", status as i64));
            (SpanKind::Server, t.ids.parent.as_ref(), Vec::new())
        }
        Origin::Linked { creator } => {
            // No HTTP exchange of its own: the status its request would have had (a batch line's `status_code`).
            attrs.push(KeyValue::new("deepinfer.status_code", status as i64));
            (SpanKind::Internal, None, creator.iter().cloned().map(Link::with_context).collect())
        }
    };
    attrs.push(KeyValue::new("deepinfer.request_id", t.request_id.clone()));
    attrs.extend(r.attributes.iter().cloned());
    if let Some(model) = &r.model {
        attrs.push(KeyValue::new("gen_ai.request.model", model.clone()));
        attrs.push(KeyValue::new("gen_ai.response.model", model.clone()));
    }
    if let Some(id) = &r.response_id {
        attrs.push(KeyValue::new("gen_ai.response.id", id.clone()));
    }
    if let Some((max_tokens, temperature, top_p)) = r.sampling {
        attrs.push(KeyValue::new("gen_ai.request.max_tokens", max_tokens as i64));
        attrs.push(KeyValue::new("gen_ai.request.temperature", temperature as f64));
        attrs.push(KeyValue::new("gen_ai.request.top_p", top_p as f64));
    }
    if let Some(o) = outcome {
        let mut push = |k: &'static str, v: Option<usize>| v.map(|v| attrs.push(KeyValue::new(k, v as i64)));
        push("deepinfer.dp_rank", o.rank);
        push("gen_ai.usage.input_tokens", o.prompt_tokens);
        push("gen_ai.usage.output_tokens", o.output_tokens);
        if status == 200 && !o.reason.is_empty() {
            let reasons = Value::Array(vec![opentelemetry::StringValue::from(o.reason.clone())].into());
            attrs.push(KeyValue::new("gen_ai.response.finish_reasons", reasons));
        }
    }
    if let Some(n) = r.reasoning_tokens {
        attrs.push(KeyValue::new("gen_ai.usage.reasoning.output_tokens", n as i64));
    }
    if let Some(first) = r.first_token {
        // vLLM's names for the same figures, in seconds.
        attrs.push(KeyValue::new("gen_ai.latency.time_to_first_token", (first - t.start).as_secs_f64()));
    }
    attrs.push(KeyValue::new("gen_ai.latency.e2e", end.saturating_duration_since(t.start).as_secs_f64()));

    let mut events = SpanEvents::default();
    let mut span_status = Status::Unset;
    if status >= 400 || status == 0 {
        attrs.push(KeyValue::new("error.type", reason.to_string()));
    }
    if status >= 500 || status == 0 {
        span_status = Status::error(format!("{status} {reason}"));
    }
    if status == 429 {
        let why = vec![KeyValue::new("deepinfer.rejection.reason", reason.to_string())];
        events.events.push(Event::new("rejected", at(end), why, 0));
    }
    if disconnected {
        attrs.push(KeyValue::new("deepinfer.client_disconnected", true));
        events.events.push(Event::new("client_disconnect", at(end), Vec::new(), 0));
    }

    let sampled = TraceFlags::SAMPLED;
    let ctx = SpanContext::new(t.ids.trace_id, t.ids.span_id, sampled, false, t.ids.trace_state.clone());
    let name = match &r.model {
        Some(model) => format!("{} {model}", t.operation),
        None => t.operation.to_string(),
    };
    let mut linked = SpanLinks::default();
    linked.links = links;
    let mut spans = vec![SpanData {
        span_context: ctx,
        parent_span_id: parent.map_or(SpanId::INVALID, SpanContext::span_id),
        parent_span_is_remote: parent.is_some(),
        span_kind: kind,
        name: name.into(),
        start_time: t.wall,
        end_time: at(end),
        attributes: attrs,
        dropped_attributes_count: 0,
        events,
        links: linked,
        status: span_status,
        instrumentation_scope: scope.clone(),
    }];

    let ids = RandomIdGenerator::default();
    let mut child = |name: &'static str, from: Instant, to: Instant| {
        let ctx = SpanContext::new(t.ids.trace_id, ids.new_span_id(), sampled, false, t.ids.trace_state.clone());
        spans.push(SpanData {
            span_context: ctx,
            parent_span_id: t.ids.span_id,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: name.into(),
            start_time: at(from),
            end_time: at(to.max(from)),
            attributes: Vec::new(),
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: scope.clone(),
        });
    };
    let mut from = t.start;
    for (stage, d) in &r.stages {
        child(stage, from, from + *d);
        from += *d;
    }
    if let (Some(first), Some(last)) = (r.first_token, last) {
        if let Some(written) = r.sse_written {
            child("sse", first, written);
        }
        child("decode", first, last);
        child("stream", last, end);
    }
    spans
}

/// A wall-clock time from an `Instant`, given one moment on both clocks (tests).
#[cfg(test)]
fn wall_at(start: Instant, wall: SystemTime, i: Instant) -> SystemTime {
    wall + i.duration_since(start)
}

#[cfg(test)]
mod tests {
    use super::super::record::{Ids, Outcome, ResponseGuard};
    use super::*;
    use opentelemetry::trace::{TraceId, TraceState};
    use std::sync::Arc;
    use std::time::Duration;

    fn traced_as(origin: Origin) -> Arc<RequestTrace> {
        let ids = Ids {
            trace_id: TraceId::from(7u128),
            span_id: SpanId::from(9u64),
            parent: None,
            trace_state: TraceState::default(),
        };
        let sink = super::super::export::Sink::for_tests();
        RequestTrace::new(ids, Some(sink), Instant::now(), "chat", origin, "req-1", Vec::new())
    }

    fn traced() -> Arc<RequestTrace> {
        traced_as(Origin::Request { route: "/v1/chat/completions" })
    }

    /// The request span of a trace that ended `status` with `reason`, its response sent.
    fn ended(t: &Arc<RequestTrace>, status: u16, reason: &str) -> SpanData {
        t.ended(Outcome::of(status, reason));
        drop(ResponseGuard::new(t.clone()));
        build(t, &InstrumentationScope::builder("test").build()).remove(0)
    }

    fn attr<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
        span.attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| &kv.value)
    }

    #[test]
    fn only_a_server_failure_is_an_error_and_a_refusal_says_what_it_was() {
        for (status, code) in [(400, "invalid_request_error"), (429, "queue_full"), (499, "client_disconnect")] {
            let span = ended(&traced(), status, code);
            assert_eq!(span.status, Status::Unset, "{status}");
            assert_eq!(attr(&span, "error.type"), Some(&Value::from(code)), "{status}");
            assert_eq!(attr(&span, "http.response.status_code"), Some(&Value::I64(status as i64)));
        }
        let span = ended(&traced(), 503, "service_unavailable");
        assert_eq!(span.status, Status::error("503 service_unavailable"));
        let span = ended(&traced(), 200, "stop");
        assert_eq!((span.status.clone(), attr(&span, "error.type")), (Status::Unset, None));
    }

    #[test]
    fn linked_work_is_an_internal_root_linked_to_its_creator() {
        let creator = SpanContext::new(
            TraceId::from(1u128),
            SpanId::from(2u64),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        let t = traced_as(Origin::Linked { creator: Some(creator.clone()) });
        t.attribute(KeyValue::new("deepinfer.batch.custom_id", "c1"));
        t.stopped_by("batch_preempted");
        let span = ended(&t, 499, "client_disconnect");
        assert_eq!((span.span_kind.clone(), span.parent_span_id), (SpanKind::Internal, SpanId::INVALID));
        assert_eq!(span.links.links.len(), 1);
        assert_eq!(span.links.links[0].span_context, creator);
        assert_eq!(attr(&span, "deepinfer.batch.custom_id"), Some(&Value::from("c1")));
        assert_eq!(attr(&span, "deepinfer.status_code"), Some(&Value::I64(499)));
        assert!(attr(&span, "http.route").is_none() && attr(&span, "http.response.status_code").is_none());
        // The server stopped it: its cause, not a client disconnect, and not a failure.
        assert_eq!(attr(&span, "error.type"), Some(&Value::from("batch_preempted")));
        assert!(attr(&span, "deepinfer.client_disconnected").is_none() && span.status == Status::Unset);
    }

    #[test]
    fn the_first_ending_counts_and_a_sent_record_stays_as_sent() {
        let t = traced();
        t.ended(Outcome::of(500, "engine_error"));
        t.ended(Outcome::of(400, "invalid_request_error"));
        drop(ResponseGuard::new(t.clone()));
        t.stopped_by("cancelled");
        t.attribute(KeyValue::new("late", true));
        let span = build(&t, &InstrumentationScope::builder("test").build()).remove(0);
        assert_eq!(attr(&span, "error.type"), Some(&Value::from("engine_error")));
        assert!(attr(&span, "late").is_none());
    }

    #[test]
    fn stages_tile_the_span_from_arrival_to_the_last_byte() {
        let t = traced();
        let ms = |n: u64| t.start + Duration::from_millis(n);
        t.requested("m", "chatcmpl-1");
        t.sampling(16, 0.5, 0.9);
        t.first_token(ms(10), vec![("parse", Duration::from_millis(1)), ("engine", Duration::from_millis(9))]);
        t.sse_written(ms(11));
        let outcome = |last| Outcome {
            status: 200,
            reason: "stop".into(),
            rank: Some(0),
            prompt_tokens: Some(5),
            output_tokens: Some(3),
            last_token: Some(last),
        };
        t.ended(outcome(ms(30)));
        let mut guard = ResponseGuard::new(t.clone());
        guard.complete();
        drop(guard);
        let spans = build(&t, &InstrumentationScope::builder("test").build());
        let names: Vec<_> = spans.iter().map(|s| s.name.to_string()).collect();
        assert_eq!(names, ["chat m", "parse", "engine", "sse", "decode", "stream"]);
        assert_eq!(count(&t.record.lock().unwrap()), spans.len() as u64);
        let root = &spans[0];
        assert_eq!(root.start_time, spans[1].start_time);
        assert_eq!(spans[2].end_time, wall_at(t.start, t.wall, ms(10)), "the stages end at the first token");
        assert_eq!(spans[4].end_time, spans[5].start_time);
        assert_eq!(spans[5].end_time, root.end_time);
        assert!(spans[1..].iter().all(|s| s.parent_span_id == root.span_context.span_id()));
        assert_eq!(root.status, Status::Unset);
        let keys: Vec<_> = root.attributes.iter().map(|kv| kv.key.as_str()).collect();
        for k in ["gen_ai.request.model", "gen_ai.request.max_tokens", "gen_ai.response.finish_reasons"] {
            assert!(keys.contains(&k), "{k} in {keys:?}");
        }
    }
}

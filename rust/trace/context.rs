//! Context in: the W3C `traceparent` / `tracestate` a client (or its gateway) sent, read with OpenTelemetry's own
//! propagator, so a request's span joins the caller's trace. And context kept: a span stored as the same two
//! headers (a batch's creating request, which its lines link to wherever and whenever they run).

use axum::http::HeaderMap;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanContext, TraceContextExt};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use std::collections::HashMap;

struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The caller's span, if the request carries a valid `traceparent`; a malformed one is ignored (a new trace
/// starts), as the W3C recommendation says.
pub fn parent_from(headers: &HeaderMap) -> Option<SpanContext> {
    if !headers.contains_key("traceparent") {
        return None;
    }
    let cx = TraceContextPropagator::new().extract_with_context(&opentelemetry::Context::new(), &Headers(headers));
    let span = cx.span().span_context().clone();
    span.is_valid().then_some(span)
}

/// A span as text to store: its `traceparent` (the flags carry its sampling decision), then its `tracestate` on a
/// second line if it has one.
pub fn stored(span: &SpanContext) -> String {
    let mut headers = HashMap::new();
    let cx = opentelemetry::Context::new().with_remote_span_context(span.clone());
    TraceContextPropagator::new().inject_context(&cx, &mut headers);
    let parent = headers.remove("traceparent").unwrap_or_default();
    match headers.remove("tracestate").filter(|s| !s.is_empty()) {
        Some(state) => format!("{parent}\n{state}"),
        None => parent,
    }
}

/// A stored span back (remote: it may come from another replica, or from before a restart); None if the text is
/// not one.
pub fn from_stored(text: &str) -> Option<SpanContext> {
    let (parent, state) = text.split_once('\n').unwrap_or((text, ""));
    let headers = HashMap::from([("traceparent".to_string(), parent.to_string()), ("tracestate".into(), state.into())]);
    let cx = TraceContextPropagator::new().extract_with_context(&opentelemetry::Context::new(), &headers);
    let span = cx.span().span_context().clone();
    span.is_valid().then_some(span)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_span_comes_back_with_its_flags_and_state() {
        use opentelemetry::trace::{SpanId, TraceFlags, TraceId, TraceState};
        let state = TraceState::from_key_value([("vendor", "x y")]).unwrap();
        let span = SpanContext::new(TraceId::from(7u128), SpanId::from(9u64), TraceFlags::SAMPLED, false, state);
        let text = stored(&span);
        assert_eq!(text, "00-00000000000000000000000000000007-0000000000000009-01\nvendor=x y");
        let back = from_stored(&text).unwrap();
        assert_eq!((back.trace_id(), back.span_id(), back.is_sampled()), (span.trace_id(), span.span_id(), true));
        assert_eq!(back.trace_state().get("vendor"), Some("x y"));
        let unsampled =
            SpanContext::new(TraceId::from(7u128), SpanId::from(9u64), TraceFlags::default(), false, TraceState::NONE);
        let back = from_stored(&stored(&unsampled)).unwrap();
        assert!(!back.is_sampled() && back.trace_state().header().is_empty());
        assert!(from_stored("garbage").is_none());
    }

    #[test]
    fn a_valid_traceparent_is_the_parent_and_a_bad_one_is_ignored() {
        let mut h = HeaderMap::new();
        assert!(parent_from(&h).is_none());
        h.insert("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".parse().unwrap());
        h.insert("tracestate", "vendor=x".parse().unwrap());
        let p = parent_from(&h).unwrap();
        assert_eq!(p.trace_id().to_string(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(p.span_id().to_string(), "b7ad6b7169203331");
        assert!(p.is_sampled() && p.is_remote());
        assert_eq!(p.trace_state().get("vendor"), Some("x"));
        h.insert("traceparent", "00-00000000000000000000000000000000-b7ad6b7169203331-01".parse().unwrap());
        assert!(parent_from(&h).is_none(), "an all-zero trace id is invalid");
        h.insert("traceparent", "garbage".parse().unwrap());
        assert!(parent_from(&h).is_none());
    }
}

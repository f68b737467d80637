//! Context in: the W3C `traceparent` / `tracestate` a client (or its gateway) sent, read with OpenTelemetry's own
//! propagator, so a request's span joins the caller's trace.

use axum::http::HeaderMap;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanContext, TraceContextExt};
use opentelemetry_sdk::propagation::TraceContextPropagator;

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

#[cfg(test)]
mod tests {
    use super::*;

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

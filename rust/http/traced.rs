//! A request's trace, started as its handler runs: the caller's `traceparent` read from the head, the ids and the
//! sampling decision. With tracing off the extractor reads nothing and is `None`.

use super::AppState;
use super::request_id::RequestId;
use crate::trace::{RequestTrace, ResponseGuard};
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

/// The caller's span context, if tracing is on (and the request id, which the trace records).
pub struct TraceParent(Option<(Option<opentelemetry::trace::SpanContext>, String)>);

impl FromRequestParts<Arc<AppState>> for TraceParent {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, st: &Arc<AppState>) -> Result<Self, Infallible> {
        if st.traces.is_none() {
            return Ok(TraceParent(None));
        }
        let id = parts.extensions.get::<RequestId>().map(|r| r.0.clone()).unwrap_or_default();
        Ok(TraceParent(Some((crate::trace::parent_from(&parts.headers), id))))
    }
}

impl TraceParent {
    /// Start the request's trace at `arrival` (the moment its TTFT counts from): the trace, and the guard that ends
    /// it with the response.
    pub fn begin(self, st: &AppState, arrival: Instant, operation: &'static str, route: &'static str) -> Traced {
        let (traces, (parent, id)) = (st.traces.as_ref()?, self.0?);
        let t = traces.begin(parent, arrival, operation, route, &id);
        Some((t.clone(), ResponseGuard::new(t)))
    }
}

/// A request's trace and the guard that ends it with its response, when traces are on.
pub type Traced = Option<(Arc<RequestTrace>, ResponseGuard)>;

//! A request's trace, started as its handler runs: the caller's `traceparent` read from the head, the ids and the
//! sampling decision. With tracing off the extractor reads nothing and is `None`.

use super::AppState;
use super::request_id::RequestId;
use super::route_state::RouteState;
use crate::error::ApiError;
use crate::trace::{Outcome, ResponseGuard};
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::response::Response;
use std::convert::Infallible;
use std::time::Instant;

/// The caller's span context, if tracing is on (and the request id, which the trace records).
pub struct TraceParent(Option<(Option<opentelemetry::trace::SpanContext>, String)>);

impl FromRequestParts<RouteState> for TraceParent {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, routes: &RouteState) -> Result<Self, Infallible> {
        if routes.path.traces.is_none() {
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

pub use crate::trace::Traced;

/// The response of a request that never reaches a rank (a span without stages), and the end of its trace: the
/// status and error code it answers with. `respond` writes an error in its door's envelope.
pub fn answered(
    traced: Traced,
    result: Result<Response, ApiError>,
    respond: impl FnOnce(ApiError) -> Response,
) -> Response {
    if let Some((trace, mut guard)) = traced {
        let (status, code) = result.as_ref().map_or_else(|e| (e.status().as_u16(), e.code()), |_| (200, ""));
        trace.ended(Outcome::of(status, code));
        guard.complete();
    }
    result.unwrap_or_else(respond)
}

/// The request's span as work it leaves behind keeps it, to link to (`crate::trace::stored`), that work's id noted
/// on the span as `key`; None with traces off.
pub fn stored_context(traced: &Traced, key: &'static str, id: &str) -> Option<String> {
    let (t, _) = traced.as_ref()?;
    t.attribute(opentelemetry::KeyValue::new(key, id.to_string()));
    Some(crate::trace::stored(&t.span_context()))
}

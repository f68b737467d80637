//! A batch line's trace, when traces are on: the root of a trace of its own, linked to the span of the request that
//! created the batch (kept with the batch, so a line run on another replica, or after a restart, links to it all
//! the same), with the batch's id and the line's `custom_id` (`crate::trace`).

use crate::doors::Door;
use crate::path::AppState;
use crate::trace::RequestTrace;
use opentelemetry::KeyValue;
use opentelemetry::trace::SpanContext;
use std::sync::Arc;
use std::time::Instant;

/// What every line of one batch links to.
pub struct LineTraces {
    creator: Option<SpanContext>,
    batch_id: String,
}

impl LineTraces {
    /// None with traces off: the lines then note nothing. `stored`: the batch row's `trace_context` (None for a
    /// batch created while traces were off: its lines' spans have no link).
    pub fn new(st: &AppState, batch_id: &str, stored: Option<&str>) -> Option<Arc<Self>> {
        st.traces.as_ref()?;
        let creator = stored.and_then(crate::trace::from_stored);
        Some(Arc::new(LineTraces { creator, batch_id: batch_id.to_string() }))
    }

    /// A line's trace, from `arrival` (the moment its TTFT counts from).
    pub fn begin(
        &self,
        st: &AppState,
        door: Door,
        custom_id: &str,
        request_id: &str,
        arrival: Instant,
    ) -> Option<Arc<RequestTrace>> {
        let attributes = vec![
            KeyValue::new("deepinfer.batch.id", self.batch_id.clone()),
            KeyValue::new("deepinfer.batch.custom_id", custom_id.to_string()),
        ];
        let traces = st.traces.as_ref()?;
        Some(traces.begin_linked(self.creator.clone(), arrival, door.operation(), request_id, attributes))
    }
}

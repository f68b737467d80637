//! OpenTelemetry traces (`--otlp-traces-endpoint`, the `OTEL_*` variables): one span per request, with a child per
//! stage, built when the request is over from the stamps it collects anyway (`crate::ttft`, its token timing) and
//! exported over OTLP on a thread of its own.
//!
//! Off (no endpoint), nothing here runs: the request path checks one `Option` per request and builds nothing. On,
//! a request pays for its ids, the sampling decision and a handful of stores; its spans are built and exported on
//! the export thread, never while a request thread waits, never with the GIL.
//!
//! Work a request leaves to run later gets a trace of its own, linked to that request's span (OpenTelemetry's
//! advice for work queued to run asynchronously: a link, not a parent, since it starts and ends on its own time):
//!
//! - a background response (Responses' `background: true`): the `POST` has its short SERVER span (its model,
//!   the response id, `deepinfer.background`); the run is an INTERNAL root span named and attributed as a request
//!   is (`chat <model>`, the `gen_ai` attributes, `gen_ai.response.id` the response's id, the TTFT stages,
//!   `decode` and `stream` as children), with `deepinfer.background = true` and a link to the `POST`'s span. It
//!   starts when the `POST` arrived: its TTFT counts from there, as its log line's does.
//! - a batch line (`/v1/batches`, `/v1/messages/batches`): the creating `POST` has its SERVER span
//!   (`create_batch`, with `deepinfer.batch.id`); its span context is stored with the batch (a W3C `traceparent`,
//!   and `tracestate`), so each line, on whichever replica runs it and whenever, is an INTERNAL root span linked to
//!   it, with `deepinfer.batch.id` and `deepinfer.batch.custom_id`.
//!
//! Such a span has no HTTP exchange of its own: it carries `deepinfer.status_code` (the status its request would
//! have had) instead of the `http.*` attributes. Its sampling: see `Traces::begin_linked`. A run the server
//! stopped (a cancel, a line given up to a client's request, a batch cancelled or expired) says so in `error.type`
//! (`cancelled`, `batch_preempted`, `batch_stopped`), not as a client disconnect.
//!
//! Status, by OpenTelemetry's HTTP conventions for servers: Error for 5xx only (the server failed); a 4xx (429
//! and a client that left, 499, included) leaves it Unset, with `http.response.status_code` and `error.type` (the
//! error's code: `invalid_request_error`, `queue_full`, `client_disconnect`, ...) saying what happened, so error
//! rates count the server's failures, not its clients'. The same rule holds for a background run and a batch line.
//!
//! `context` reads a W3C `traceparent` (and stores one), `record` is what a request notes on its way, `spans`
//! turns that into span data, `body` tells a record when the response's last byte left, `stop` names why the
//! server stopped work it ran itself, `export` is the queue, its thread and the exporter.

pub mod body;
mod context;
mod export;
mod record;
mod spans;
mod stop;

pub use context::{from_stored, parent_from, stored};
pub use export::Counters;
pub use record::{Outcome, RequestTrace, ResponseGuard};
pub use stop::StopCause;

/// A request's trace and the guard that ends it with its response, when traces are on.
pub type Traced = Option<(std::sync::Arc<RequestTrace>, ResponseGuard)>;

use opentelemetry::trace::{Link, SpanContext, SpanKind, TraceContextExt, TraceState};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Config, IdGenerator, RandomIdGenerator, SamplingDecision, ShouldSample};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The service name when neither `OTEL_SERVICE_NAME` nor `OTEL_RESOURCE_ATTRIBUTES` names one.
const SERVICE_NAME: &str = "deepinfer-server";

/// Tracing, on: the sampler, the ids, and the queue to the export thread.
pub struct Traces {
    sampler: Box<dyn ShouldSample>,
    ids: RandomIdGenerator,
    sink: Arc<export::Sink>,
    worker: Mutex<Option<export::Worker>>,
}

impl Traces {
    /// Start the export thread for `endpoint` over `protocol` (`http/protobuf` or `grpc`). The sampler comes from
    /// `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (the SDK reads them), the resource from
    /// `OTEL_SERVICE_NAME` / `OTEL_RESOURCE_ATTRIBUTES`; headers and timeout from the exporter's own variables.
    pub fn start(endpoint: &str, protocol: &str, counters: Counters) -> Result<Arc<Self>, String> {
        let shown = redacted(endpoint);
        let (sink, worker) = export::start(endpoint, &shown, protocol, resource(), counters)?;
        tracing::info!(endpoint = shown, protocol, "exporting traces over OTLP");
        Ok(Arc::new(Traces {
            sampler: Config::default().sampler,
            ids: RandomIdGenerator::default(),
            sink,
            worker: Mutex::new(Some(worker)),
        }))
    }

    /// A request's trace, from its arrival: a child of `parent` (the client's `traceparent`) when that is valid, else
    /// a new trace. Sampled or not, it has a trace id for the request's log line; only a sampled one records.
    pub fn begin(
        &self,
        parent: Option<SpanContext>,
        arrival: Instant,
        operation: &'static str,
        route: &'static str,
        request_id: &str,
    ) -> Arc<RequestTrace> {
        let parent = parent.filter(SpanContext::is_valid);
        let trace_id = parent.as_ref().map_or_else(|| self.ids.new_trace_id(), SpanContext::trace_id);
        let cx = match &parent {
            Some(p) => Context::new().with_remote_span_context(p.clone()),
            None => Context::new(),
        };
        let no_attributes: [KeyValue; 0] = [];
        let decision =
            self.sampler.should_sample(Some(&cx), trace_id, operation, &SpanKind::Server, &no_attributes, &[]);
        let sampled = decision.decision == SamplingDecision::RecordAndSample;
        let ids = record::Ids { trace_id, span_id: self.ids.new_span_id(), parent, trace_state: decision.trace_state };
        let origin = record::Origin::Request { route };
        RequestTrace::new(ids, sampled.then(|| self.sink.clone()), arrival, operation, origin, request_id, Vec::new())
    }

    /// Work a request left to run later (a background response's run, a batch line), from `arrival`: the root of a
    /// trace of its own, linked to `creator`, the span of the request that created it (None for a batch created
    /// while traces were off). The sampler is asked as if `creator` were its parent, with the link: a parent-based
    /// sampler (the default) follows the creating request's decision, so the work is traced when its creator was
    /// and its link leads to a span; a ratio sampler decides on the new trace id, as for any root.
    pub fn begin_linked(
        &self,
        creator: Option<SpanContext>,
        arrival: Instant,
        operation: &'static str,
        request_id: &str,
        attributes: Vec<KeyValue>,
    ) -> Arc<RequestTrace> {
        let creator = creator.filter(SpanContext::is_valid);
        let trace_id = self.ids.new_trace_id();
        let (cx, links) = match &creator {
            Some(c) => (Context::new().with_remote_span_context(c.clone()), vec![Link::with_context(c.clone())]),
            None => (Context::new(), Vec::new()),
        };
        let decision =
            self.sampler.should_sample(Some(&cx), trace_id, operation, &SpanKind::Internal, &attributes, &links);
        let sampled = decision.decision == SamplingDecision::RecordAndSample;
        // A new trace: the creator's tracestate belongs to the creator's trace, not to this one.
        let ids =
            record::Ids { trace_id, span_id: self.ids.new_span_id(), parent: None, trace_state: TraceState::NONE };
        let origin = record::Origin::Linked { creator };
        RequestTrace::new(ids, sampled.then(|| self.sink.clone()), arrival, operation, origin, request_id, attributes)
    }

    /// Export what is queued (for up to a few seconds) and stop the export thread.
    pub fn shutdown(&self) {
        if let Some(worker) = self.worker.lock().unwrap().take() {
            worker.stop();
        }
    }
}

/// The endpoint as logs show it: without a user or password it may carry.
fn redacted(endpoint: &str) -> String {
    match url::Url::parse(endpoint) {
        Ok(mut u) if !u.username().is_empty() || u.password().is_some() => {
            let _ = (u.set_username(""), u.set_password(None));
            u.to_string()
        }
        _ => endpoint.to_string(),
    }
}

/// The SDK's resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, the SDK's own), named `deepinfer-server`
/// unless the environment names the service.
fn resource() -> Resource {
    let named = |var: &str, test: &dyn Fn(&str) -> bool| std::env::var(var).is_ok_and(|v| test(&v));
    let builder = Resource::builder();
    let from_env = named("OTEL_SERVICE_NAME", &|v| !v.trim().is_empty())
        || named("OTEL_RESOURCE_ATTRIBUTES", &|v| v.split(',').any(|kv| kv.trim_start().starts_with("service.name=")));
    if from_env { builder.build() } else { builder.with_service_name(SERVICE_NAME).build() }
}

#[cfg(test)]
mod tests {
    #[test]
    fn logs_name_the_endpoint_without_its_credentials() {
        assert_eq!(super::redacted("https://u:secret@collector:4318/v1/traces"), "https://collector:4318/v1/traces");
        assert_eq!(super::redacted("http://collector:4317"), "http://collector:4317");
    }
}

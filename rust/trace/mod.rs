//! OpenTelemetry traces (`--otlp-traces-endpoint`, the `OTEL_*` variables): one span per request, with a child per
//! stage, built when the request is over from the stamps it collects anyway (`crate::ttft`, its token timing) and
//! exported over OTLP on a thread of its own.
//!
//! Off (no endpoint), nothing here runs: the request path checks one `Option` per request and builds nothing. On,
//! a request pays for its ids, the sampling decision and a handful of stores; its spans are built and exported on
//! the export thread, never while a request thread waits, never with the GIL.
//!
//! Status, by OpenTelemetry's HTTP conventions for servers: Error for 5xx only (the server failed); a 4xx (429
//! and a client that left, 499, included) leaves it Unset, with `http.response.status_code` and `error.type` (the
//! error's code: `invalid_request_error`, `queue_full`, `client_disconnect`, ...) saying what happened, so error
//! rates count the server's failures, not its clients'.
//!
//! `context` reads a W3C `traceparent`, `record` is what a request notes on its way, `spans` turns that into span
//! data, `body` tells a record when the response's last byte left, `export` is the queue, its thread and the
//! exporter.

pub mod body;
mod context;
mod export;
mod record;
mod spans;

pub use context::parent_from;
pub use export::Counters;
pub use record::{Outcome, RequestTrace, ResponseGuard};

use opentelemetry::trace::{SpanContext, SpanKind, TraceContextExt};
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
        RequestTrace::new(ids, sampled.then(|| self.sink.clone()), arrival, operation, route, request_id)
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

//! The export side: a bounded queue of finished requests, and one thread with a runtime of its own that builds
//! their spans and exports them in batches with opentelemetry-otlp (HTTP/protobuf over the reqwest/rustls-ring
//! client the image fetcher uses, or gRPC over tonic).
//!
//! A request never waits on it: a full queue drops the request's spans at once. An export that fails (the
//! collector is down, slow, or refuses) drops its batch. Both count in `deepinfer_trace_spans_dropped_total`, and
//! the first failure is logged, once.
//!
//! The queue is a plain vector under a lock, not a channel: a request that ends pushes its record and goes on, and
//! the export thread wakes on its timer, or when enough records wait to fill a batch. A channel would wake that
//! thread for every request (a futex call and a context switch each, at thousands of requests a second).

use super::RequestTrace;
use opentelemetry::InstrumentationScope;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SpanData, SpanExporter as _};
use prometheus::IntCounter;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, oneshot};

/// The spans exported and dropped, in `/metrics`.
#[derive(Clone)]
pub struct Counters {
    pub exported: IntCounter,
    pub dropped: IntCounter,
}

/// The queue of finished requests, between the request threads and the export thread.
pub struct Sink {
    queue: Mutex<Vec<Arc<RequestTrace>>>,
    /// The most records it holds (`OTEL_BSP_MAX_QUEUE_SIZE`); past it a request's spans are dropped.
    capacity: usize,
    /// The export thread is woken when this many records wait.
    wake_at: usize,
    wake: Notify,
    counters: Counters,
}

impl Sink {
    fn new(capacity: usize, wake_at: usize, counters: Counters) -> Self {
        Sink {
            queue: Mutex::new(Vec::new()),
            capacity,
            wake_at: wake_at.clamp(1, capacity),
            wake: Notify::new(),
            counters,
        }
    }

    /// Queue a finished request's record (`count` spans); never waits.
    pub fn send(&self, t: Arc<RequestTrace>, count: u64) {
        let waiting = {
            let mut q = self.queue.lock().unwrap();
            if q.len() >= self.capacity {
                drop(q);
                self.counters.dropped.inc_by(count);
                return;
            }
            q.push(t);
            q.len()
        };
        if waiting == self.wake_at {
            self.wake.notify_one();
        }
    }

    fn take(&self) -> Vec<Arc<RequestTrace>> {
        std::mem::take(&mut *self.queue.lock().unwrap())
    }

    #[cfg(test)]
    pub fn for_tests() -> Arc<Sink> {
        let c = || IntCounter::new("c", "c").unwrap();
        Arc::new(Sink::new(16, 16, Counters { exported: c(), dropped: c() }))
    }
}

/// The export thread; `stop` exports what is queued and ends it.
pub struct Worker {
    stop: oneshot::Sender<()>,
    done: std::sync::mpsc::Receiver<()>,
}

/// How long a stop waits for the last exports.
const STOP_WAIT: Duration = Duration::from_secs(3);

impl Worker {
    pub fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.done.recv_timeout(STOP_WAIT);
    }
}

/// The batch processor's settings, from the standard `OTEL_BSP_*` variables (the spec's defaults; the queue holds
/// finished requests, about a dozen spans each).
struct Batching {
    queue: usize,
    batch: usize,
    delay: Duration,
}

fn env_usize(var: &str, default: usize) -> usize {
    std::env::var(var).ok().and_then(|v| v.trim().parse().ok()).filter(|n| *n > 0).unwrap_or(default)
}

impl Batching {
    fn from_env() -> Self {
        Batching {
            queue: env_usize("OTEL_BSP_MAX_QUEUE_SIZE", 2048),
            batch: env_usize("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
            delay: Duration::from_millis(env_usize("OTEL_BSP_SCHEDULE_DELAY", 5000) as u64),
        }
    }
}

/// The export timeout: `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, else `OTEL_EXPORTER_OTLP_TIMEOUT` (ms), else 10 s.
fn timeout() -> Duration {
    let ms = env_usize("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", env_usize("OTEL_EXPORTER_OTLP_TIMEOUT", 10_000));
    Duration::from_millis(ms as u64)
}

/// Start the export thread for `endpoint` (`shown` is how logs name it).
pub fn start(
    endpoint: &str,
    shown: &str,
    protocol: &str,
    resource: Resource,
    counters: Counters,
) -> Result<(Arc<Sink>, Worker), String> {
    let batching = Batching::from_env();
    // Woken with about a batch's worth of spans waiting (a streamed request makes 12).
    let sink = Arc::new(Sink::new(batching.queue, batching.batch / 12, counters));
    let (stop_tx, stop_rx) = oneshot::channel();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let (endpoint, protocol, queue) = (endpoint.to_string(), protocol.to_string(), sink.clone());
    let shown = shown.to_string();
    std::thread::Builder::new()
        .name("otel-export".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => return drop(ready_tx.send(Err(format!("trace export runtime: {e}")))),
            };
            rt.block_on(async move {
                // Built on this runtime: tonic's channel needs one.
                let exporter = match exporter(&endpoint, &shown, &protocol, &resource) {
                    Ok(e) => e,
                    Err(e) => return drop(ready_tx.send(Err(e))),
                };
                let _ = ready_tx.send(Ok(()));
                run(exporter, &queue, stop_rx, batching, &shown).await;
            });
            let _ = done_tx.send(());
        })
        .map_err(|e| format!("trace export thread: {e}"))?;
    ready_rx.recv().map_err(|_| "the trace export thread died".to_string())??;
    Ok((sink, Worker { stop: stop_tx, done: done_rx }))
}

fn exporter(
    endpoint: &str,
    shown: &str,
    protocol: &str,
    resource: &Resource,
) -> Result<opentelemetry_otlp::SpanExporter, String> {
    let built = match protocol {
        "grpc" => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(timeout())
            .build(),
        "http/protobuf" => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(http_client()?)
            .with_endpoint(endpoint)
            .with_timeout(timeout())
            .build(),
        other => return Err(format!("unsupported OTLP protocol {other:?} (use http/protobuf or grpc)")),
    };
    let mut exporter = built.map_err(|e| format!("OTLP exporter for {shown}: {e}"))?;
    exporter.set_resource(resource);
    Ok(exporter)
}

/// reqwest over rustls with the ring provider and the bundled web PKI roots, as the image fetcher builds it: no
/// OpenSSL, no aws-lc, the same trust in every container.
fn http_client() -> Result<reqwest::Client, String> {
    let roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("trace exporter TLS: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .timeout(timeout())
        .user_agent(concat!("deepinfer-server/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("trace exporter HTTP client: {e}"))
}

async fn run(
    exporter: opentelemetry_otlp::SpanExporter,
    sink: &Sink,
    mut stop: oneshot::Receiver<()>,
    batching: Batching,
    endpoint: &str,
) {
    let scope = InstrumentationScope::builder("deepinfer-server").with_version(env!("CARGO_PKG_VERSION")).build();
    let warned = AtomicBool::new(false);
    let counters = &sink.counters;
    let export = async |batch: Vec<SpanData>| {
        let n = batch.len() as u64;
        match exporter.export(batch).await {
            Ok(()) => counters.exported.inc_by(n),
            Err(e) => {
                counters.dropped.inc_by(n);
                if !warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        endpoint,
                        "cannot export traces: {e}; their spans are dropped and counted in \
                         deepinfer_trace_spans_dropped_total (logged once)"
                    );
                }
            }
        }
    };
    loop {
        let stopping = tokio::select! {
            () = tokio::time::sleep(batching.delay) => false,
            () = sink.wake.notified() => false,
            _ = &mut stop => true,
        };
        let mut batch: Vec<SpanData> = Vec::new();
        for t in sink.take() {
            batch.extend(super::spans::build(&t, &scope));
            if batch.len() >= batching.batch {
                export(std::mem::take(&mut batch)).await;
            }
        }
        if !batch.is_empty() {
            export(batch).await;
        }
        if stopping {
            return;
        }
    }
}

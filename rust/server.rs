//! `serve()`: build the state, start the per-rank threads, bind, and serve HTTP until SIGTERM/SIGINT or a rank
//! failure. Called from Python; the whole run happens with the GIL released.

use crate::admission::Admission;
use crate::codec::Codec;
use crate::config::ServerConfig;
use crate::dispatch::gather::GatherPolicy;
use crate::dispatch::{Dispatcher, RankLink};
use crate::edge::{self, root_path, tls::Tls};
use crate::error::ApiError;
use crate::http::{self, AppState};
use crate::metrics::Metrics;
use crate::rank_io;
use crate::ring::py::{PyDoorbell, PyRing};
use crate::supervisor::{Supervisor, fail_in_flight};
use crate::trace::Traces;
use crate::watchdog;
use crate::workers::background::Background;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

/// How long connections may take to close after the last response was ended.
const CLOSE_GRACE: Duration = Duration::from_millis(500);

/// Run the HTTP front end over already-started, ready ranks. Returns the process exit code: 0 after a
/// signal-initiated drain that finished every request, 1 after a rank failure or when any request in flight was
/// cut (the drain timed out, or a rank died meanwhile).
#[pyfunction]
#[pyo3(signature = (config, codec, decode_batch, rings, pids, bell=None))]
pub fn serve(
    py: Python<'_>,
    mut config: ServerConfig,
    codec: Py<PyAny>,
    decode_batch: Py<PyAny>,
    rings: Vec<(PyRef<'_, PyRing>, PyRef<'_, PyRing>)>,
    pids: Vec<i32>,
    bell: Option<PyRef<'_, PyDoorbell>>,
) -> PyResult<i32> {
    init_logging(&config.log_level, config.log_format == "json");
    // Loaded again here, though the command line checked them: a file may have changed since.
    let tls = match config.edge.tls.clone().map(Tls::new).transpose() {
        Ok(tls) => tls,
        Err(e) => {
            tracing::error!("start-up failed: {e}");
            return Ok(1);
        }
    };
    let bell = bell.map(|b| b.bell());
    let links = rings
        .iter()
        .enumerate()
        .map(|(i, (req, out))| RankLink::new(i, req.ring(), out.ring(), bell.clone()))
        .collect();
    drop(rings);
    let metrics = Arc::new(Metrics::new(config.served_model_names.first().map_or("", String::as_str)));
    let gather = GatherPolicy { window: config.gather_window(), min_tokens: config.dispatch_gather_min_tokens };
    let trace_counters = metrics.trace_spans.clone();
    let dispatcher = Dispatcher::with_gather(links, metrics, gather);
    // From here on a panic in any thread ends the process, /health 503 first (`crate::fatal`).
    crate::fatal::install(dispatcher.clone(), pids.clone(), Duration::from_secs_f64(config.exit_on_rank_failure_s));
    let codec = Codec::start(codec, decode_batch, config.codec_threads);
    let capacity = dispatcher.ranks.len() * config.max_num_seqs as usize;
    let media = crate::media::Fetcher::new(&config).map_err(PyValueError::new_err)?;
    if let Some(prefix) = &config.edge.root_path {
        config.openapi = config.openapi.map(|doc| root_path::openapi_servers(&doc, prefix));
    }
    let admission = Admission::with_queue(capacity, config.limits.max_queued_requests, config.queue_timeout());
    py.detach(move || {
        let traces = match &config.otlp_traces {
            Some((endpoint, protocol)) => match Traces::start(endpoint, protocol, trace_counters) {
                Ok(traces) => Some(traces),
                Err(e) => {
                    tracing::error!("start-up failed: {e}");
                    return Ok(1);
                }
            },
            None => None,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.http_workers.max(1))
            .thread_name("http")
            .enable_all()
            .build()?;
        let store = rt.block_on(open_store(&config, rt.handle()))?;
        let background = store.clone().map(|store| background_worker(store, &config));
        let state = Arc::new(AppState {
            media,
            admission,
            codec: codec.clone(),
            dispatcher: dispatcher.clone(),
            store,
            traces: traces.clone(),
            draining: Default::default(),
            started_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            pending: Default::default(),
            weights: crate::path::weights::Weights::new(config.engine.model_dir.as_ref().map(Into::into)),
            config,
        });
        let code = rt.block_on(run(state, background, pids, tls));
        rt.shutdown_timeout(Duration::from_secs(1));
        if let Some(traces) = traces {
            traces.shutdown(); // the last requests' spans
        }
        code
    })
    .map_err(|e: std::io::Error| PyOSError::new_err(e.to_string()))
}

/// The state store the config names, migrated and ready; None when storing is off. A store that cannot be opened
/// stops the start-up with a message that names it (its password cut).
async fn open_store(
    config: &ServerConfig,
    runtime: &tokio::runtime::Handle,
) -> std::io::Result<Option<Arc<crate::store::Store>>> {
    if config.state.store.is_empty() || !config.state.store_responses {
        return Ok(None);
    }
    let db = crate::store::Db::open(&config.state.store).await.map_err(|e| {
        let name = crate::store::redacted(&config.state.store);
        std::io::Error::other(format!("cannot open the state store {name}: {e}"))
    })?;
    tracing::info!("state store: {}", crate::store::redacted(&config.state.store));
    let owners = crate::owner::count(config.api_key.as_deref());
    let files = match config.state.files_dir.as_str() {
        "" => None,
        dir => {
            std::fs::create_dir_all(dir).map_err(|e| std::io::Error::other(format!("--files-dir {dir}: {e}")))?;
            let total = (config.limits.max_files_total_bytes > 0).then_some(config.limits.max_files_total_bytes);
            let share = share(config.limits.max_files_bytes_per_owner, total, owners);
            Some(crate::store::files::FileRoom::new(dir.into(), config.limits.max_file_bytes, total, share))
        }
    };
    let ttl =
        (config.limits.response_store_ttl_s > 0.0).then(|| Duration::from_secs_f64(config.limits.response_store_ttl_s));
    let cap = (config.limits.max_state_store_bytes > 0).then_some(config.limits.max_state_store_bytes);
    let bounds = crate::store::retention::Bounds {
        max_bytes: cap,
        per_owner: share(config.limits.max_state_store_bytes_per_owner, cap, owners),
        item_max: config.limits.max_state_store_item_bytes,
        chain_max: config.limits.max_state_store_chain_bytes,
    };
    let retention = crate::store::retention::Retention::new(ttl, bounds);
    let store = crate::store::Store::new(db, files, retention, config.limits.claim_lease_s.max(3), runtime.clone());
    store.keep_within_bounds();
    Ok(Some(store))
}

/// The background worker's context on `store`: its registry of runs, bounded as configured.
fn background_worker(store: Arc<crate::store::Store>, config: &ServerConfig) -> Arc<Background> {
    let limits = crate::workers::background::Limits {
        max_runs: config.limits.max_background_runs.max(1),
        per_owner: config.limits.max_background_runs_per_owner.max(1),
        replay_bytes: config.limits.max_background_replay_bytes,
    };
    Arc::new(Background { store, runs: crate::workers::background::Runs::new(limits) })
}

/// One owner's share of a cap: as set, else the cap split evenly between the owners (all of it for one).
fn share(set: u64, cap: Option<u64>, owners: u64) -> Option<u64> {
    if set > 0 { Some(set) } else { cap.map(|c| c / owners.max(1)) }
}

async fn run(
    state: Arc<AppState>,
    background: Option<Arc<Background>>,
    pids: Vec<i32>,
    tls: Option<Arc<Tls>>,
) -> std::io::Result<i32> {
    // Handlers first: a SIGTERM right after the port opens must drain, not kill.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    // Then the socket, before anything else starts: a port in use or a live --uds socket is a one-line error and
    // exit status 1 (the launcher stops the ranks), not a traceback.
    let bound = match edge::bind(&state.config.edge, &state.config.host, state.config.port).await {
        Ok(bound) => bound,
        Err(e) => {
            tracing::error!("start-up failed: {e}");
            return Ok(1);
        }
    };
    let dispatcher = state.dispatcher.clone();
    let readers: Vec<_> = (0..dispatcher.ranks.len())
        .map(|r| rank_io::spawn(dispatcher.clone(), state.codec.clone(), r, state.config.stream_interval()))
        .collect();
    // Batches run in idle slots from now on: this replica's, and any a dead one left (`crate::batches`); so do
    // background responses a dead replica left (`workers::background`).
    if let Some(store) = &state.store {
        crate::workers::batches::start(state.clone(), store.clone());
    }
    if let Some(background) = &background {
        crate::workers::background::keep_claims(state.clone(), background.clone());
    }
    let (failed_tx, mut failed_rx) = mpsc::unbounded_channel();
    if let Some(timeout) = state.config.watchdog_timeout() {
        let (dispatcher, failed, pids) = (dispatcher.clone(), failed_tx.clone(), pids.clone());
        tokio::spawn(async move {
            let rank = watchdog::run(dispatcher, timeout, pids).await;
            let _ = failed.send(rank);
        });
    }
    let mut supervisor = Supervisor::start(dispatcher.clone(), &pids, move |rank| {
        let _ = failed_tx.send(rank);
    })?;

    if let Some(tls) = &tls {
        tls.watch();
    }
    tracing::info!(
        "listening on {} (ranks {}, capacity {} requests, queue {})",
        bound.describe(tls.is_some())?,
        dispatcher.ranks.len(),
        state.admission.capacity(),
        state.config.limits.max_queued_requests
    );

    let (code_tx, mut code_rx) = mpsc::unbounded_channel::<i32>();
    let stopping = Arc::new(tokio::sync::Notify::new());
    let (shutdown_state, stop_signal) = (state.clone(), stopping.clone());
    let shutdown = async move {
        let code = tokio::select! {
            _ = term.recv() => drain(&shutdown_state, "SIGTERM").await,
            _ = int.recv() => drain(&shutdown_state, "SIGINT").await,
            Some(rank) = failed_rx.recv() => {
                let wait = shutdown_state.config.exit_on_rank_failure_s;
                tracing::error!(rank, "engine rank failed: /health is 503; exiting with status 1 in {wait:.1} s");
                tokio::time::sleep(Duration::from_secs_f64(wait)).await;
                1
            }
        };
        // Whatever is still running now will not finish: end it cleanly (error event + [DONE], or a 503).
        // Admitted requests not yet on a rank (still being encoded) are cut as well, when their connection closes.
        let not_dispatched = shutdown_state.admission.in_flight().saturating_sub(in_flight_on_ranks(&shutdown_state));
        for rank in 0..shutdown_state.dispatcher.ranks.len() {
            fail_in_flight(&shutdown_state.dispatcher, rank, "The server is shutting down.", "shutdown");
        }
        let lost = shutdown_state.dispatcher.lost() + not_dispatched;
        let code = if lost > 0 && code == 0 {
            tracing::warn!(lost, "requests in flight were lost (cut before they finished): exiting with status 1");
            1
        } else {
            code
        };
        let _ = code_tx.send(code);
        stop_signal.notify_one();
    };
    let app = match &state.config.edge.root_path {
        Some(prefix) => root_path::mount(http::app(state.clone(), background), prefix),
        None => http::app(state.clone(), background),
    };
    let max_connections = state.config.limits.max_connections;
    let deadlines = crate::edge::listener::Deadlines {
        client: state.config.client_timeout(),
        upload: Duration::from_secs_f64(state.config.limits.upload_timeout_s.max(0.001)),
    };
    let server = bound.serve(app, tls, deadlines, max_connections, shutdown);
    // Graceful shutdown waits for every connection to close; bound that so idle keep-alive clients cannot hold
    // the process (the streams have all been ended above).
    tokio::select! {
        () = server => {}
        _ = async { stopping.notified().await; tokio::time::sleep(CLOSE_GRACE).await } => {
            tracing::info!("closing the remaining connections");
        }
    }
    let code = code_rx.recv().await.unwrap_or(0);

    supervisor.stop();
    for link in &dispatcher.ranks {
        link.output.close();
        link.requests.ring().close();
    }
    for r in readers {
        let _ = r.join();
    }
    tracing::info!(code, "server stopped");
    Ok(code)
}

/// How long before the drain's timeout the background responses still running are released.
const CUT_BEFORE: Duration = Duration::from_secs(2);

/// Stop admitting (503), wait for in-flight requests up to the drain timeout, then let axum close up. The caller
/// turns the 0 into 1 if anything was cut.
async fn drain(state: &AppState, why: &str) -> i32 {
    state.draining.store(true, Ordering::Release);
    crate::path::control::resume(state); // paused requests run (or are refused) and end: the drain waits for them
    if let Some(store) = &state.store {
        store.hand_over.begin(); // before the waiters are refused: a background response among them is handed over
    }
    // Queued requests have not started: a 503 now lets a gateway send them to another replica.
    state.admission.refuse_waiting(|| ApiError::Unavailable("The server is shutting down.".into()));
    let limit = Duration::from_secs_f64(state.config.drain_timeout_s);
    tracing::info!("{why}: draining {} in-flight requests (up to {limit:?})", state.admission.in_flight());
    let deadline = tokio::time::Instant::now() + limit;
    // Background responses still running shortly before the timeout are released for another replica (`store::
    // hand_over`), with time left to write it; the others in flight run to the deadline.
    let cut_at = deadline - CUT_BEFORE.min(limit / 2);
    while state.admission.in_flight() > 0 && tokio::time::Instant::now() < cut_at {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Some(store) = &state.store {
        store.hand_over.cut();
        if !store.hand_over.wait(deadline.saturating_duration_since(tokio::time::Instant::now())).await {
            tracing::warn!("{why}: not every claim held here was released within the drain; their leases run out");
        }
    }
    while state.admission.in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A rank that died or hung (watchdog) meanwhile makes this an unclean stop, whatever started it.
    if let Some(dead) = state.dispatcher.ranks.iter().find(|r| !r.is_alive()) {
        tracing::error!(rank = dead.index, "{why}: rank {} failed during the drain; exiting with status 1", dead.index);
        return 1;
    }
    match state.admission.in_flight() {
        0 => tracing::info!("drained: every in-flight request finished"),
        n => tracing::warn!("drain timeout ({limit:?}) reached with {n} requests still in flight; cutting them"),
    }
    0
}

fn in_flight_on_ranks(state: &AppState) -> usize {
    state.dispatcher.ranks.iter().map(|r| r.in_flight()).sum()
}

fn init_logging(level: &str, json: bool) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(format!("{level},hyper=warn")));
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // JSON escapes every value itself; text lines get the control characters in values escaped, so that no
    // client-supplied value (a model name, a request id, a message quoting input) can break or forge a line.
    let _ = if json {
        fmt.json().with_current_span(false).try_init()
    } else {
        fmt.with_ansi(std::io::stderr().is_terminal()).fmt_fields(escaped_fields()).try_init()
    };
}

/// Text-log fields as tracing-subscriber writes them (`message` bare, others `name=value`), control characters
/// escaped.
fn escaped_fields() -> impl for<'w> tracing_subscriber::fmt::FormatFields<'w> + 'static {
    use tracing_subscriber::field::MakeExt;
    tracing_subscriber::fmt::format::debug_fn(|w, field, value| {
        let raw = format!("{value:?}");
        let text = escape_controls(&raw);
        if field.name() == "message" { write!(w, "{text}") } else { write!(w, "{field}={text}") }
    })
    .delimited(" ")
}

/// `text` with line breaks and other control characters as escapes (`\n`, `\u{1b}`).
pub fn escape_controls(text: &str) -> std::borrow::Cow<'_, str> {
    let special = |c: char| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}');
    if !text.chars().any(special) {
        return text.into();
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if special(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out.into()
}

#[cfg(test)]
mod tests {
    use super::escape_controls;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(escape_controls("plain ✓"), "plain ✓");
        assert_eq!(escape_controls("a\nb\r\tc\u{1b}[31m\u{2028}"), "a\\nb\\r\\tc\\u{1b}[31m\\u{2028}");
    }
}

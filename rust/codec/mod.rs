//! The bridge to the Python codec (deepseek-recipe). Only these threads take the GIL:
//! a small pool for `Codec.prepare`, a second one for requests with images (their preprocessing takes tens of
//! milliseconds per image, and must not hold up text requests' encoding), a third that builds and checks grammars
//! (a client's schema can cost up to `--grammar-cpu-seconds`, which must not hold up anyone else's encoding), and
//! the rank_io threads for `decode_batch`. Tokio workers never do.
//!
//! Preparing a request (`prepare`) and decoding token batches (`decode`) are this bridge's two Python calls; this
//! module runs them on its threads.

mod decode;
mod prepare;
pub mod seam;

use crate::doors::{Door, ForcedTool};
use crate::error::ApiError;
use prepare::{fetched_to_py, forced_args};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use seam::{Answer, PyCallInput, PyConstraintInput, PyRefusal};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::thread;
use std::time::Duration;
use tokio::sync::oneshot;

pub use decode::{DecodeItem, DecodeState, Decoded};
pub use prepare::{PrepareRequest, Prepared};

/// Work for a codec thread: run with the GIL, then (the closure's own business) hand on its result without it.
type Job = Box<dyn FnOnce(&Codec) + Send>;

/// Which threads run a codec job.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pool {
    /// Converting and encoding text requests, counting and rendering: what every request waits for.
    Text,
    /// Requests with images.
    Images,
    /// Building and checking grammars.
    Grammar,
}

pub struct Codec {
    codec: Py<PyAny>,
    decode_batch: Py<PyAny>,
    jobs: Mutex<mpsc::Sender<Job>>,
    image_jobs: Mutex<mpsc::Sender<Job>>,
    grammar_jobs: Mutex<mpsc::Sender<Job>>,
    /// Requests waiting for or in `prepare`. Decoding yields the GIL to them: a new request's time to first
    /// token should not queue behind other requests' token batches.
    preparing: Mutex<usize>,
    prepared: Condvar,
}

/// Longest a decode batch waits for pending prepares before taking the GIL anyway.
const PREPARE_PRIORITY_WAIT: Duration = Duration::from_millis(2);

impl Codec {
    /// Start `threads` prepare workers (and as many for requests with images, and one for grammars) around the
    /// Python `Codec` object and its `decode_batch` function.
    pub fn start(codec: Py<PyAny>, decode_batch: Py<PyAny>, threads: usize) -> Arc<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (image_tx, image_rx) = mpsc::channel::<Job>();
        let (grammar_tx, grammar_rx) = mpsc::channel::<Job>();
        let this = Arc::new(Codec {
            codec,
            decode_batch,
            jobs: Mutex::new(tx),
            image_jobs: Mutex::new(image_tx),
            grammar_jobs: Mutex::new(grammar_tx),
            preparing: Mutex::new(0),
            prepared: Condvar::new(),
        });
        this.spawn_pool("codec", rx, threads);
        this.spawn_pool("codec-images", image_rx, threads);
        // One thread: grammar work runs one request at a time, so it takes at most one core from the rest. The
        // requests it serves are bounded by admission (it runs with the slot held, or just before a wait).
        this.spawn_pool("codec-grammar", grammar_rx, 1);
        this
    }

    fn spawn_pool(self: &Arc<Self>, name: &str, rx: mpsc::Receiver<Job>, threads: usize) {
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let me = self.clone();
            thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    with_thread_state(|| {
                        loop {
                            let job = rx.lock().unwrap().recv();
                            let Ok(job) = job else { return };
                            job(&me);
                        }
                    })
                })
                .expect("spawn codec thread");
        }
    }

    /// Convert and encode on the codec pool, then run `then` on the same thread (without the GIL) and return its
    /// result. Dispatching from there sends the request to its rank without first waking an HTTP task.
    pub async fn prepare_then<T: Send + 'static>(
        &self,
        req: PrepareRequest,
        then: impl FnOnce(Prepared) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let pool = if req.has_images { Pool::Images } else { Pool::Text };
        let job = move |codec: &Codec| {
            let prepared = Python::attach(|py| codec.prepare_blocking(py, &req));
            // If the client left meanwhile the result is dropped by the caller, and a ticket in it aborts the request.
            prepared.and_then(then)
        };
        self.run(pool, job).await
    }

    /// Build and check a request's grammar (the codec caches it for its `prepare`) on the grammar thread: a 400
    /// for one that cannot be enforced or costs too much, without taking a text thread's time.
    pub async fn check_constraint(
        &self,
        body: Vec<u8>,
        door: Door,
        forced_tool: Option<ForcedTool>,
    ) -> Result<(), ApiError> {
        let answer = self
            .run(Pool::Grammar, move |codec| {
                Python::attach(|py| {
                    let (forced_tool, parallel_tools) = forced_args(forced_tool.as_ref());
                    let body = PyBytes::new(py, &body).unbind();
                    let input = PyConstraintInput { door: door.code(), body, forced_tool, parallel_tools };
                    let input = Bound::new(py, input).map_err(|e| internal(py, e))?;
                    let out = codec.codec.bind(py).call_method1("check_constraint", (input,));
                    let out = out.map_err(|e| internal(py, e))?;
                    out.extract::<Option<PyRefusal>>().map_err(|e| internal(py, e.into()))
                })
            })
            .await?;
        answer.map_or(Ok(()), |refused| Err(refused.into()))
    }

    /// Call a method of the Python `Codec` on the codec pool (counting tokens, rendering): a `CallInput` in,
    /// the body of its answer out, or its refusal as the request's error.
    pub async fn call(
        &self,
        method: &'static str,
        body: Vec<u8>,
        door: Door,
        fetched: Option<Vec<(String, bytes::Bytes)>>,
    ) -> Result<String, ApiError> {
        let pool = if fetched.is_some() { Pool::Images } else { Pool::Text };
        let job = move |codec: &Codec| {
            Python::attach(|py| {
                let body = PyBytes::new(py, &body).unbind();
                let images =
                    fetched.as_deref().map(|f| fetched_to_py(py, f)).transpose().map_err(|e| internal(py, e))?;
                let input = PyCallInput { door: door.code(), body, images: images.map(Bound::unbind) };
                let input = Bound::new(py, input).map_err(|e| internal(py, e))?;
                let out = codec.codec.bind(py).call_method1(method, (input,)).map_err(|e| internal(py, e))?;
                out.extract::<Answer>().map_err(|e| internal(py, e))?.accepted()
            })
        };
        self.run(pool, job).await
    }

    /// Run `f` on a codec thread (it takes the GIL itself) and await its result. On the text pool, new requests'
    /// preparations go before token batches while they wait for it (`yield_to_prepares`); on the other pools they
    /// do not: image preprocessing and grammar checks release the GIL for most of their time, and a decode batch
    /// waiting on them would stall streams.
    async fn run<T: Send + 'static>(
        &self,
        pool: Pool,
        f: impl FnOnce(&Codec) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let text = pool == Pool::Text;
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |codec| {
            let result = f(codec);
            if text {
                *codec.preparing.lock().unwrap() -= 1;
                codec.prepared.notify_all();
            }
            let _ = tx.send(result);
        });
        let queue = match pool {
            Pool::Text => &self.jobs,
            Pool::Images => &self.image_jobs,
            Pool::Grammar => &self.grammar_jobs,
        };
        if text {
            *self.preparing.lock().unwrap() += 1;
        }
        if queue.lock().unwrap().send(job).is_err() {
            if text {
                *self.preparing.lock().unwrap() -= 1;
            }
            return Err(ApiError::Unavailable("codec stopped".into()));
        }
        rx.await.map_err(|_| ApiError::Internal)?
    }

    /// Called before a decode batch takes the GIL: let pending request preparations go first (bounded wait).
    pub fn yield_to_prepares(&self) {
        let pending = self.preparing.lock().unwrap();
        if *pending > 0 {
            let _ = self.prepared.wait_timeout_while(pending, PREPARE_PRIORITY_WAIT, |n| *n > 0);
        }
    }
}

/// Run a thread's loop with a Python thread state kept for its whole life (the GIL released), so each
/// `Python::attach` inside only takes the GIL. Without it every attach from a Rust thread creates a thread state
/// and deletes it on release, and each new one maps a fresh frame stack: an mmap and an munmap (with a TLB
/// shootdown across cores) per prepared request and per decoded batch.
pub fn with_thread_state<R: pyo3::marker::Ungil>(f: impl FnOnce() -> R + pyo3::marker::Ungil) -> R {
    Python::attach(|py| py.detach(f))
}

/// A Python failure is our bug, not the client's: log it with its traceback, answer a bare 500.
fn internal(py: Python<'_>, err: PyErr) -> ApiError {
    log_python_error(py, &err, "codec raised");
    ApiError::Internal
}

/// Log a Python exception with its traceback as a field of the one log line (so `--log-format json` keeps every
/// line one object), never as raw lines on stderr.
pub fn log_python_error(py: Python<'_>, err: &PyErr, what: &str) {
    let traceback = py
        .import("traceback")
        .and_then(|tb| tb.call_method1("format_exception", (err.value(py),)))
        .and_then(|lines| lines.extract::<Vec<String>>())
        .map(|lines| lines.concat())
        .unwrap_or_default();
    tracing::error!(traceback = traceback.trim_end(), "{what}: {err}");
}

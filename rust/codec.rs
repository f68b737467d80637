//! The bridge to the Python codec (deepseek-recipe). Only these threads take the GIL:
//! a small pool for `Codec.prepare`, a second one for requests with images (their preprocessing takes tens of
//! milliseconds per image, and must not hold up text requests' encoding), a third that builds and checks grammars
//! (a client's schema can cost up to `--grammar-cpu-seconds`, which must not hold up anyone else's encoding), and
//! the rank_io threads for `decode_batch`. Tokio workers never do.

use crate::doors::sse::frame_into;
use crate::doors::{Door, ForcedTool};
use crate::error::ApiError;
use crate::ring::py::{logprobs_to_py, prompt_logprobs_to_py};
use crate::ring::records::{Constraint, ImageSet, Logprobs};
use axum::http::StatusCode;
use bytes::BytesMut;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::thread;
use std::time::Duration;
use tokio::sync::oneshot;

/// What the HTTP layer asks the codec to prepare.
pub struct PrepareRequest {
    pub door: Door,
    pub body: Vec<u8>,
    pub response_id: String,
    pub model: String,
    pub ignore_eos: bool,
    pub include_usage: bool,
    pub continuous_usage: bool,
    /// A tool choice that forces a call: the codec constrains the output to a tool-call block.
    pub forced_tool: Option<ForcedTool>,
    /// The request has images: it is prepared on the image pool.
    pub has_images: bool,
    /// The image URLs the front end fetched, with their bytes.
    pub fetched: Vec<(String, bytes::Bytes)>,
}

/// A converted, encoded request.
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    /// Logprobs asked for: alternatives per token.
    pub logprobs: Option<u32>,
    /// The prompt tokens' logprobs asked for (Completions' `echo` with `logprobs`, vLLM's `prompt_logprobs`).
    pub prompt_logprobs: bool,
    pub constraint: Option<Constraint>,
    pub decoder: Py<PyAny>,
    /// Whether output must be decoded as it arrives (streams, stop sequences) or may wait for the end.
    pub incremental: bool,
    /// Framed SSE events to send before any token (the role delta); empty for non-streams.
    pub first: BytesMut,
    /// The prompt's images, in the file the codec wrote for the rank.
    pub images: Option<ImageSet>,
}

impl Prepared {
    /// Remove the images' file when no rank will read it (the request went nowhere).
    pub fn discard_images(&self) {
        if let Some(im) = &self.images {
            im.discard();
        }
    }
}

/// Result states of `codec.decode_batch`, as defined in python/deepinfer_server/codec.py.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeState {
    Running,
    Finished,
    StoppedEarly,
}

/// One decoded item: framed SSE bytes for a stream, or the whole JSON body of a non-stream.
pub struct Decoded {
    pub state: DecodeState,
    pub bytes: BytesMut,
}

/// One request's part of a decode batch.
pub struct DecodeItem<'a> {
    pub decoder: &'a Py<PyAny>,
    pub tokens: &'a [u32],
    pub finish: u32,
    /// The tokens' logprobs, if asked for.
    pub logprobs: Option<Logprobs<'a>>,
    /// The prompt's logprobs (f32 little-endian), once, with the first tokens of a request that asked for them.
    pub prompt_logprobs: Option<&'a [u8]>,
}

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
                    let (forced, parallel) = forced_args(forced_tool.as_ref());
                    let args = (PyBytes::new(py, &body), door.code(), forced, parallel);
                    let out =
                        codec.codec.bind(py).call_method1("check_constraint", args).map_err(|e| internal(py, e))?;
                    out.extract::<(u16, String)>().map_err(|e| internal(py, e))
                })
            })
            .await?;
        accepted(answer).map(drop)
    }

    /// Call a method of the Python `Codec` on the codec pool (counting tokens, rendering): `(body, protocol)` in,
    /// the method's `(status, body)` answer out.
    pub async fn call(
        &self,
        method: &'static str,
        body: Vec<u8>,
        door: Door,
        fetched: Option<Vec<(String, bytes::Bytes)>>,
    ) -> Result<(u16, String), ApiError> {
        let pool = if fetched.is_some() { Pool::Images } else { Pool::Text };
        let job = move |codec: &Codec| {
            Python::attach(|py| {
                let body = PyBytes::new(py, &body);
                let out = match fetched.as_deref() {
                    None => codec.codec.bind(py).call_method1(method, (body, door.code())),
                    Some(f) => fetched_to_py(py, f)
                        .and_then(|images| codec.codec.bind(py).call_method1(method, (body, door.code(), images))),
                }
                .map_err(|e| internal(py, e))?;
                out.extract::<(u16, String)>().map_err(|e| internal(py, e))
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

    fn prepare_blocking(&self, py: Python<'_>, req: &PrepareRequest) -> Result<Prepared, ApiError> {
        let forced = forced_args(req.forced_tool.as_ref());
        let args = (
            PyBytes::new(py, &req.body),
            req.response_id.as_str(),
            req.model.as_str(),
            req.ignore_eos,
            req.include_usage,
            req.continuous_usage,
            req.door.code(),
            forced.0,
            forced.1,
            req.has_images.then(|| fetched_to_py(py, &req.fetched)).transpose().map_err(|e| internal(py, e))?,
        );
        let out = self.codec.bind(py).call_method1("prepare", args).map_err(|e| internal(py, e))?;
        if let Ok(t) = out.cast::<PyTuple>() {
            let (status, body): (u16, String) = t.extract().map_err(|e| internal(py, e))?;
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
            return Err(ApiError::Codec { status, body });
        }
        let get = |name: &str| out.getattr(name).map_err(|e| internal(py, e));
        let mut first = BytesMut::new();
        for s in get("first_chunks")?.cast::<PyList>().map_err(|e| internal(py, e.into()))?.iter() {
            let s = s.cast::<PyString>().map_err(|e| internal(py, e.into()))?;
            frame_into(&mut first, s.to_str().map_err(|e| internal(py, e))?.as_bytes());
        }
        Ok(Prepared {
            prompt: get("prompt_ids")?.extract().map_err(|e| internal(py, e))?,
            max_tokens: get("max_tokens")?.extract().map_err(|e| internal(py, e))?,
            temperature: get("temperature")?.extract().map_err(|e| internal(py, e))?,
            top_p: get("top_p")?.extract().map_err(|e| internal(py, e))?,
            logprobs: get("logprobs")?.extract().map_err(|e| internal(py, e))?,
            prompt_logprobs: get("prompt_logprobs")?.extract().map_err(|e| internal(py, e))?,
            constraint: get("constraint")?
                .extract::<Option<(u32, String, Vec<u32>, Option<u32>)>>()
                .map_err(|e| internal(py, e))?
                .map(|(schema_type, schema, triggers, bound)| Constraint { schema_type, schema, triggers, bound }),
            decoder: get("decoder")?.unbind(),
            incremental: get("incremental")?.extract().map_err(|e| internal(py, e))?,
            first,
            images: get("images")?
                .extract::<Option<(String, u32, Vec<[u32; 3]>)>>()
                .map_err(|e| internal(py, e))?
                .map(|(path, extra_tokens, sizes)| ImageSet { path, extra_tokens, sizes }),
        })
    }

    /// Called before a decode batch takes the GIL: let pending request preparations go first (bounded wait).
    pub fn yield_to_prepares(&self) {
        let pending = self.preparing.lock().unwrap();
        if *pending > 0 {
            let _ = self.prepared.wait_timeout_while(pending, PREPARE_PRIORITY_WAIT, |n| *n > 0);
        }
    }

    /// Decode one batch: `(decoder, new tokens, engine finish code, logprobs if asked for)` per request, one
    /// Python call in all.
    pub fn decode(&self, py: Python<'_>, items: &[DecodeItem<'_>]) -> PyResult<Vec<Decoded>> {
        let list = PyList::empty(py);
        for item in items {
            let (decoder, finish) = (item.decoder.bind(py), item.finish);
            let tokens = PyList::new(py, item.tokens.iter())?;
            let logprobs = item.logprobs.as_ref().map(|lp| logprobs_to_py(py, lp)).transpose()?;
            match (logprobs, item.prompt_logprobs) {
                (None, None) => list.append((decoder, tokens, finish))?,
                (lp, None) => list.append((decoder, tokens, finish, lp))?,
                (lp, Some(p)) => list.append((decoder, tokens, finish, lp, prompt_logprobs_to_py(py, p)?))?,
            }
        }
        let out = self.decode_batch.bind(py).call1((list,))?;
        let mut decoded = Vec::with_capacity(items.len());
        for item in out.cast::<PyList>()?.iter() {
            let t = item.cast::<PyTuple>()?;
            let state = match t.get_item(0)?.extract::<u8>()? {
                0 => DecodeState::Running,
                1 => DecodeState::Finished,
                _ => DecodeState::StoppedEarly,
            };
            let payload = t.get_item(1)?;
            let mut bytes = BytesMut::new();
            if let Ok(body) = payload.cast::<PyString>() {
                bytes.extend_from_slice(body.to_str()?.as_bytes());
            } else {
                for s in payload.cast::<PyList>()?.iter() {
                    frame_into(&mut bytes, s.cast::<PyString>()?.to_str()?.as_bytes());
                }
            }
            decoded.push(Decoded { state, bytes });
        }
        Ok(decoded)
    }
}

/// A forced tool choice as the codec takes it: ("" any tool, a name that one; None forces nothing, whether its
/// calls may run in parallel).
fn forced_args(forced: Option<&ForcedTool>) -> (Option<String>, bool) {
    (forced.map(|f| f.name.clone().unwrap_or_default()), forced.is_none_or(|f| f.parallel))
}

/// A codec method's `(status, body)` answer: the body when 200, else the codec's refusal as the request's error.
pub fn accepted((status, body): (u16, String)) -> Result<String, ApiError> {
    if status == 200 {
        return Ok(body);
    }
    Err(ApiError::Codec { status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST), body })
}

/// The fetched images as the codec takes them: `{url: bytes}`.
fn fetched_to_py<'py>(py: Python<'py>, fetched: &[(String, bytes::Bytes)]) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (url, data) in fetched {
        d.set_item(url, PyBytes::new(py, data))?;
    }
    Ok(d)
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

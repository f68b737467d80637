//! Python bindings: the engine ranks (and tests / fake servers) use these to
//! read requests and publish token batches. Blocking calls release the GIL
//! and wake up every `SIGNAL_POLL` to let Ctrl-C / signal handlers run.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyException, PyIndexError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use super::layout::AUX_WORDS;
use super::records::{self, Constraint, ImageSet, Logprobs, Request, Submit, TokenEntry};
use super::status::monotonic_us;
use super::{Ring, RingError as CoreError};

pyo3::create_exception!(deepinfer_server._native, RingClosed, PyException, "The ring was closed by either side.");
pyo3::create_exception!(
    deepinfer_server._native,
    RingError,
    PyException,
    "Malformed ring data or a record too large for the ring."
);

/// Longest single GIL-free sleep before checking for Python signals.
const SIGNAL_POLL: Duration = Duration::from_millis(200);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyRing>()?;
    m.add_class::<PyLockstep>()?;
    m.add_class::<PyDoorbell>()?;
    m.add("RingClosed", py.get_type::<RingClosed>())?;
    m.add("RingError", py.get_type::<RingError>())?;
    for (name, v) in [
        ("KIND_SUBMIT", records::SUBMIT),
        ("KIND_ABORT", records::ABORT),
        ("KIND_SHUTDOWN", records::SHUTDOWN),
        ("KIND_TOKENS", records::TOKENS),
        ("KIND_TIMING", records::TIMING),
        ("FINISH_NONE", records::FINISH_NONE),
        ("FINISH_STOP", records::FINISH_STOP),
        ("FINISH_LENGTH", records::FINISH_LENGTH),
        ("FINISH_ABORT", records::FINISH_ABORT),
        ("FINISH_ERROR", records::FINISH_ERROR),
        ("SCHEMA_JSON", records::SCHEMA_JSON),
        ("SCHEMA_REGEX", records::SCHEMA_REGEX),
        ("SCHEMA_EBNF", records::SCHEMA_EBNF),
    ] {
        m.add(name, v)?;
    }
    for (name, v) in super::status::EXPORTS {
        m.add(*name, *v)?;
    }
    Ok(())
}

fn ring_err(e: CoreError) -> PyErr {
    match e {
        CoreError::Closed => RingClosed::new_err("ring is closed"),
        CoreError::Timeout => PyTimeoutError::new_err("timed out waiting for ring space"),
        e => RingError::new_err(e.to_string()),
    }
}

fn io_err(e: io::Error) -> PyErr {
    match e.kind() {
        io::ErrorKind::InvalidInput => PyValueError::new_err(e.to_string()),
        io::ErrorKind::InvalidData => RingError::new_err(e.to_string()),
        _ => e.into(),
    }
}

/// `None` = forever; a timeout too large to represent is also forever.
fn duration(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_nan() => Err(PyValueError::new_err("timeout is NaN")),
        Some(t) => Ok(Duration::try_from_secs_f64(t.max(0.0)).ok()),
    }
}

/// f32 -> the shortest f64 that prints the same (0.7f32 -> 0.7, not 0.699999988).
fn f32_to_py(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// Runs `attempt(slice)` with the GIL released, in slices of at most
/// `SIGNAL_POLL`, until it stops timing out or `timeout` expires.
fn blocking<T: Send>(
    py: Python<'_>,
    timeout: Option<Duration>,
    attempt: impl Fn(Duration) -> Result<T, CoreError> + Sync,
) -> PyResult<T> {
    let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
    loop {
        let slice = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(SIGNAL_POLL),
            None => SIGNAL_POLL,
        };
        match py.detach(|| attempt(slice)) {
            Err(CoreError::Timeout) if deadline.is_none_or(|d| Instant::now() < d) => py.check_signals()?,
            r => return r.map_err(ring_err),
        }
    }
}

/// Runs a ring wait (`ready(Some(slice)) -> bool`) with the GIL released, in signal-checking slices, until it
/// is ready (True) or `timeout` seconds pass (False).
fn wait_until(py: Python<'_>, timeout: Option<f64>, ready: impl Fn(Option<Duration>) -> bool + Sync) -> PyResult<bool> {
    let timeout = duration(timeout)?;
    if timeout == Some(Duration::ZERO) {
        return Ok(ready(Some(Duration::ZERO)));
    }
    match blocking(py, timeout, |slice| if ready(Some(slice)) { Ok(()) } else { Err(CoreError::Timeout) }) {
        Ok(()) => Ok(true),
        Err(e) if e.is_instance_of::<PyTimeoutError>(py) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Shared-memory SPSC ring (see the Rust `ring` module docs).
#[pyclass(name = "Ring", module = "deepinfer_server._native", frozen)]
pub struct PyRing {
    ring: Arc<Ring>,
}

impl PyRing {
    /// The shared ring, for the Rust server side.
    pub fn ring(&self) -> Arc<Ring> {
        self.ring.clone()
    }
}

impl PyRing {
    /// Pushes one record built by `fill` (a `Copy` closure so it can be
    /// retried): first without releasing the GIL, then blocking without it.
    fn push_with<F>(&self, py: Python<'_>, kind: u32, len: usize, timeout: Option<f64>, fill: F) -> PyResult<()>
    where
        F: FnOnce(&mut [u8]) + Copy + Sync,
    {
        self.push_quietly_with(py, kind, len, timeout, true, fill)
    }

    /// `push_with`; without `wake` a sleeping consumer is not woken unless the ring is full.
    fn push_quietly_with<F>(
        &self,
        py: Python<'_>,
        kind: u32,
        len: usize,
        timeout: Option<f64>,
        wake: bool,
        fill: F,
    ) -> PyResult<()>
    where
        F: FnOnce(&mut [u8]) + Copy + Sync,
    {
        let timeout = duration(timeout)?;
        if self.ring.try_push_quietly_with(kind, len, wake, fill).map_err(ring_err)?.is_ok() {
            return Ok(());
        }
        if timeout == Some(Duration::ZERO) {
            return Err(ring_err(CoreError::Timeout));
        }
        blocking(py, timeout, |slice| self.ring.push_blocking_with(kind, len, Some(slice), fill))
    }
}

/// A step's entries parsed from Python: every entry's tokens in one buffer, so an entry of one token (the usual
/// decode step) costs no allocation of its own. Logprobs, for the entries that carry them, go to two more buffers
/// already in the record's byte layout.
#[derive(Default)]
struct Parsed {
    entries: Vec<ParsedEntry>,
    tokens: Vec<u32>,
    values: Vec<u8>,
    alternatives: Vec<u8>,
    prompt_values: Vec<u8>,
}

struct ParsedEntry {
    request_id: u64,
    finish: u32,
    tokens: std::ops::Range<usize>,
    reason: Option<String>,
    /// (alternatives per token, range in `values`, range in `alternatives`)
    logprobs: Option<(u32, std::ops::Range<usize>, std::ops::Range<usize>)>,
    /// Range in `prompt_values`.
    prompt_logprobs: Option<std::ops::Range<usize>>,
}

impl Parsed {
    fn push(&mut self, item: &Bound<'_, PyAny>) -> PyResult<()> {
        let t = item.cast::<PyTuple>()?;
        let reason = match t.len() {
            3 => None,
            4..=6 => t.get_borrowed_item(3)?.extract::<Option<String>>()?,
            n => {
                return Err(PyValueError::new_err(format!(
                    "token entry must be (request_id, tokens or token, finish[, reason[, logprobs[, prompt \
                     logprobs]]]), got {n} items"
                )));
            }
        };
        let finish: u32 = t.get_borrowed_item(2)?.extract()?;
        if finish > records::FINISH_ERROR {
            return Err(PyValueError::new_err(format!("unknown finish code {finish}")));
        }
        let start = self.tokens.len();
        let tokens = t.get_borrowed_item(1)?;
        if let Ok(list) = tokens.cast::<PyList>() {
            for token in list.iter() {
                self.tokens.push(token.extract()?);
            }
        } else if let Ok(token) = tokens.extract::<u32>() {
            self.tokens.push(token); // one token as an int: no list per token from a simulated step
        } else {
            self.tokens.extend(tokens.extract::<Vec<u32>>()?);
        }
        let n = self.tokens.len() - start;
        let logprobs = match t.len() {
            5 | 6 => {
                let lp = t.get_borrowed_item(4)?;
                if lp.is_none() { None } else { Some(self.logprobs(&lp, n)?) }
            }
            _ => None,
        };
        let prompt_logprobs = match t.len() {
            6 => {
                let plp = t.get_borrowed_item(5)?;
                if plp.is_none() { None } else { Some(self.prompt_logprobs(&plp)?) }
            }
            _ => None,
        };
        let request_id = t.get_borrowed_item(0)?.extract()?;
        let tokens = start..self.tokens.len();
        self.entries.push(ParsedEntry { request_id, finish, tokens, reason, logprobs, prompt_logprobs });
        Ok(())
    }

    /// One `(logprob, [(token, logprob), ...])` per token, every token with as many alternatives.
    fn logprobs(
        &mut self,
        lp: &Bound<'_, PyAny>,
        n: usize,
    ) -> PyResult<(u32, std::ops::Range<usize>, std::ops::Range<usize>)> {
        let (v0, a0) = (self.values.len(), self.alternatives.len());
        let mut top: Option<usize> = None;
        let mut count = 0;
        for item in lp.try_iter()? {
            let item = item?;
            let pair = item.cast::<PyTuple>()?;
            let value: f32 = pair.get_borrowed_item(0)?.extract()?;
            self.values.extend_from_slice(&value.to_le_bytes());
            let alts = pair.get_borrowed_item(1)?;
            let mut k = 0;
            for alt in alts.try_iter()? {
                let (token, value): (u32, f32) = alt?.extract()?;
                self.alternatives.extend_from_slice(&token.to_le_bytes());
                self.alternatives.extend_from_slice(&value.to_le_bytes());
                k += 1;
            }
            if *top.get_or_insert(k) != k {
                return Err(PyValueError::new_err("every token needs as many logprob alternatives"));
            }
            count += 1;
        }
        let top = top.unwrap_or(0);
        if count != n || top > records::MAX_TOP_LOGPROBS as usize {
            return Err(PyValueError::new_err(format!(
                "logprobs: {count} entries for {n} tokens, {top} alternatives (at most {})",
                records::MAX_TOP_LOGPROBS
            )));
        }
        Ok((top as u32, v0..self.values.len(), a0..self.alternatives.len()))
    }

    /// One logprob per prompt token after the first.
    fn prompt_logprobs(&mut self, plp: &Bound<'_, PyAny>) -> PyResult<std::ops::Range<usize>> {
        let v0 = self.prompt_values.len();
        for value in plp.try_iter()? {
            let value: f32 = value?.extract()?;
            self.prompt_values.extend_from_slice(&value.to_le_bytes());
        }
        Ok(v0..self.prompt_values.len())
    }

    fn token_entries(&self) -> Vec<TokenEntry<'_, &[u32]>> {
        self.entries
            .iter()
            .map(|e| TokenEntry {
                request_id: e.request_id,
                finish: e.finish,
                tokens: &self.tokens[e.tokens.clone()],
                reason: e.reason.as_deref(),
                logprobs: e.logprobs.as_ref().map(|(top, v, a)| Logprobs {
                    top: *top,
                    values: &self.values[v.clone()],
                    alternatives: &self.alternatives[a.clone()],
                }),
                prompt_logprobs: e.prompt_logprobs.as_ref().map(|r| &self.prompt_values[r.clone()]),
            })
            .collect()
    }
}

/// An entry's logprobs as Python reads them: `[(logprob, [(token, logprob), ...]), ...]`, one per token.
pub fn logprobs_to_py<'py>(py: Python<'py>, lp: &Logprobs<'_>) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    let top = lp.top as usize;
    let f32_at = |b: &[u8], i: usize| f32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    for (i, v) in lp.values.chunks_exact(4).enumerate() {
        let alts = PyList::empty(py);
        for j in 0..top {
            let o = 8 * (i * top + j);
            let token = u32::from_le_bytes([
                lp.alternatives[o],
                lp.alternatives[o + 1],
                lp.alternatives[o + 2],
                lp.alternatives[o + 3],
            ]);
            alts.append((token, f64::from(f32_at(lp.alternatives, o + 4))))?;
        }
        out.append((f64::from(f32_at(v, 0)), alts))?;
    }
    Ok(out)
}

/// A prompt's logprobs as Python reads them: a list of floats.
pub fn prompt_logprobs_to_py<'py>(py: Python<'py>, values: &[u8]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, values.chunks_exact(4).map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))))
}

fn prompt_ids(prompt: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(b) = prompt.cast::<PyBytes>() {
        let b = b.as_bytes();
        if b.len() % 4 != 0 {
            return Err(PyValueError::new_err("prompt bytes must be little-endian u32 ids"));
        }
        return Ok(b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect());
    }
    prompt.extract()
}

#[pymethods]
impl PyRing {
    /// Creates a new ring file (fails if it exists); capacity: power of two >= 4096.
    #[staticmethod]
    fn create(path: PathBuf, capacity: u64) -> PyResult<Self> {
        let ring = Ring::create(path, capacity).map_err(io_err)?;
        Ok(PyRing { ring: Arc::new(ring) })
    }

    #[staticmethod]
    fn open(path: PathBuf) -> PyResult<Self> {
        let ring = Ring::open(path).map_err(io_err)?;
        Ok(PyRing { ring: Arc::new(ring) })
    }

    /// Removes the file; rings already opened keep working.
    #[staticmethod]
    fn unlink(path: PathBuf) -> PyResult<()> {
        Ring::unlink(path).map_err(io_err)
    }

    /// Marks the ring closed and wakes all waiters, in every process.
    fn close(&self) {
        self.ring.close();
    }

    #[getter]
    fn closed(&self) -> bool {
        self.ring.is_closed()
    }

    #[getter]
    fn capacity(&self) -> u64 {
        self.ring.capacity()
    }

    #[getter]
    fn used_bytes(&self) -> u64 {
        self.ring.used_bytes()
    }

    fn aux(&self, i: usize) -> PyResult<u64> {
        if i >= AUX_WORDS {
            return Err(PyIndexError::new_err("aux index out of range"));
        }
        Ok(self.ring.aux(i))
    }

    fn set_aux(&self, i: usize, v: u64) -> PyResult<()> {
        if i >= AUX_WORDS {
            return Err(PyIndexError::new_err("aux index out of range"));
        }
        self.ring.set_aux(i, v);
        Ok(())
    }

    /// Waits (GIL released) until records are available or the ring is
    /// closed -> True; False once `timeout` seconds passed without data.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        wait_until(py, timeout, |t| self.ring.wait_readable(t))
    }

    /// Producer side: sleep (GIL released) until at most `max_used` bytes are unread or the ring closes (True),
    /// or until `timeout` seconds pass or the server wakes the producer because it sent a request (False: check
    /// the request ring, then wait again).
    #[pyo3(signature = (max_used, timeout=None))]
    fn wait_drained(&self, py: Python<'_>, max_used: u64, timeout: Option<f64>) -> PyResult<bool> {
        let slice = duration(timeout)?.map_or(SIGNAL_POLL, |t| t.min(SIGNAL_POLL));
        let drained = py.detach(|| self.ring.wait_drained(max_used, Some(slice)));
        py.check_signals()?;
        Ok(drained)
    }

    // ------------------------------------------------------- request side

    #[pyo3(signature = (request_id, prompt, max_tokens, temperature=1.0, top_p=1.0, top_k=-1, seed=None, ignore_eos=false, timeout=None, logprobs=None, constraint=None, images=None, prompt_logprobs=false))]
    #[allow(clippy::too_many_arguments)]
    fn push_submit(
        &self,
        py: Python<'_>,
        request_id: u64,
        prompt: &Bound<'_, PyAny>,
        max_tokens: u32,
        temperature: f32,
        top_p: f32,
        top_k: i32,
        seed: Option<u64>,
        ignore_eos: bool,
        timeout: Option<f64>,
        logprobs: Option<u32>,
        constraint: Option<(u32, String, Vec<u32>, Option<u32>)>,
        images: Option<(String, u32, Vec<[u32; 3]>)>,
        prompt_logprobs: bool,
    ) -> PyResult<()> {
        let prompt = prompt_ids(prompt)?;
        let constraint = constraint.map(|(schema_type, schema, triggers, bound)| Constraint {
            schema_type,
            schema,
            triggers,
            bound,
        });
        let s = Submit {
            request_id,
            prompt: prompt.as_slice(),
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            ignore_eos,
            logprobs,
            prompt_logprobs,
            constraint,
            images: images.map(|(path, extra_tokens, sizes)| ImageSet { path, extra_tokens, sizes }),
        };
        let s = &s;
        self.push_with(py, records::SUBMIT, s.encoded_len(), timeout, move |b| s.write(b))
    }

    #[pyo3(signature = (request_id, timeout=None))]
    fn push_abort(&self, py: Python<'_>, request_id: u64, timeout: Option<f64>) -> PyResult<()> {
        let bytes = records::Abort { request_id }.encode();
        self.push_with(py, records::ABORT, bytes.len(), timeout, move |b| b.copy_from_slice(&bytes))
    }

    #[pyo3(signature = (timeout=None))]
    fn push_shutdown(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        self.push_with(py, records::SHUTDOWN, 0, timeout, |_| {})
    }

    /// Consumes available request records: `(1, request_id, prompt_ids,
    /// max_tokens, temperature, top_p, top_k, seed|None, ignore_eos,
    /// (logprobs top|None, prompt_logprobs), (schema_type, schema, triggers, bound|None)|None,
    /// (path, extra_tokens, [(width, height, bytes)])|None)`,
    /// `(2, request_id)`, `(3,)`. A malformed record (a peer bug) raises
    /// `RingError`; everything drained by that call is consumed and lost.
    #[pyo3(signature = (max_bytes=1 << 26))]
    fn drain_requests<'py>(&self, py: Python<'py>, max_bytes: usize) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        let mut err: Option<PyErr> = None;
        self.ring
            .drain(max_bytes, |kind, payload| {
                if err.is_some() {
                    return;
                }
                let item = match records::decode_request(kind, payload) {
                    Ok(Request::Submit(s)) => PyList::new(py, s.prompt.iter()).and_then(|prompt| {
                        (
                            records::SUBMIT,
                            s.request_id,
                            prompt,
                            s.max_tokens,
                            f32_to_py(s.temperature),
                            f32_to_py(s.top_p),
                            s.top_k,
                            s.seed,
                            s.ignore_eos,
                            (s.logprobs, s.prompt_logprobs),
                            s.constraint.map(|c| (c.schema_type, c.schema, c.triggers, c.bound)),
                            s.images.map(|im| (im.path, im.extra_tokens, im.sizes)),
                        )
                            .into_pyobject(py)
                            .map(Bound::into_any)
                    }),
                    Ok(Request::Abort(a)) => (records::ABORT, a.request_id).into_pyobject(py).map(Bound::into_any),
                    Ok(Request::Shutdown) => (records::SHUTDOWN,).into_pyobject(py).map(Bound::into_any),
                    Err(e) => Err(RingError::new_err(e.to_string())),
                };
                if let Err(e) = item.and_then(|i| out.append(i)) {
                    err = Some(e);
                }
            })
            .map_err(ring_err)?;
        err.map_or(Ok(out), Err)
    }

    // -------------------------------------------------------- output side

    /// Writes ONE TOKENS record with all `(request_id, tokens, finish[,
    /// reason])` entries; blocks with the GIL released while the ring is
    /// full. Raises RingClosed, TimeoutError, or RingError (too large).
    /// `wake=False` leaves a sleeping consumer asleep (call `wake_consumer`
    /// before relying on it reading the record).
    /// `timings`: `(request_id, taken, scheduled)` (time.monotonic() seconds) for the requests whose first
    /// tokens these entries carry; they go first, in one TIMING record stamped with the publish time.
    #[pyo3(signature = (entries, timeout=None, wake=true, timings=None))]
    fn publish(
        &self,
        py: Python<'_>,
        entries: &Bound<'_, PyAny>,
        timeout: Option<f64>,
        wake: bool,
        timings: Option<Vec<(u64, f64, f64)>>,
    ) -> PyResult<()> {
        if let Some(t) = timings.filter(|t| !t.is_empty()) {
            let us = |s: f64| (s.max(0.0) * 1e6) as u64;
            let stamps: Vec<(u64, u64, u64)> = t.iter().map(|&(id, taken, sched)| (id, us(taken), us(sched))).collect();
            let (stamps, published) = (stamps.as_slice(), monotonic_us());
            let len = records::timing_encoded_len(stamps.len());
            self.push_quietly_with(py, records::TIMING, len, timeout, false, move |b| {
                records::write_timing(published, stamps, b)
            })?;
        }
        let mut parsed = Parsed::default();
        for item in entries.try_iter()? {
            parsed.push(&item?)?;
        }
        let entries = parsed.token_entries();
        let entries = entries.as_slice();
        let len = records::tokens_encoded_len(entries);
        self.push_quietly_with(py, records::TOKENS, len, timeout, wake, move |b| records::write_tokens(entries, b))
    }

    /// Wakes the consumer if it sleeps waiting for records.
    fn wake_consumer(&self) {
        self.ring.wake_consumer();
    }

    /// Consumes available TOKENS records and returns their entries,
    /// flattened: `(request_id, tokens, finish, reason|None)`, with a fifth item, the logprobs, on entries that
    /// carry them, and a sixth, the prompt's logprobs, on an entry that carries those. Malformed data
    /// raises `RingError` (what that call drained is consumed and lost).
    #[pyo3(signature = (max_bytes=1 << 26))]
    fn drain_tokens<'py>(&self, py: Python<'py>, max_bytes: usize) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        let mut err: Option<PyErr> = None;
        self.ring
            .drain(max_bytes, |kind, payload| {
                if err.is_some() {
                    return;
                }
                let res = (|| -> PyResult<()> {
                    if kind == records::TIMING {
                        return Ok(()); // the server's TTFT breakdown; nothing for a Python reader
                    }
                    if kind != records::TOKENS {
                        return Err(RingError::new_err(format!("unexpected record kind {kind} on output ring")));
                    }
                    let batch = records::decode_tokens(payload).map_err(|e| RingError::new_err(e.to_string()))?;
                    for e in batch {
                        let e = e.map_err(|e| RingError::new_err(e.to_string()))?;
                        let tokens = PyList::new(py, e.tokens.iter())?;
                        let logprobs = e.logprobs.as_ref().map(|l| logprobs_to_py(py, l)).transpose()?;
                        match (logprobs, e.prompt_logprobs) {
                            (None, None) => out.append((e.request_id, tokens, e.finish, e.reason))?,
                            (l, None) => out.append((e.request_id, tokens, e.finish, e.reason, l))?,
                            (l, Some(p)) => {
                                let p = prompt_logprobs_to_py(py, p)?;
                                out.append((e.request_id, tokens, e.finish, e.reason, l, p))?
                            }
                        }
                    }
                    Ok(())
                })();
                if let Err(e) = res {
                    err = Some(e);
                }
            })
            .map_err(ring_err)?;
        err.map_or(Ok(out), Err)
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.ring)
    }
}

/// Cross-process lockstep barrier for simulated DP ranks (see the Rust `ring::lockstep` docs).
#[pyclass(name = "Lockstep", module = "deepinfer_server._native", frozen)]
pub struct PyLockstep {
    inner: super::lockstep::Lockstep,
}

#[pymethods]
impl PyLockstep {
    #[staticmethod]
    fn create(path: PathBuf, parties: u32) -> PyResult<Self> {
        Ok(PyLockstep { inner: super::lockstep::Lockstep::create(path, parties).map_err(io_err)? })
    }

    #[staticmethod]
    fn open(path: PathBuf) -> PyResult<Self> {
        Ok(PyLockstep { inner: super::lockstep::Lockstep::open(path).map_err(io_err)? })
    }

    /// Release every party (and make later rounds fail with RingClosed).
    fn close(&self) {
        self.inner.close();
    }

    /// One round, the GIL released while waiting: (any party busy, slowest party's cost in ms).
    fn sync(&self, py: Python<'_>, busy: bool, cost_ms: f64) -> PyResult<(bool, f64)> {
        let cost_us = (cost_ms.max(0.0) * 1000.0) as u64;
        let (any_busy, max_us) = py.detach(|| self.inner.sync(busy, cost_us, None)).map_err(ring_err)?;
        Ok((any_busy, max_us as f64 / 1000.0))
    }
}

/// The wake-up bell of a lockstep rank group (see the Rust `ring::doorbell` docs).
#[pyclass(name = "Doorbell", module = "deepinfer_server._native", frozen)]
pub struct PyDoorbell {
    inner: Arc<super::Doorbell>,
}

impl PyDoorbell {
    /// The shared bell, for the server's request senders.
    pub fn bell(&self) -> Arc<super::Doorbell> {
        self.inner.clone()
    }
}

#[pymethods]
impl PyDoorbell {
    #[staticmethod]
    fn create(path: PathBuf) -> PyResult<Self> {
        Ok(PyDoorbell { inner: Arc::new(super::Doorbell::create(path).map_err(io_err)?) })
    }

    #[staticmethod]
    fn open(path: PathBuf) -> PyResult<Self> {
        Ok(PyDoorbell { inner: Arc::new(super::Doorbell::open(path).map_err(io_err)?) })
    }

    /// The ring count to pass to a later `wait`.
    fn value(&self) -> u32 {
        self.inner.value()
    }

    /// Wake every rank sleeping on the bell.
    fn ring(&self) {
        self.inner.ring();
    }

    /// Sleep, the GIL released, until the bell rings after `seen` was read (True) or `timeout` seconds pass.
    fn wait(&self, py: Python<'_>, seen: u32, timeout: f64) -> PyResult<bool> {
        wait_until(py, Some(timeout), |slice| self.inner.wait(seen, slice.unwrap_or(SIGNAL_POLL)))
    }
}

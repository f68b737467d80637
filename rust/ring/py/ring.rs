//! The ring as Python sees it: the request side (submit, abort, shutdown, drain) the server's tests and the fake
//! servers use, the output side (publish, drain tokens) the ranks use.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use pyo3::exceptions::{PyIndexError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyList;

use super::entries::PyOutput;
use super::requests::{PyAbort, PyReload, PyShutdown, PySubmit};
use super::step::PyStepOutputs;
use super::submit_input::PySubmitInput;
use super::{RingError, SIGNAL_POLL, blocking, duration, io_err, ring_err, wait_until};
use crate::ring::layout::AUX_WORDS;
use crate::ring::records::{self, Request};
use crate::ring::status::monotonic_us;
use crate::ring::{Ring, RingError as CoreError};

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

    /// Push a generation request, built as a `SubmitInput` (named fields, typed where Python builds it).
    #[pyo3(signature = (submit, timeout=None))]
    fn push_submit(&self, py: Python<'_>, submit: &Bound<'_, PySubmitInput>, timeout: Option<f64>) -> PyResult<()> {
        let s = submit.get().record();
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

    #[pyo3(signature = (model_path, timeout=None))]
    fn push_reload(&self, py: Python<'_>, model_path: String, timeout: Option<f64>) -> PyResult<()> {
        let bytes = model_path.as_bytes();
        self.push_with(py, records::RELOAD, bytes.len(), timeout, move |b| b.copy_from_slice(bytes))
    }

    /// Consumes available request records, as `Submit`, `Abort`, `Shutdown` and `Reload` records (requests.rs). A
    /// malformed record (a peer bug) raises `RingError`; everything drained by that call is consumed and lost.
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
                    Ok(Request::Submit(s)) => PySubmit::from_record(py, s).and_then(|s| out.append(s)),
                    Ok(Request::Abort(a)) => out.append(PyAbort::new(a.request_id)),
                    Ok(Request::Shutdown) => out.append(PyShutdown),
                    Ok(Request::Reload(path)) => out.append(PyReload::new(path)),
                    Err(e) => Err(RingError::new_err(e.to_string())),
                };
                if let Err(e) = item {
                    err = Some(e);
                }
            })
            .map_err(ring_err)?;
        err.map_or(Ok(out), Err)
    }

    // -------------------------------------------------------- output side

    /// Writes ONE TOKENS record with all `entries` (`Output` records, and `StepOutputs` whose rows it copies);
    /// blocks with the GIL released while the ring is full. Returns the number of rows written. Raises
    /// RingClosed, TimeoutError, or RingError (too large); TypeError for an entry that is neither. `wake=False`
    /// leaves a sleeping consumer asleep (call `wake_consumer` before relying on it reading the record).
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
    ) -> PyResult<usize> {
        if let Some(t) = timings.filter(|t| !t.is_empty()) {
            let us = |s: f64| (s.max(0.0) * 1e6) as u64;
            let stamps: Vec<(u64, u64, u64)> = t.iter().map(|&(id, taken, sched)| (id, us(taken), us(sched))).collect();
            let (stamps, published) = (stamps.as_slice(), monotonic_us());
            let len = records::timing_encoded_len(stamps.len());
            self.push_quietly_with(py, records::TIMING, len, timeout, false, move |b| {
                records::write_timing(published, stamps, b)
            })?;
        }
        let (mut outputs, mut steps) = (Vec::new(), Vec::new());
        for item in entries.try_iter()? {
            let item = item?;
            match item.cast_into::<PyOutput>() {
                Ok(o) => outputs.push(o),
                Err(e) => steps.push(e.into_inner().cast_into::<PyStepOutputs>().map_err(|e| {
                    let what = e.into_inner().get_type();
                    PyTypeError::new_err(format!("publish takes Output and StepOutputs records, not {what}"))
                })?),
            }
        }
        let mut entries: Vec<_> = outputs.iter().map(|o| o.get().entry()).collect();
        entries.extend(steps.iter().flat_map(|s| s.get().entries()));
        let (entries, rows) = (entries.as_slice(), entries.len());
        let len = records::tokens_encoded_len(entries);
        self.push_quietly_with(py, records::TOKENS, len, timeout, wake, move |b| records::write_tokens(entries, b))?;
        Ok(rows)
    }

    /// Wakes the consumer if it sleeps waiting for records.
    fn wake_consumer(&self) {
        self.ring.wake_consumer();
    }

    /// Consumes available TOKENS records and returns their entries, flattened, as `Output` records (what
    /// `publish` took). Malformed data
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
                        out.append(PyOutput::from_entry(&e))?;
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

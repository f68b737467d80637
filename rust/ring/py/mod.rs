//! Python bindings: the engine ranks (and tests / fake servers) use these to
//! read requests and publish token batches. Blocking calls release the GIL
//! and wake up every `SIGNAL_POLL` to let Ctrl-C / signal handlers run.
//!
//! One module per job: [`ring`] (the ring), [`entries`] (the `Output` records
//! a rank publishes, parsed as they are built), [`step`] (a step's plain rows
//! as columns, published beside them), [`requests`] (the typed records a rank
//! reads), [`submit_input`] (the typed request Python pushes), [`logprobs`] (records' logprobs as Python reads them, which the
//! server's codec uses too), [`lockstep`] and
//! [`doorbell`]; this one holds their errors and GIL-free waits.

mod doorbell;
mod entries;
mod lockstep;
pub mod logprobs;
mod requests;
mod ring;
mod step;
mod submit_input;

use std::io;
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyException, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

use super::RingError as CoreError;
use super::records;

pub use doorbell::PyDoorbell;
pub use lockstep::PyLockstep;
pub use ring::PyRing;
pub use submit_input::{SubmitConstraint, SubmitImages};

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
    m.add_class::<requests::PySubmit>()?;
    m.add_class::<submit_input::PySubmitInput>()?;
    m.add_class::<submit_input::SubmitConstraint>()?;
    m.add_class::<submit_input::SubmitImages>()?;
    m.add_class::<requests::PyAbort>()?;
    m.add_class::<requests::PyShutdown>()?;
    m.add_class::<requests::PyReload>()?;
    m.add_class::<entries::PyOutput>()?;
    m.add_class::<step::PyStepOutputs>()?;
    m.add("RingClosed", py.get_type::<RingClosed>())?;
    m.add("RingError", py.get_type::<RingError>())?;
    for (name, v) in [
        ("KIND_SUBMIT", records::SUBMIT),
        ("KIND_ABORT", records::ABORT),
        ("KIND_SHUTDOWN", records::SHUTDOWN),
        ("KIND_RELOAD", records::RELOAD),
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

//! `Doorbell`: the wake-up bell of a lockstep rank group.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;

use super::{SIGNAL_POLL, io_err, wait_until};
use crate::ring::Doorbell;

/// The wake-up bell of a lockstep rank group (see the Rust `ring::doorbell` docs).
#[pyclass(name = "Doorbell", module = "deepinfer_server._native", frozen)]
pub struct PyDoorbell {
    inner: Arc<Doorbell>,
}

impl PyDoorbell {
    /// The shared bell, for the server's request senders.
    pub fn bell(&self) -> Arc<Doorbell> {
        self.inner.clone()
    }
}

#[pymethods]
impl PyDoorbell {
    #[staticmethod]
    fn create(path: PathBuf) -> PyResult<Self> {
        Ok(PyDoorbell { inner: Arc::new(Doorbell::create(path).map_err(io_err)?) })
    }

    #[staticmethod]
    fn open(path: PathBuf) -> PyResult<Self> {
        Ok(PyDoorbell { inner: Arc::new(Doorbell::open(path).map_err(io_err)?) })
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

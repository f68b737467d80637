//! `Lockstep`: the cross-process barrier of simulated data-parallel ranks.

use std::path::PathBuf;

use pyo3::prelude::*;

use super::{io_err, ring_err};

/// Cross-process lockstep barrier for simulated DP ranks (see the Rust `ring::lockstep` docs).
#[pyclass(name = "Lockstep", module = "deepinfer_server._native", frozen)]
pub struct PyLockstep {
    inner: crate::ring::lockstep::Lockstep,
}

#[pymethods]
impl PyLockstep {
    #[staticmethod]
    fn create(path: PathBuf, parties: u32) -> PyResult<Self> {
        Ok(PyLockstep { inner: crate::ring::lockstep::Lockstep::create(path, parties).map_err(io_err)? })
    }

    #[staticmethod]
    fn open(path: PathBuf) -> PyResult<Self> {
        Ok(PyLockstep { inner: crate::ring::lockstep::Lockstep::open(path).map_err(io_err)? })
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

//! What a rank reads from its request ring (`Ring.drain_requests`), as typed records: `Submit`, `Abort` and
//! `Shutdown`, defined here once and exported through `_native` (stubs in `_native.pyi`). The rank loop tells them
//! apart by type and reads fields by name, so adding a field cannot shift another.

use pyo3::prelude::*;
use pyo3::types::PyList;

use super::submit_input::{SubmitConstraint, SubmitImages};

use crate::ring::records::{self, U32s};

/// f32 -> the shortest f64 that prints the same (0.7f32 -> 0.7, not 0.699999988).
fn f32_to_py(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// A generation request, as a SUBMIT record carries it.
#[pyclass(name = "Submit", module = "deepinfer_server._native", frozen, get_all)]
pub struct PySubmit {
    request_id: u64,
    prompt: Py<PyList>,
    max_tokens: u32,
    temperature: f64,
    top_p: f64,
    /// -1: off.
    top_k: i32,
    seed: Option<u64>,
    ignore_eos: bool,
    /// None, or the alternatives wanted per token (0: the sampled token's own logprob alone).
    logprobs: Option<u32>,
    /// The prompt tokens' logprobs wanted, returned with the first token.
    prompt_logprobs: bool,
    /// The grammar it is held to, as Python pushed it.
    constraint: Option<Py<SubmitConstraint>>,
    /// Its images, as Python pushed them.
    images: Option<Py<SubmitImages>>,
}

impl PySubmit {
    pub(super) fn from_record(py: Python<'_>, s: records::Submit<U32s<'_>>) -> PyResult<Self> {
        let constraint = s.constraint.map(|c| Py::new(py, SubmitConstraint::from(c))).transpose()?;
        let images = s.images.map(|im| Py::new(py, SubmitImages::from(im))).transpose()?;
        Ok(PySubmit {
            request_id: s.request_id,
            prompt: PyList::new(py, s.prompt.iter())?.unbind(),
            max_tokens: s.max_tokens,
            temperature: f32_to_py(s.temperature),
            top_p: f32_to_py(s.top_p),
            top_k: s.top_k,
            seed: s.seed,
            ignore_eos: s.ignore_eos,
            logprobs: s.logprobs,
            prompt_logprobs: s.prompt_logprobs,
            constraint,
            images,
        })
    }
}

#[pymethods]
impl PySubmit {
    fn __repr__(&self) -> String {
        format!("Submit(request_id={}, max_tokens={})", self.request_id, self.max_tokens)
    }
}

/// Stop generating a request (the client left, or a stop sequence matched).
#[pyclass(name = "Abort", module = "deepinfer_server._native", frozen, get_all)]
pub struct PyAbort {
    request_id: u64,
}

impl PyAbort {
    pub(super) fn new(request_id: u64) -> Self {
        PyAbort { request_id }
    }
}

#[pymethods]
impl PyAbort {
    fn __repr__(&self) -> String {
        format!("Abort(request_id={})", self.request_id)
    }
}

/// Finish what is running and exit.
#[pyclass(name = "Shutdown", module = "deepinfer_server._native", frozen)]
pub struct PyShutdown;

#[pymethods]
impl PyShutdown {
    fn __repr__(&self) -> &'static str {
        "Shutdown()"
    }
}

/// Load the checkpoint in this directory in place of the one served (the server has drained the rank first).
#[pyclass(name = "Reload", module = "deepinfer_server._native", frozen, get_all)]
pub struct PyReload {
    model_path: String,
}

impl PyReload {
    pub(super) fn new(model_path: &str) -> Self {
        PyReload { model_path: model_path.to_string() }
    }
}

#[pymethods]
impl PyReload {
    fn __repr__(&self) -> String {
        format!("Reload(model_path={:?})", self.model_path)
    }
}

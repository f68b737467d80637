//! What crosses between Rust and the Python codec, as typed records defined once, here (and the decode batch's in
//! decode.rs), and exported through `_native` (stubs in `_native.pyi`, which mypy checks the codec against and
//! `mypy.stubtest` checks against this module):
//! - `PrepareInput`, `ConstraintInput`, `CallInput`: what Rust asks `Codec.prepare`, `Codec.check_constraint` and
//!   the codec's other calls (`tokenize`, `detokenize`, `count_tokens`);
//! - `Prepared`: a request converted and encoded, with its decoder;
//! - `Refusal`: a request the codec will not run, with its status and error envelope;
//! - the codes the two sides share: each door's protocol code (`doors::Door::code`) and the decode states.
//!
//! A record Python answers with is built in Python, so a wrong type fails there, at the line that built it; Rust
//! takes its fields without looking anything up by name. A record Rust asks with is read by field name in Python.

use super::decode::{DecodeState, PyDecodeBatch};
use crate::doors::Door;
use crate::error::ApiError;
use crate::ring::py::{SubmitConstraint, SubmitImages};
use crate::ring::records::{Constraint, ImageSet};
use axum::http::StatusCode;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

/// What Rust asks `Codec.prepare`: the request's door (`DOOR_*`) and body, and what the front end decided about
/// it. `forced_tool`: a tool choice that forces a call ("" any tool, else its name; Rust checked it names one of
/// the tools); `images`: the image URLs the front end fetched, and their bytes.
#[pyclass(name = "PrepareInput", module = "deepinfer_server._native", frozen, get_all)]
pub struct PyPrepareInput {
    pub(super) door: u8,
    pub(super) body: Py<PyBytes>,
    pub(super) response_id: String,
    pub(super) model: String,
    pub(super) ignore_eos: bool,
    pub(super) include_usage: bool,
    pub(super) continuous_usage: bool,
    pub(super) forced_tool: Option<String>,
    pub(super) parallel_tools: bool,
    pub(super) images: Option<Py<PyDict>>,
}

#[pymethods]
impl PyPrepareInput {
    #[new]
    #[pyo3(signature = (*, door, body, response_id, model, ignore_eos=false, include_usage=false,
        continuous_usage=false, forced_tool=None, parallel_tools=true, images=None))]
    #[allow(clippy::too_many_arguments)] // keyword-only: Python names every one
    fn new(
        door: u8,
        body: Py<PyBytes>,
        response_id: String,
        model: String,
        ignore_eos: bool,
        include_usage: bool,
        continuous_usage: bool,
        forced_tool: Option<String>,
        parallel_tools: bool,
        images: Option<Py<PyDict>>,
    ) -> PyResult<Self> {
        known_door(door)?;
        Ok(PyPrepareInput {
            door,
            body,
            response_id,
            model,
            ignore_eos,
            include_usage,
            continuous_usage,
            forced_tool,
            parallel_tools,
            images,
        })
    }

    fn __repr__(&self) -> String {
        format!("PrepareInput(door={}, response_id={:?}, ...)", self.door, self.response_id)
    }
}

/// What Rust asks `Codec.check_constraint`: the request's door and body, and its forced tool choice (as in
/// `PrepareInput`).
#[pyclass(name = "ConstraintInput", module = "deepinfer_server._native", frozen, get_all)]
pub struct PyConstraintInput {
    pub(super) door: u8,
    pub(super) body: Py<PyBytes>,
    pub(super) forced_tool: Option<String>,
    pub(super) parallel_tools: bool,
}

#[pymethods]
impl PyConstraintInput {
    #[new]
    #[pyo3(signature = (*, door, body, forced_tool=None, parallel_tools=true))]
    fn new(door: u8, body: Py<PyBytes>, forced_tool: Option<String>, parallel_tools: bool) -> PyResult<Self> {
        known_door(door)?;
        Ok(PyConstraintInput { door, body, forced_tool, parallel_tools })
    }

    fn __repr__(&self) -> String {
        format!("ConstraintInput(door={}, ...)", self.door)
    }
}

/// What Rust asks the codec's other calls (`Codec.tokenize`, `detokenize` and `count_tokens`): the request's door
/// and body, and the images the front end fetched for it (URL -> bytes), if it has any.
#[pyclass(name = "CallInput", module = "deepinfer_server._native", frozen, get_all)]
pub struct PyCallInput {
    pub(super) door: u8,
    pub(super) body: Py<PyBytes>,
    pub(super) images: Option<Py<PyDict>>,
}

#[pymethods]
impl PyCallInput {
    #[new]
    #[pyo3(signature = (*, door, body, images=None))]
    fn new(door: u8, body: Py<PyBytes>, images: Option<Py<PyDict>>) -> PyResult<Self> {
        known_door(door)?;
        Ok(PyCallInput { door, body, images })
    }

    fn __repr__(&self) -> String {
        format!("CallInput(door={}, ...)", self.door)
    }
}

fn known_door(code: u8) -> PyResult<()> {
    match Door::ALL.iter().any(|d| d.code() == code) {
        true => Ok(()),
        false => Err(PyValueError::new_err(format!("argument 'door': no door has code {code}"))),
    }
}

/// `Codec.prepare`'s answer for a request it will run. Rust takes its fields once (`take`); the getters are for
/// Python (tests, tools) reading it before.
#[pyclass(name = "Prepared", module = "deepinfer_server._native")]
pub struct PyPrepared {
    pub(super) prompt: Vec<u32>,
    #[pyo3(get)]
    pub(super) max_tokens: u32,
    #[pyo3(get)]
    pub(super) temperature: f32,
    #[pyo3(get)]
    pub(super) top_p: f32,
    #[pyo3(get)]
    pub(super) decoder: Py<PyAny>,
    #[pyo3(get)]
    pub(super) first_chunks: Vec<String>,
    #[pyo3(get)]
    pub(super) incremental: bool,
    #[pyo3(get)]
    pub(super) logprobs: Option<u32>,
    #[pyo3(get)]
    pub(super) prompt_logprobs: bool,
    pub(super) constraint: Option<Constraint>,
    pub(super) images: Option<ImageSet>,
}

#[pymethods]
impl PyPrepared {
    /// `constraint` and `images` are the records a rank's `Submit` carries them in (a tuple is refused).
    #[new]
    #[pyo3(signature = (*, prompt_ids, max_tokens, temperature, top_p, decoder, first_chunks, incremental,
        logprobs=None, prompt_logprobs=false, constraint=None, images=None))]
    #[allow(clippy::too_many_arguments)] // keyword-only: Python names every one
    fn new(
        prompt_ids: Vec<u32>,
        max_tokens: u32,
        temperature: f32,
        top_p: f32,
        decoder: Py<PyAny>,
        first_chunks: Vec<String>,
        incremental: bool,
        logprobs: Option<u32>,
        prompt_logprobs: bool,
        constraint: Option<PyRef<'_, SubmitConstraint>>,
        images: Option<PyRef<'_, SubmitImages>>,
    ) -> Self {
        PyPrepared {
            prompt: prompt_ids,
            max_tokens,
            temperature,
            top_p,
            decoder,
            first_chunks,
            incremental,
            logprobs,
            prompt_logprobs,
            constraint: constraint.map(|c| Constraint::from(&*c)),
            images: images.map(|im| ImageSet::from(&*im)),
        }
    }

    #[getter]
    fn prompt_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.prompt)
    }

    #[getter]
    fn constraint(&self) -> Option<SubmitConstraint> {
        self.constraint.clone().map(SubmitConstraint::from)
    }

    #[getter]
    fn images(&self) -> Option<SubmitImages> {
        self.images.clone().map(SubmitImages::from)
    }
}

/// The codec's answer for a request it will not run: an HTTP status and the error envelope (OpenAI's; Rust
/// renders it in the request's door's).
#[pyclass(name = "Refusal", module = "deepinfer_server._native", frozen, eq, from_py_object)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PyRefusal {
    #[pyo3(get)]
    pub status: u16,
    #[pyo3(get)]
    pub body: String,
}

impl From<PyRefusal> for ApiError {
    fn from(r: PyRefusal) -> Self {
        ApiError::Codec { status: StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST), body: r.body }
    }
}

/// What the codec answers a call that is not a generation (counting tokens, tokenizing): the body of its 200, or
/// its refusal.
#[derive(FromPyObject)]
pub enum Answer {
    Body(String),
    Refused(PyRefusal),
}

impl Answer {
    pub fn accepted(self) -> Result<String, ApiError> {
        match self {
            Answer::Body(body) => Ok(body),
            Answer::Refused(r) => Err(r.into()),
        }
    }
}

#[pymethods]
impl PyRefusal {
    #[new]
    fn new(status: u16, body: String) -> Self {
        PyRefusal { status, body }
    }

    fn __repr__(&self) -> String {
        format!("Refusal({}, {:?})", self.status, self.body)
    }
}

/// The exported names: the records, each door's code (`DOOR_CHAT` ...) and the decode states.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPrepareInput>()?;
    m.add_class::<PyConstraintInput>()?;
    m.add_class::<PyCallInput>()?;
    m.add_class::<PyPrepared>()?;
    m.add_class::<PyDecodeBatch>()?;
    m.add_class::<PyRefusal>()?;
    for door in Door::ALL {
        m.add(format!("DOOR_{}", door.name().to_uppercase()), door.code())?;
    }
    for state in DecodeState::ALL {
        m.add(state.export_name(), state as u8)?;
    }
    Ok(())
}

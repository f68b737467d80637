//! What the Python codec hands back to Rust, as typed records defined once, here, and exported through `_native`
//! (stubs in `_native.pyi`, which mypy checks the codec against and `mypy.stubtest` checks against this module):
//! - `Prepared`: a request converted and encoded, with its decoder;
//! - `Refusal`: a request the codec will not run, with its status and error envelope;
//! - the codes the two sides share: each door's protocol code (`doors::Door::code`) and the decode states.
//!
//! A record is built in Python, so a wrong type fails there, at the line that built it; Rust takes its fields
//! without looking anything up by name.

use super::decode::DecodeState;
use crate::doors::Door;
use crate::error::ApiError;
use crate::ring::records::{Constraint, ImageSet};
use axum::http::StatusCode;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

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

type ConstraintArg = (u32, String, Vec<u32>, Option<u32>);
type ImagesArg = (String, u32, Vec<[u32; 3]>);

#[pymethods]
impl PyPrepared {
    /// `constraint`: (schema type, schema, trigger token ids, bound token id); `images`: (the file the rank reads
    /// them from, prompt tokens beyond their placeholders, [(width, height, bytes)]).
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
        constraint: Option<ConstraintArg>,
        images: Option<ImagesArg>,
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
            constraint: constraint.map(|(schema_type, schema, triggers, bound)| Constraint {
                schema_type,
                schema,
                triggers,
                bound,
            }),
            images: images.map(|(path, extra_tokens, sizes)| ImageSet { path, extra_tokens, sizes }),
        }
    }

    #[getter]
    fn prompt_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, &self.prompt)
    }

    #[getter]
    fn constraint<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let c = self.constraint.as_ref();
        c.map(|c| (c.schema_type, c.schema.as_str(), c.triggers.clone(), c.bound).into_pyobject(py)).transpose()
    }

    #[getter]
    fn images<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let im = self.images.as_ref();
        im.map(|im| (im.path.as_str(), im.extra_tokens, im.sizes.clone()).into_pyobject(py)).transpose()
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
    m.add_class::<PyPrepared>()?;
    m.add_class::<PyRefusal>()?;
    for door in Door::ALL {
        m.add(format!("DOOR_{}", door.name().to_uppercase()), door.code())?;
    }
    for state in DecodeState::ALL {
        m.add(state.export_name(), state as u8)?;
    }
    Ok(())
}

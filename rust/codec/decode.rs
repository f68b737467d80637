//! Decoding a batch of tokens: one Python call for every request that has tokens in it, which returns each one's
//! framed SSE events (or its whole JSON body) and whether it ended.

use super::Codec;
use crate::doors::sse::frame_into;
use crate::ring::py::logprobs::{logprobs_run_to_py, prompt_logprobs_to_py};
use crate::ring::records::LogprobsRun;
use bytes::BytesMut;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString};

/// Result states of `codec.decode_batch`: exported as `_native.DECODE_*` (seam.rs), which the decoders return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DecodeState {
    Running = 0,
    Finished = 1,
    /// Ended by the decoder before the engine did (a stop sequence matched): the rank is told to abort it.
    StoppedEarly = 2,
}

impl DecodeState {
    pub const ALL: [DecodeState; 3] = [DecodeState::Running, DecodeState::Finished, DecodeState::StoppedEarly];

    pub fn export_name(self) -> &'static str {
        match self {
            DecodeState::Running => "DECODE_RUNNING",
            DecodeState::Finished => "DECODE_FINISHED",
            DecodeState::StoppedEarly => "DECODE_STOPPED_EARLY",
        }
    }

    pub(super) fn from_code(code: u8) -> PyResult<Self> {
        Self::ALL
            .into_iter()
            .find(|s| *s as u8 == code)
            .ok_or_else(|| PyValueError::new_err(format!("state: no decode state has code {code}")))
    }
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
    pub logprobs: Option<LogprobsRun<'a>>,
    /// The prompt's logprobs (f32 little-endian), once, with the first tokens of a request that asked for them.
    pub prompt_logprobs: Option<&'a [u8]>,
}

/// A decode batch, as `decode_batch` reads it: one column per field, a row per request — its decoder, its new
/// tokens, the engine's finish code, the tokens' logprobs (None unless the request asked for them) and the prompt's
/// (None but with the first tokens of a request that asked) — and its answer, which `decode_batch` sets on the same
/// record: `states` (`DECODE_*`) and `outputs` (a stream's framed events, a list of str, or a non-stream's whole
/// body, a str), a row per request in the same order. Rust builds one per batch (Python in tests).
///
/// Columns, not a record per request: building a class from Python, or reading a record's fields, costs several
/// times unpacking a row, and this runs for every request of every batch on the streaming path.
#[pyclass(name = "DecodeBatch", module = "deepinfer_server._native")]
pub struct PyDecodeBatch {
    #[pyo3(get)]
    decoders: Py<PyList>,
    #[pyo3(get)]
    tokens: Py<PyList>,
    #[pyo3(get)]
    finishes: Py<PyList>,
    #[pyo3(get)]
    logprobs: Py<PyList>,
    #[pyo3(get)]
    prompt_logprobs: Py<PyList>,
    len: usize,
    answers: Option<Vec<DecodeState>>,
    outputs: Option<Py<PyList>>,
}

type TokenLogprob = (f64, Vec<(u32, f64)>);

#[pymethods]
impl PyDecodeBatch {
    /// `logprobs` and `prompt_logprobs` default to None for every request.
    #[new]
    #[pyo3(signature = (*, decoders, tokens, finishes, logprobs=None, prompt_logprobs=None))]
    fn new(
        py: Python<'_>,
        decoders: Vec<Py<PyAny>>,
        tokens: Vec<Vec<u32>>,
        finishes: Vec<u32>,
        logprobs: Option<Vec<Option<Vec<TokenLogprob>>>>,
        prompt_logprobs: Option<Vec<Option<Vec<f64>>>>,
    ) -> PyResult<Self> {
        let len = decoders.len();
        let logprobs = logprobs.unwrap_or_else(|| vec![None; len]);
        let prompt_logprobs = prompt_logprobs.unwrap_or_else(|| vec![None; len]);
        let lens = [tokens.len(), finishes.len(), logprobs.len(), prompt_logprobs.len()];
        if lens.iter().any(|&n| n != len) {
            return Err(PyValueError::new_err(format!(
                "a column per field, a row per request: {len} decoders, {lens:?}"
            )));
        }
        Ok(PyDecodeBatch {
            decoders: PyList::new(py, decoders)?.unbind(),
            tokens: PyList::new(py, tokens)?.unbind(),
            finishes: PyList::new(py, finishes)?.unbind(),
            logprobs: PyList::new(py, logprobs)?.unbind(),
            prompt_logprobs: PyList::new(py, prompt_logprobs)?.unbind(),
            len,
            answers: None,
            outputs: None,
        })
    }

    /// Each request's state (`DECODE_*`); None until `decode_batch` sets them.
    #[getter]
    fn states<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.answers.as_ref().map(|a| PyList::new(py, a.iter().map(|&s| s as u8))).transpose()
    }

    #[setter]
    fn set_states(&mut self, states: Vec<u8>) -> PyResult<()> {
        self.check_len("states", states.len())?;
        self.answers = Some(states.into_iter().map(DecodeState::from_code).collect::<PyResult<_>>()?);
        Ok(())
    }

    /// Each request's output; None until `decode_batch` sets them.
    #[getter]
    fn outputs(&self, py: Python<'_>) -> Option<Py<PyList>> {
        self.outputs.as_ref().map(|o| o.clone_ref(py))
    }

    #[setter]
    fn set_outputs(&mut self, outputs: Bound<'_, PyList>) -> PyResult<()> {
        self.check_len("outputs", outputs.len())?;
        for output in outputs.iter() {
            if !output.is_instance_of::<PyString>() && !output.is_instance_of::<PyList>() {
                let kind = output.get_type();
                return Err(PyTypeError::new_err(format!("outputs: a list of str or a str each, not {kind}")));
            }
        }
        self.outputs = Some(outputs.unbind());
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        format!("DecodeBatch({} requests, answered={})", self.len, self.answers.is_some())
    }
}

impl PyDecodeBatch {
    fn check_len(&self, field: &str, n: usize) -> PyResult<()> {
        match n == self.len {
            true => Ok(()),
            false => Err(PyValueError::new_err(format!("{field}: {n} answers for {} requests", self.len))),
        }
    }
}

impl Codec {
    /// Decode one batch: a `DecodeBatch` with a row per request, answered in place, one Python call in all.
    pub fn decode(&self, py: Python<'_>, items: &[DecodeItem<'_>]) -> PyResult<Vec<Decoded>> {
        let (decoders, tokens, finishes) = (PyList::empty(py), PyList::empty(py), PyList::empty(py));
        let (logprobs, prompt_logprobs) = (PyList::empty(py), PyList::empty(py));
        for item in items {
            decoders.append(item.decoder.bind(py))?;
            tokens.append(PyList::new(py, item.tokens.iter())?)?;
            finishes.append(item.finish)?;
            logprobs.append(item.logprobs.as_ref().map(|lp| logprobs_run_to_py(py, lp)).transpose()?)?;
            prompt_logprobs.append(item.prompt_logprobs.map(|p| prompt_logprobs_to_py(py, p)).transpose()?)?;
        }
        let batch = PyDecodeBatch {
            decoders: decoders.unbind(),
            tokens: tokens.unbind(),
            finishes: finishes.unbind(),
            logprobs: logprobs.unbind(),
            prompt_logprobs: prompt_logprobs.unbind(),
            len: items.len(),
            answers: None,
            outputs: None,
        };
        let batch = Bound::new(py, batch)?;
        self.decode_batch.bind(py).call1((&batch,))?;
        let batch = batch.try_borrow()?;
        let (Some(states), Some(outputs)) = (batch.answers.as_ref(), batch.outputs.as_ref()) else {
            return Err(PyValueError::new_err("decode_batch left the batch without its answers"));
        };
        let mut decoded = Vec::with_capacity(items.len());
        for (&state, payload) in states.iter().zip(outputs.bind(py).iter()) {
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

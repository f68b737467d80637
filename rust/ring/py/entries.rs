//! What crosses the output ring, as Python sees it: an engine's `Output` record per request per step, which a rank
//! builds and `Ring.publish` writes (and `Ring.drain_tokens` reads back); and a prompt's ids (`Ring.push_submit`).
//!
//! An `Output` is parsed into the record's own layout when it is built, so a wrong type or value fails at the line
//! that built it, and `publish` copies its fields without looking anything up.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyString, PyTuple};

use super::logprobs::{logprobs_to_py, prompt_logprobs_to_py};
use crate::ring::records::{self, Logprobs, TokenEntry, U32s};

/// An output's tokens: one inline (the usual decode step, no allocation), or several.
#[derive(Debug, Clone, Eq)]
enum Tokens {
    One(u32),
    Many(Vec<u32>),
}

/// Equal when they hold the same tokens, however they were given.
impl PartialEq for Tokens {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Tokens {
    fn as_slice(&self) -> &[u32] {
        match self {
            Tokens::One(t) => std::slice::from_ref(t),
            Tokens::Many(v) => v,
        }
    }

    fn parse(tokens: &Bound<'_, PyAny>) -> PyResult<Self> {
        if tokens.is_instance_of::<PyInt>() {
            return Ok(Tokens::One(tokens.extract()?)); // one token as an int: no list per token from a simulated step
        }
        if let Ok(list) = tokens.cast::<PyList>() {
            if list.len() == 1 {
                return Ok(Tokens::One(list.get_item(0)?.extract()?));
            }
            return list.iter().map(|t| t.extract()).collect::<PyResult<_>>().map(Tokens::Many);
        }
        if tokens.is_instance_of::<PyString>() {
            return Err(PyTypeError::new_err("a token id or a sequence of token ids, not a string"));
        }
        tokens.extract::<Vec<u32>>().map(Tokens::Many)
    }
}

/// The logprobs of an output's tokens, in the record's byte layout (`records::Logprobs`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct OwnedLogprobs {
    top: u32,
    values: Vec<u8>,
    alternatives: Vec<u8>,
}

impl OwnedLogprobs {
    fn view(&self) -> Logprobs<'_> {
        Logprobs { top: self.top, values: &self.values, alternatives: &self.alternatives }
    }

    /// One `(logprob, [(token, logprob), ...])` per token, every token with as many alternatives.
    fn parse(lp: &Bound<'_, PyAny>, n: usize) -> PyResult<Self> {
        let (mut values, mut alternatives) = (Vec::with_capacity(4 * n), Vec::new());
        let mut top: Option<usize> = None;
        let mut count = 0;
        for item in lp.try_iter()? {
            let item = item?;
            let pair = item.cast::<PyTuple>()?;
            let value: f32 = pair.get_borrowed_item(0)?.extract()?;
            values.extend_from_slice(&value.to_le_bytes());
            let mut k = 0;
            for alt in pair.get_borrowed_item(1)?.try_iter()? {
                let (token, value): (u32, f32) = alt?.extract()?;
                alternatives.extend_from_slice(&token.to_le_bytes());
                alternatives.extend_from_slice(&value.to_le_bytes());
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
        Ok(OwnedLogprobs { top: top as u32, values, alternatives })
    }
}

/// An error extracting argument `name`, said with its name (as PyO3 says it for the arguments it extracts).
fn argument(name: &str, e: PyErr) -> PyErr {
    Python::attach(|py| {
        let msg = format!("argument '{name}': {}", e.value(py));
        if e.is_instance_of::<PyValueError>(py) { PyValueError::new_err(msg) } else { PyTypeError::new_err(msg) }
    })
}

/// One request's part of an engine step: its new tokens, its finish code (`FINISH_*`), the reason of an error
/// finish, the tokens' logprobs (a request that asked for them), and the prompt's logprobs (one per prompt token
/// after the first; once, with the first token of a request that asked for them).
#[pyclass(name = "Output", module = "deepinfer_server._native", frozen, eq)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PyOutput {
    #[pyo3(get)]
    request_id: u64,
    tokens: Tokens,
    #[pyo3(get)]
    finish: u32,
    #[pyo3(get)]
    reason: Option<String>,
    logprobs: Option<OwnedLogprobs>,
    prompt_logprobs: Option<Vec<u8>>,
}

#[pymethods]
impl PyOutput {
    /// `tokens`: a token id or a sequence of them; `logprobs`: `[(logprob, [(token, logprob), ...]), ...]`, one
    /// per token, each with as many alternatives; `prompt_logprobs`: floats.
    #[new]
    #[pyo3(signature = (*, request_id, tokens, finish, reason=None, logprobs=None, prompt_logprobs=None))]
    fn new(
        request_id: u64,
        tokens: &Bound<'_, PyAny>,
        finish: u32,
        reason: Option<String>,
        logprobs: Option<&Bound<'_, PyAny>>,
        prompt_logprobs: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        if finish > records::FINISH_ERROR {
            return Err(PyValueError::new_err(format!("argument 'finish': unknown finish code {finish}")));
        }
        let tokens = Tokens::parse(tokens).map_err(|e| argument("tokens", e))?;
        let n = tokens.as_slice().len();
        let logprobs =
            logprobs.map(|lp| OwnedLogprobs::parse(lp, n)).transpose().map_err(|e| argument("logprobs", e))?;
        let prompt_logprobs = prompt_logprobs
            .map(|p| -> PyResult<Vec<u8>> {
                let values = p.extract::<Vec<f32>>()?;
                Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect())
            })
            .transpose()
            .map_err(|e| argument("prompt_logprobs", e))?;
        Ok(PyOutput { request_id, tokens, finish, reason, logprobs, prompt_logprobs })
    }

    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.tokens.as_slice())
    }

    #[getter]
    fn logprobs<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.logprobs.as_ref().map(|lp| logprobs_to_py(py, &lp.view())).transpose()
    }

    #[getter]
    fn prompt_logprobs<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyList>>> {
        self.prompt_logprobs.as_deref().map(|p| prompt_logprobs_to_py(py, p)).transpose()
    }

    fn __repr__(&self) -> String {
        let (lp, plp) = (self.logprobs.is_some(), self.prompt_logprobs.is_some());
        format!(
            "Output(request_id={}, tokens={:?}, finish={}, reason={:?}, logprobs={lp}, prompt_logprobs={plp})",
            self.request_id,
            self.tokens.as_slice(),
            self.finish,
            self.reason
        )
    }
}

impl PyOutput {
    /// A row with tokens and a finish code alone (a `StepOutputs` row).
    pub(super) fn plain(request_id: u64, tokens: &[u32], finish: u32) -> Self {
        let tokens = match tokens {
            [t] => Tokens::One(*t),
            _ => Tokens::Many(tokens.to_vec()),
        };
        PyOutput { request_id, tokens, finish, reason: None, logprobs: None, prompt_logprobs: None }
    }

    /// The record's entry, borrowing this output's fields.
    pub(super) fn entry(&self) -> TokenEntry<'_, &[u32]> {
        TokenEntry {
            request_id: self.request_id,
            finish: self.finish,
            tokens: self.tokens.as_slice(),
            reason: self.reason.as_deref(),
            logprobs: self.logprobs.as_ref().map(OwnedLogprobs::view),
            prompt_logprobs: self.prompt_logprobs.as_deref(),
        }
    }

    /// An entry read back from a record (`Ring.drain_tokens`).
    pub(super) fn from_entry(e: &TokenEntry<'_, U32s<'_>>) -> Self {
        let mut tokens = e.tokens.iter();
        PyOutput {
            request_id: e.request_id,
            tokens: match (e.tokens.len(), tokens.next()) {
                (1, Some(t)) => Tokens::One(t),
                _ => Tokens::Many(e.tokens.iter().collect()),
            },
            finish: e.finish,
            reason: e.reason.map(str::to_owned),
            logprobs: e.logprobs.map(|l| OwnedLogprobs {
                top: l.top,
                values: l.values.to_vec(),
                alternatives: l.alternatives.to_vec(),
            }),
            prompt_logprobs: e.prompt_logprobs.map(<[u8]>::to_vec),
        }
    }
}

/// Prompt ids: little-endian u32 bytes, or a sequence of ints.
pub(super) fn prompt_ids(prompt: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(b) = prompt.cast::<PyBytes>() {
        let b = b.as_bytes();
        if b.len() % 4 != 0 {
            return Err(PyValueError::new_err("prompt bytes must be little-endian u32 ids"));
        }
        return Ok(b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect());
    }
    prompt.extract()
}

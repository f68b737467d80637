//! An engine step's plain rows as columns (`StepOutputs`): what most of a step is (each running request's new
//! tokens and finish code, with no error reason and no logprobs), published beside the `Output` records of the
//! rows that carry more.
//!
//! Why columns: a rank builds one record per step instead of one per request. Constructing a `#[pyclass]` from
//! Python costs ~0.5 µs (abi3 has no vectorcall for a class), three times a tuple, per request per step; the
//! columns are plain lists Python appends to, copied here once per step.

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyString};

use super::entries::PyOutput;
use crate::ring::records::{self, TokenEntry};

/// A step's plain rows: row `i` is request `request_ids[i]`'s new tokens `tokens[i]` (a token id or a sequence
/// of them) and its finish code `finishes[i]` (`FINISH_NONE`, `FINISH_STOP`, `FINISH_LENGTH` or
/// `FINISH_ABORT`; an error finish carries its reason, so it is an `Output`).
#[pyclass(name = "StepOutputs", module = "deepinfer_server._native", frozen, eq)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PyStepOutputs {
    request_ids: Vec<u64>,
    finishes: Vec<u32>,
    /// Every row's tokens, one after the other; row `i`'s end at `ends[i]`.
    tokens: Vec<u32>,
    ends: Vec<usize>,
}

/// Column `name`, each item read by `item`, with the column's name and the row in the error.
fn column<T>(
    name: &str,
    col: &Bound<'_, PyAny>,
    mut item: impl FnMut(&Bound<'_, PyAny>) -> PyResult<T>,
) -> PyResult<Vec<T>> {
    let at = |i: usize, e: PyErr| {
        Python::attach(|py| {
            let msg = format!("argument '{name}': row {i}: {}", e.value(py));
            // A negative or too large id is a bad value, not a bad type.
            if e.is_instance_of::<PyValueError>(py) || e.is_instance_of::<PyOverflowError>(py) {
                PyValueError::new_err(msg)
            } else {
                PyTypeError::new_err(msg)
            }
        })
    };
    if col.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!("argument '{name}': a sequence, not a string")));
    }
    if let Ok(list) = col.cast::<PyList>() {
        return list.iter().enumerate().map(|(i, v)| item(&v).map_err(|e| at(i, e))).collect();
    }
    let iter = col.try_iter().map_err(|e| PyTypeError::new_err(format!("argument '{name}': {}", e)))?;
    iter.enumerate().map(|(i, v)| v.and_then(|v| item(&v)).map_err(|e| at(i, e))).collect()
}

/// One row's tokens, appended to `flat`: a token id, or a sequence of them (not a string).
fn push_tokens(flat: &mut Vec<u32>, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
    if tokens.is_instance_of::<PyInt>() {
        flat.push(tokens.extract()?);
        return Ok(());
    }
    if tokens.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err("a token id or a sequence of token ids, not a string"));
    }
    if let Ok(list) = tokens.cast::<PyList>() {
        for t in list.iter() {
            flat.push(t.extract()?);
        }
        return Ok(());
    }
    flat.extend(tokens.extract::<Vec<u32>>()?);
    Ok(())
}

#[pymethods]
impl PyStepOutputs {
    #[new]
    #[pyo3(signature = (*, request_ids, tokens, finishes))]
    fn new(request_ids: &Bound<'_, PyAny>, tokens: &Bound<'_, PyAny>, finishes: &Bound<'_, PyAny>) -> PyResult<Self> {
        let request_ids = column("request_ids", request_ids, |v| v.extract::<u64>())?;
        let finishes = column("finishes", finishes, |v| {
            let f = v.extract::<u32>()?;
            if f > records::FINISH_ABORT {
                let why =
                    if f == records::FINISH_ERROR { " (an error finish is an Output with its reason)" } else { "" };
                return Err(PyValueError::new_err(format!("unknown finish code {f}{why}")));
            }
            Ok(f)
        })?;
        let mut flat = Vec::with_capacity(request_ids.len());
        let ends = column("tokens", tokens, |v| {
            push_tokens(&mut flat, v)?;
            Ok(flat.len())
        })?;
        if ends.len() != request_ids.len() || finishes.len() != request_ids.len() {
            return Err(PyValueError::new_err(format!(
                "columns of different lengths: {} request_ids, {} tokens, {} finishes",
                request_ids.len(),
                ends.len(),
                finishes.len()
            )));
        }
        Ok(PyStepOutputs { request_ids, finishes, tokens: flat, ends })
    }

    #[getter]
    fn request_ids(&self) -> Vec<u64> {
        self.request_ids.clone()
    }

    /// Each row's tokens as a list (however they were given).
    #[getter]
    fn tokens(&self) -> Vec<Vec<u32>> {
        (0..self.len()).map(|i| self.row_tokens(i).to_vec()).collect()
    }

    #[getter]
    fn finishes(&self) -> Vec<u32> {
        self.finishes.clone()
    }

    fn __len__(&self) -> usize {
        self.len()
    }

    /// The rows as `Output` records (what `Ring.drain_tokens` gives back for them).
    fn outputs(&self) -> Vec<PyOutput> {
        (0..self.len()).map(|i| PyOutput::plain(self.request_ids[i], self.row_tokens(i), self.finishes[i])).collect()
    }

    fn __repr__(&self) -> String {
        format!(
            "StepOutputs(request_ids={:?}, tokens={:?}, finishes={:?})",
            self.request_ids,
            self.tokens(),
            self.finishes
        )
    }
}

impl PyStepOutputs {
    fn len(&self) -> usize {
        self.request_ids.len()
    }

    fn row_tokens(&self, i: usize) -> &[u32] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.tokens[start..self.ends[i]]
    }

    /// The record's entries, borrowing the columns.
    pub(super) fn entries(&self) -> impl Iterator<Item = TokenEntry<'_, &[u32]>> {
        (0..self.len()).map(|i| TokenEntry {
            request_id: self.request_ids[i],
            finish: self.finishes[i],
            tokens: self.row_tokens(i),
            reason: None,
            logprobs: None,
            prompt_logprobs: None,
        })
    }
}

//! What Python hands the ring, parsed into records: a step's token entries (`Ring.publish`), a prompt's ids
//! (`Ring.push_submit`).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use crate::ring::records::{self, Logprobs, TokenEntry};

/// A step's entries parsed from Python: every entry's tokens in one buffer, so an entry of one token (the usual
/// decode step) costs no allocation of its own. Logprobs, for the entries that carry them, go to two more buffers
/// already in the record's byte layout.
#[derive(Default)]
pub(super) struct Parsed {
    entries: Vec<ParsedEntry>,
    tokens: Vec<u32>,
    values: Vec<u8>,
    alternatives: Vec<u8>,
    prompt_values: Vec<u8>,
}

struct ParsedEntry {
    request_id: u64,
    finish: u32,
    tokens: std::ops::Range<usize>,
    reason: Option<String>,
    /// (alternatives per token, range in `values`, range in `alternatives`)
    logprobs: Option<(u32, std::ops::Range<usize>, std::ops::Range<usize>)>,
    /// Range in `prompt_values`.
    prompt_logprobs: Option<std::ops::Range<usize>>,
}

impl Parsed {
    pub(super) fn push(&mut self, item: &Bound<'_, PyAny>) -> PyResult<()> {
        let t = item.cast::<PyTuple>()?;
        let reason = match t.len() {
            3 => None,
            4..=6 => t.get_borrowed_item(3)?.extract::<Option<String>>()?,
            n => {
                return Err(PyValueError::new_err(format!(
                    "token entry must be (request_id, tokens or token, finish[, reason[, logprobs[, prompt \
                     logprobs]]]), got {n} items"
                )));
            }
        };
        let finish: u32 = t.get_borrowed_item(2)?.extract()?;
        if finish > records::FINISH_ERROR {
            return Err(PyValueError::new_err(format!("unknown finish code {finish}")));
        }
        let start = self.tokens.len();
        let tokens = t.get_borrowed_item(1)?;
        if let Ok(list) = tokens.cast::<PyList>() {
            for token in list.iter() {
                self.tokens.push(token.extract()?);
            }
        } else if let Ok(token) = tokens.extract::<u32>() {
            self.tokens.push(token); // one token as an int: no list per token from a simulated step
        } else {
            self.tokens.extend(tokens.extract::<Vec<u32>>()?);
        }
        let n = self.tokens.len() - start;
        let logprobs = match t.len() {
            5 | 6 => {
                let lp = t.get_borrowed_item(4)?;
                if lp.is_none() { None } else { Some(self.logprobs(&lp, n)?) }
            }
            _ => None,
        };
        let prompt_logprobs = match t.len() {
            6 => {
                let plp = t.get_borrowed_item(5)?;
                if plp.is_none() { None } else { Some(self.prompt_logprobs(&plp)?) }
            }
            _ => None,
        };
        let request_id = t.get_borrowed_item(0)?.extract()?;
        let tokens = start..self.tokens.len();
        self.entries.push(ParsedEntry { request_id, finish, tokens, reason, logprobs, prompt_logprobs });
        Ok(())
    }

    /// One `(logprob, [(token, logprob), ...])` per token, every token with as many alternatives.
    fn logprobs(
        &mut self,
        lp: &Bound<'_, PyAny>,
        n: usize,
    ) -> PyResult<(u32, std::ops::Range<usize>, std::ops::Range<usize>)> {
        let (v0, a0) = (self.values.len(), self.alternatives.len());
        let mut top: Option<usize> = None;
        let mut count = 0;
        for item in lp.try_iter()? {
            let item = item?;
            let pair = item.cast::<PyTuple>()?;
            let value: f32 = pair.get_borrowed_item(0)?.extract()?;
            self.values.extend_from_slice(&value.to_le_bytes());
            let alts = pair.get_borrowed_item(1)?;
            let mut k = 0;
            for alt in alts.try_iter()? {
                let (token, value): (u32, f32) = alt?.extract()?;
                self.alternatives.extend_from_slice(&token.to_le_bytes());
                self.alternatives.extend_from_slice(&value.to_le_bytes());
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
        Ok((top as u32, v0..self.values.len(), a0..self.alternatives.len()))
    }

    /// One logprob per prompt token after the first.
    fn prompt_logprobs(&mut self, plp: &Bound<'_, PyAny>) -> PyResult<std::ops::Range<usize>> {
        let v0 = self.prompt_values.len();
        for value in plp.try_iter()? {
            let value: f32 = value?.extract()?;
            self.prompt_values.extend_from_slice(&value.to_le_bytes());
        }
        Ok(v0..self.prompt_values.len())
    }

    pub(super) fn token_entries(&self) -> Vec<TokenEntry<'_, &[u32]>> {
        self.entries
            .iter()
            .map(|e| TokenEntry {
                request_id: e.request_id,
                finish: e.finish,
                tokens: &self.tokens[e.tokens.clone()],
                reason: e.reason.as_deref(),
                logprobs: e.logprobs.as_ref().map(|(top, v, a)| Logprobs {
                    top: *top,
                    values: &self.values[v.clone()],
                    alternatives: &self.alternatives[a.clone()],
                }),
                prompt_logprobs: e.prompt_logprobs.as_ref().map(|r| &self.prompt_values[r.clone()]),
            })
            .collect()
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

//! Records' logprobs as Python reads them: the ranks' readers (`Ring.drain_tokens`) and the server's codec, which
//! hands a decode batch's logprobs to the Python decoders.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::ring::records::{Logprobs, LogprobsRun};

/// An entry's logprobs as Python reads them: `[(logprob, [(token, logprob), ...]), ...]`, one per token.
pub fn logprobs_to_py<'py>(py: Python<'py>, lp: &Logprobs<'_>) -> PyResult<Bound<'py, PyList>> {
    let n = lp.values.len() / 4;
    to_py(py, lp.values, lp.alternatives, std::iter::repeat_n(lp.top as usize, n))
}

/// A merged run's logprobs, each token with its own count of alternatives, in the same Python shape.
pub fn logprobs_run_to_py<'py>(py: Python<'py>, lp: &LogprobsRun<'_>) -> PyResult<Bound<'py, PyList>> {
    if lp.counts.len() != lp.values.len() / 4 {
        return Err(PyValueError::new_err("logprobs: a count of alternatives for every token is needed"));
    }
    to_py(py, lp.values, lp.alternatives, lp.counts.iter().map(|&c| usize::from(c)))
}

/// The one reader of the layout. The lengths are checked before anything is read: a short buffer is an error for
/// this decode, never an out-of-bounds index (a panic there would take the server's output thread down).
fn to_py<'py>(
    py: Python<'py>,
    values: &[u8],
    alternatives: &[u8],
    counts: impl Iterator<Item = usize> + Clone,
) -> PyResult<Bound<'py, PyList>> {
    let pairs: usize = counts.clone().sum();
    if alternatives.len() != 8 * pairs {
        return Err(PyValueError::new_err(format!(
            "logprobs: {} bytes of alternatives for {pairs} pairs",
            alternatives.len()
        )));
    }
    let u32_at = |b: &[u8], i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let f32_at = |b: &[u8], i: usize| f32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let out = PyList::empty(py);
    let mut o = 0;
    for (v, k) in values.chunks_exact(4).zip(counts) {
        let alts = PyList::empty(py);
        for _ in 0..k {
            alts.append((u32_at(alternatives, o), f64::from(f32_at(alternatives, o + 4))))?;
            o += 8;
        }
        out.append((f64::from(f32_at(v, 0)), alts))?;
    }
    Ok(out)
}

/// A prompt's logprobs as Python reads them: a list of floats.
pub fn prompt_logprobs_to_py<'py>(py: Python<'py>, values: &[u8]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, values.chunks_exact(4).map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(token: u32, value: f32) -> Vec<u8> {
        [token.to_le_bytes(), value.to_le_bytes()].concat()
    }

    #[test]
    fn a_run_merged_from_steps_with_different_counts_reads_each_token_with_its_own() {
        Python::initialize();
        Python::attach(|py| {
            let values: Vec<u8> = [-0.5f32, -1.0].iter().flat_map(|v| v.to_le_bytes()).collect();
            // Token 0 had two alternatives (a step that asked for 2), token 1 one (a step that found one).
            let alternatives = [pair(7, -0.5), pair(8, -2.0), pair(9, -1.0)].concat();
            let run = LogprobsRun { values: &values, alternatives: &alternatives, counts: &[2, 1] };
            let got: Vec<(f64, Vec<(u32, f64)>)> = logprobs_run_to_py(py, &run).unwrap().extract().unwrap();
            assert_eq!(got, vec![(-0.5, vec![(7, -0.5), (8, -2.0)]), (-1.0, vec![(9, -1.0)])]);

            let short = LogprobsRun { values: &values, alternatives: &alternatives, counts: &[2, 2] };
            assert!(logprobs_run_to_py(py, &short).is_err(), "too few bytes for the counts: an error, no panic");
            let missing = LogprobsRun { values: &values, alternatives: &alternatives, counts: &[3] };
            assert!(logprobs_run_to_py(py, &missing).is_err());
        });
    }
}

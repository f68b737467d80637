//! Records' logprobs as Python reads them: the ranks' readers (`Ring.drain_tokens`) and the server's codec, which
//! hands a decode batch's logprobs to the Python decoders.

use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::ring::records::Logprobs;

/// An entry's logprobs as Python reads them: `[(logprob, [(token, logprob), ...]), ...]`, one per token.
pub fn logprobs_to_py<'py>(py: Python<'py>, lp: &Logprobs<'_>) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    let top = lp.top as usize;
    let f32_at = |b: &[u8], i: usize| f32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    for (i, v) in lp.values.chunks_exact(4).enumerate() {
        let alts = PyList::empty(py);
        for j in 0..top {
            let o = 8 * (i * top + j);
            let token = u32::from_le_bytes([
                lp.alternatives[o],
                lp.alternatives[o + 1],
                lp.alternatives[o + 2],
                lp.alternatives[o + 3],
            ]);
            alts.append((token, f64::from(f32_at(lp.alternatives, o + 4))))?;
        }
        out.append((f64::from(f32_at(v, 0)), alts))?;
    }
    Ok(out)
}

/// A prompt's logprobs as Python reads them: a list of floats.
pub fn prompt_logprobs_to_py<'py>(py: Python<'py>, values: &[u8]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, values.chunks_exact(4).map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))))
}

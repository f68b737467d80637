//! Decoding a batch of tokens: one Python call for every request that has tokens in it, which returns each one's
//! framed SSE events (or its whole JSON body) and whether it ended.

use super::Codec;
use crate::doors::sse::frame_into;
use crate::ring::py::logprobs::{logprobs_run_to_py, prompt_logprobs_to_py};
use crate::ring::records::LogprobsRun;
use bytes::BytesMut;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

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

    fn from_code(code: u8) -> PyResult<Self> {
        Self::ALL.into_iter().find(|s| *s as u8 == code).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!("decode_batch returned an unknown state {code}"))
        })
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

impl Codec {
    /// Decode one batch: `(decoder, new tokens, engine finish code, logprobs if asked for)` per request, one
    /// Python call in all.
    pub fn decode(&self, py: Python<'_>, items: &[DecodeItem<'_>]) -> PyResult<Vec<Decoded>> {
        let list = PyList::empty(py);
        for item in items {
            let (decoder, finish) = (item.decoder.bind(py), item.finish);
            let tokens = PyList::new(py, item.tokens.iter())?;
            let logprobs = item.logprobs.as_ref().map(|lp| logprobs_run_to_py(py, lp)).transpose()?;
            match (logprobs, item.prompt_logprobs) {
                (None, None) => list.append((decoder, tokens, finish))?,
                (lp, None) => list.append((decoder, tokens, finish, lp))?,
                (lp, Some(p)) => list.append((decoder, tokens, finish, lp, prompt_logprobs_to_py(py, p)?))?,
            }
        }
        let out = self.decode_batch.bind(py).call1((list,))?;
        let mut decoded = Vec::with_capacity(items.len());
        for item in out.cast::<PyList>()?.iter() {
            let t = item.cast::<PyTuple>()?;
            let state = DecodeState::from_code(t.get_item(0)?.extract::<u8>()?)?;
            let payload = t.get_item(1)?;
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

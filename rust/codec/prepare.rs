//! Preparing a request: its body goes through the Python codec (conversion, encoding, grammar, decoder choice) in a
//! `PrepareInput` record and comes back converted and encoded (a `Prepared` record), or refused (a `Refusal`; all
//! three in seam.rs).

use super::seam::{PyPrepareInput, PyPrepared, PyRefusal};
use super::{Codec, internal};
use crate::doors::sse::frame_into;
use crate::doors::{Door, ForcedTool};
use crate::error::ApiError;
use crate::ring::records::{Constraint, ImageSet};
use bytes::BytesMut;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// What the HTTP layer asks the codec to prepare.
pub struct PrepareRequest {
    pub door: Door,
    pub body: Vec<u8>,
    pub response_id: String,
    pub model: String,
    pub ignore_eos: bool,
    pub include_usage: bool,
    pub continuous_usage: bool,
    /// A tool choice that forces a call: the codec constrains the output to a tool-call block.
    pub forced_tool: Option<ForcedTool>,
    /// The request has images: it is prepared on the image pool.
    pub has_images: bool,
    /// The image URLs the front end fetched, with their bytes.
    pub fetched: Vec<(String, bytes::Bytes)>,
}

/// A converted, encoded request.
pub struct Prepared {
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    /// Logprobs asked for: alternatives per token.
    pub logprobs: Option<u32>,
    /// The prompt tokens' logprobs asked for (Completions' `echo` with `logprobs`, vLLM's `prompt_logprobs`).
    pub prompt_logprobs: bool,
    pub constraint: Option<Constraint>,
    pub decoder: Py<PyAny>,
    /// Whether output must be decoded as it arrives (streams, stop sequences) or may wait for the end.
    pub incremental: bool,
    /// Framed SSE events to send before any token (the role delta); empty for non-streams.
    pub first: BytesMut,
    /// The prompt's images, in the file the codec wrote for the rank.
    pub images: Option<ImageSet>,
}

impl Prepared {
    /// Remove the images' file when no rank will read it (the request went nowhere).
    pub fn discard_images(&self) {
        if let Some(im) = &self.images {
            im.discard();
        }
    }
}

impl Codec {
    pub(super) fn prepare_blocking(&self, py: Python<'_>, req: &PrepareRequest) -> Result<Prepared, ApiError> {
        let (forced_tool, parallel_tools) = forced_args(req.forced_tool.as_ref());
        let images =
            req.has_images.then(|| fetched_to_py(py, &req.fetched)).transpose().map_err(|e| internal(py, e))?;
        let input = PyPrepareInput {
            door: req.door.code(),
            body: PyBytes::new(py, &req.body).unbind(),
            response_id: req.response_id.clone(),
            model: req.model.clone(),
            ignore_eos: req.ignore_eos,
            include_usage: req.include_usage,
            continuous_usage: req.continuous_usage,
            forced_tool,
            parallel_tools,
            images: images.map(Bound::unbind),
        };
        let input = Bound::new(py, input).map_err(|e| internal(py, e))?;
        let out = self.codec.bind(py).call_method1("prepare", (input,)).map_err(|e| internal(py, e))?;
        if let Ok(refusal) = out.cast::<PyRefusal>() {
            return Err(refusal.get().clone().into());
        }
        let record = out.cast::<PyPrepared>().map_err(|e| internal(py, e.into()))?;
        let mut r = record.try_borrow_mut().map_err(|e| internal(py, e.into()))?;
        let mut first = BytesMut::new();
        for s in &r.first_chunks {
            frame_into(&mut first, s.as_bytes());
        }
        Ok(Prepared {
            prompt: std::mem::take(&mut r.prompt),
            max_tokens: r.max_tokens,
            temperature: r.temperature,
            top_p: r.top_p,
            logprobs: r.logprobs,
            prompt_logprobs: r.prompt_logprobs,
            constraint: r.constraint.take(),
            decoder: r.decoder.clone_ref(py),
            incremental: r.incremental,
            first,
            images: r.images.take(),
        })
    }
}

/// A forced tool choice as the codec takes it: ("" any tool, a name that one; None forces nothing, whether its
/// calls may run in parallel).
pub(super) fn forced_args(forced: Option<&ForcedTool>) -> (Option<String>, bool) {
    (forced.map(|f| f.name.clone().unwrap_or_default()), forced.is_none_or(|f| f.parallel))
}

/// The fetched images as the codec takes them: `{url: bytes}`.
pub(super) fn fetched_to_py<'py>(py: Python<'py>, fetched: &[(String, bytes::Bytes)]) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (url, data) in fetched {
        d.set_item(url, PyBytes::new(py, data))?;
    }
    Ok(d)
}

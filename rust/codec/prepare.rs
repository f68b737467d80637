//! Preparing a request: its body goes through the Python codec (conversion, encoding, grammar, decoder choice) and
//! comes back converted and encoded, or refused.

use super::{Codec, internal};
use crate::doors::sse::frame_into;
use crate::doors::{Door, ForcedTool};
use crate::error::ApiError;
use crate::ring::records::{Constraint, ImageSet};
use axum::http::StatusCode;
use bytes::BytesMut;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

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
        let forced = forced_args(req.forced_tool.as_ref());
        let args = (
            PyBytes::new(py, &req.body),
            req.response_id.as_str(),
            req.model.as_str(),
            req.ignore_eos,
            req.include_usage,
            req.continuous_usage,
            req.door.code(),
            forced.0,
            forced.1,
            req.has_images.then(|| fetched_to_py(py, &req.fetched)).transpose().map_err(|e| internal(py, e))?,
        );
        let out = self.codec.bind(py).call_method1("prepare", args).map_err(|e| internal(py, e))?;
        if let Ok(t) = out.cast::<PyTuple>() {
            let (status, body): (u16, String) = t.extract().map_err(|e| internal(py, e))?;
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
            return Err(ApiError::Codec { status, body });
        }
        let get = |name: &str| out.getattr(name).map_err(|e| internal(py, e));
        let mut first = BytesMut::new();
        for s in get("first_chunks")?.cast::<PyList>().map_err(|e| internal(py, e.into()))?.iter() {
            let s = s.cast::<PyString>().map_err(|e| internal(py, e.into()))?;
            frame_into(&mut first, s.to_str().map_err(|e| internal(py, e))?.as_bytes());
        }
        Ok(Prepared {
            prompt: get("prompt_ids")?.extract().map_err(|e| internal(py, e))?,
            max_tokens: get("max_tokens")?.extract().map_err(|e| internal(py, e))?,
            temperature: get("temperature")?.extract().map_err(|e| internal(py, e))?,
            top_p: get("top_p")?.extract().map_err(|e| internal(py, e))?,
            logprobs: get("logprobs")?.extract().map_err(|e| internal(py, e))?,
            prompt_logprobs: get("prompt_logprobs")?.extract().map_err(|e| internal(py, e))?,
            constraint: get("constraint")?
                .extract::<Option<(u32, String, Vec<u32>, Option<u32>)>>()
                .map_err(|e| internal(py, e))?
                .map(|(schema_type, schema, triggers, bound)| Constraint { schema_type, schema, triggers, bound }),
            decoder: get("decoder")?.unbind(),
            incremental: get("incremental")?.extract().map_err(|e| internal(py, e))?,
            first,
            images: get("images")?
                .extract::<Option<(String, u32, Vec<[u32; 3]>)>>()
                .map_err(|e| internal(py, e))?
                .map(|(path, extra_tokens, sizes)| ImageSet { path, extra_tokens, sizes }),
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

//! What Python pushes onto a request ring (`Ring.push_submit`): a generation request as one typed record with
//! named fields, its grammar and its images as records of their own, where the tuples used to be. Built and checked
//! where Python builds it (a prompt id past u32, a field misnamed, fails there); the ring's `Submit` record
//! (records.rs) is what it becomes. The grammar and image records are the one Python shape of those two things:
//! the codec's `Prepared` carries them too, and a rank reads them back from its `Submit`.

use pyo3::prelude::*;

use super::entries::prompt_ids;
use crate::py_record::py_record;
use crate::ring::records::{Constraint, ImageSet, Submit};

py_record! {
    /// A request's grammar as a rank enforces it.
    #[derive(Debug, Clone)]
    pub struct SubmitConstraint {
        /// `SCHEMA_*`.
        pub schema_type: u32,
        pub schema: String,
        /// Token ids that start the constrained part (a tool call's opening); empty: from the first token.
        pub triggers: Vec<u32>,
        /// The token id that ends it, if one does.
        pub bound: Option<u32>,
    }
}

py_record! {
    /// A request's images as a rank reads them.
    #[derive(Debug, Clone)]
    pub struct SubmitImages {
        /// The file holding the encoded images back to back.
        pub path: String,
        /// Prompt tokens beyond the placeholders.
        pub extra_tokens: u32,
        /// Each image's (width, height, bytes), in the file's order.
        pub sizes: Vec<[u32; 3]>,
    }
}

impl From<&SubmitConstraint> for Constraint {
    fn from(c: &SubmitConstraint) -> Self {
        Constraint {
            schema_type: c.schema_type,
            schema: c.schema.clone(),
            triggers: c.triggers.clone(),
            bound: c.bound,
        }
    }
}

impl From<Constraint> for SubmitConstraint {
    fn from(c: Constraint) -> Self {
        SubmitConstraint { schema_type: c.schema_type, schema: c.schema, triggers: c.triggers, bound: c.bound }
    }
}

impl From<&SubmitImages> for ImageSet {
    fn from(im: &SubmitImages) -> Self {
        ImageSet { path: im.path.clone(), extra_tokens: im.extra_tokens, sizes: im.sizes.clone() }
    }
}

impl From<ImageSet> for SubmitImages {
    fn from(im: ImageSet) -> Self {
        SubmitImages { path: im.path, extra_tokens: im.extra_tokens, sizes: im.sizes }
    }
}

/// A generation request as Python pushes it (`Ring.push_submit`); the rank reads it back as a `Submit`.
#[pyclass(name = "SubmitInput", module = "deepinfer_server._native", frozen, get_all)]
pub struct PySubmitInput {
    request_id: u64,
    /// Token ids (from a sequence of ints, or little-endian u32 bytes).
    prompt: Vec<u32>,
    max_tokens: u32,
    temperature: f32,
    top_p: f32,
    /// -1: off.
    top_k: i32,
    seed: Option<u64>,
    ignore_eos: bool,
    logprobs: Option<u32>,
    prompt_logprobs: bool,
    constraint: Option<Py<SubmitConstraint>>,
    images: Option<Py<SubmitImages>>,
}

#[pymethods]
impl PySubmitInput {
    #[new]
    #[pyo3(signature = (*, request_id, prompt, max_tokens, temperature=1.0, top_p=1.0, top_k=-1, seed=None,
        ignore_eos=false, logprobs=None, prompt_logprobs=false, constraint=None, images=None))]
    #[allow(clippy::too_many_arguments)] // keyword-only: Python names every one
    fn new(
        request_id: u64,
        prompt: &Bound<'_, PyAny>,
        max_tokens: u32,
        temperature: f32,
        top_p: f32,
        top_k: i32,
        seed: Option<u64>,
        ignore_eos: bool,
        logprobs: Option<u32>,
        prompt_logprobs: bool,
        constraint: Option<Py<SubmitConstraint>>,
        images: Option<Py<SubmitImages>>,
    ) -> PyResult<Self> {
        let prompt = prompt_ids(prompt)?;
        Ok(PySubmitInput {
            request_id,
            prompt,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed,
            ignore_eos,
            logprobs,
            prompt_logprobs,
            constraint,
            images,
        })
    }

    fn __repr__(&self) -> String {
        format!("SubmitInput(request_id={}, max_tokens={})", self.request_id, self.max_tokens)
    }
}

impl PySubmitInput {
    /// The ring record it becomes.
    pub(super) fn record(&self) -> Submit<&[u32]> {
        let constraint = self.constraint.as_ref().map(|c| Constraint::from(c.get()));
        let images = self.images.as_ref().map(|im| ImageSet::from(im.get()));
        Submit {
            request_id: self.request_id,
            prompt: &self.prompt,
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs,
            prompt_logprobs: self.prompt_logprobs,
            constraint,
            images,
        }
    }
}

//! What the front end keeps of a generation request, whichever door it came in by.

use super::fields::{opt_bool, take_priority};
use super::{ForcedTool, Served, Spec};
use crate::error::ApiError;
use crate::media::ImageRef;
use serde_json::Value;

/// What the front end needs to know about a generation request, whichever door it came in by, plus the normalized
/// body for the codec.
#[derive(Debug)]
pub struct GenerateRequest {
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
    pub continuous_usage: bool,
    pub ignore_eos: bool,
    pub top_k: i32,
    pub seed: Option<u64>,
    /// A tool choice that forces a call (the codec constrains the output to one).
    pub forced_tool: Option<ForcedTool>,
    /// Wait-queue order: lower first.
    pub priority: i64,
    /// The request's images (fetched, for URLs, after admission).
    pub images: Vec<ImageRef>,
    /// What it asks of the state store: only the Responses door asks (None from every other door).
    pub keeping: Option<Keeping>,
    /// Whose it is (its API key's owner): what it stores is that owner's, and it continues only that owner's.
    pub owner: crate::owner::Owner,
    pub body: Vec<u8>,
}

/// What a Responses request asks of the state store: the step the request path runs for it (`crate::path`'s
/// `keep`), and its worker for one that runs in the background (`crate::workers::background`).
#[derive(Debug, Clone, Default)]
pub struct Keeping {
    /// Keep the response (`store`, on by default).
    pub store: bool,
    /// The stored response whose chain this request continues (`previous_response_id`).
    pub previous_response_id: Option<String>,
    /// The conversation whose items it continues, and gains its own (`conversation`).
    pub conversation: Option<String>,
    /// Run it in the background (`background: true`): answered at once, re-read by its id.
    pub background: bool,
}

impl GenerateRequest {
    /// Whether it runs in the background (Responses' `background: true`).
    pub fn background(&self) -> bool {
        self.keeping.as_ref().is_some_and(|k| k.background)
    }

    /// Whether the output may be held to a grammar: a forced tool call, or a body that names a structured format
    /// or a strict tool (an over-estimate is harmless: the check then finds none). Asked only of a request that
    /// must wait for a slot, whose grammar is then checked before the wait.
    pub fn may_constrain(&self) -> bool {
        const MARKS: [&[u8]; 4] = [b"\"json_schema\"", b"\"json_object\"", b"\"regex\"", b"\"strict\""];
        self.forced_tool.is_some() || MARKS.iter().any(|m| memchr::memmem::find(&self.body, m).is_some())
    }
}

/// A request body as a door's parse takes it: its JSON, and whether it may hold images (only a body that spells
/// "image" can: the cheap test on its bytes keeps text requests from a walk over their JSON).
pub struct Body {
    pub json: Value,
    pub may_have_images: bool,
}

impl Body {
    /// A body from its bytes.
    pub fn read(raw: &[u8]) -> Result<Self, ApiError> {
        Ok(Body {
            json: super::fields::json_body(raw)?,
            may_have_images: memchr::memmem::find(raw, b"image").is_some(),
        })
    }

    /// A body parsed already (a batch line's): its images are looked for in its JSON.
    pub fn parsed(json: Value) -> Self {
        Body { json, may_have_images: true }
    }
}

/// The images of a body.
pub fn images_of<D: Spec>(may_have_images: bool, body: &Value) -> Vec<ImageRef> {
    if may_have_images { D::image_refs(body) } else { Vec::new() }
}

/// The request of a door without stream options, seed or usage switches (Messages, Responses), from its checked
/// body.
pub fn plain<D: Spec>(
    may_have_images: bool,
    served: Served<'_>,
    mut body: Value,
    model: String,
    top_k: i32,
    forced_tool: Option<ForcedTool>,
) -> Result<GenerateRequest, ApiError> {
    served.pin::<D>(&mut body, &model)?;
    let images = images_of::<D>(may_have_images, &body);
    let obj = body.as_object_mut().ok_or(ApiError::Internal)?;
    let priority = take_priority(obj)?;
    Ok(GenerateRequest {
        model,
        stream: opt_bool(obj, "stream", "stream")?,
        include_usage: false,
        continuous_usage: false,
        // vLLM's extension, on every door: benchmark clients need outputs of an exact length.
        ignore_eos: opt_bool(obj, "ignore_eos", "ignore_eos")?,
        top_k,
        seed: None,
        forced_tool,
        priority,
        images,
        keeping: None,
        owner: Default::default(),
        body: serde_json::to_vec(&body).map_err(|_| ApiError::Internal)?,
    })
}

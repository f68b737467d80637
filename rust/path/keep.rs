//! Keeping a Responses answer, the step the Responses door asks for (`store`, `previous_response_id`,
//! `conversation`): the chain's or conversation's items put before the request's input, and its answer written to
//! the store before its caller has it (an answer that says "stored" follows the commit).

use super::AppState;
use super::origin::BackgroundRun;
use crate::dispatch::OnFinish;
use crate::doors::GenerateRequest;
use crate::error::ApiError;
use crate::store::responses::{Echo, Keep};
use crate::stream::Deliver;
use axum::body::Bytes;
use std::sync::Arc;

/// A stored Responses request, or one that continues a chain or a conversation: its input continued, and what its
/// response will be recorded with (None for a request that neither stores nor continues).
pub(super) async fn continue_from(st: &AppState, req: &mut GenerateRequest) -> Result<Option<Keep>, ApiError> {
    let Some(asked) = req.keeping.take() else { return Ok(None) };
    if !asked.store && asked.previous_response_id.is_none() && asked.conversation.is_none() {
        return Ok(None);
    }
    let Some(store) = &st.store else {
        let msg = "This server keeps no responses or conversations (its state store is off): send the whole input.";
        if asked.previous_response_id.is_some() {
            return Err(ApiError::bad_param("previous_response_id", msg));
        }
        if asked.conversation.is_some() {
            return Err(ApiError::bad_param("conversation", msg));
        }
        return Ok(None);
    };
    let body = std::mem::take(&mut req.body);
    let (previous, conversation) = (asked.previous_response_id, asked.conversation);
    let (body, keep) = store.continue_from(body, previous, conversation, asked.store, req.owner.clone()).await?;
    req.body = body;
    Ok(Some(keep))
}

/// What the Response says that deepseek-recipe cannot know: in its opening events, and at its end.
pub(super) fn echo(keep: Option<&Keep>, background: bool) -> Option<Echo> {
    let echo = keep.map(|k| Echo { previous: k.previous.clone(), conversation: k.conversation.clone(), background });
    echo.filter(Echo::needed)
}

/// What runs when the request's last bytes are ready, before its caller has them: the Response written (a
/// background run's under its claim, by its worker's own `record`), then delivered.
pub(super) fn on_finish(
    st: &AppState,
    keep: Option<Keep>,
    run: Option<Arc<dyn BackgroundRun>>,
    response_id: &str,
    stream: bool,
    echo: Option<Echo>,
) -> Option<OnFinish> {
    let (keep, store) = (keep?, st.store.clone()?);
    let rid = response_id.to_string();
    Some(Box::new(move |last: Bytes, deliver: Deliver| {
        // A background run's request has ended: its place in the lane is free before it reads as ended.
        if let Some(bg) = &run {
            bg.release();
        }
        let last = match &echo {
            Some(e) => Bytes::from(e.apply(&last)),
            None => last,
        };
        if let Some(bg) = run {
            bg.record(&store, keep, last, deliver);
        } else if keep.writes() {
            store.record_then(rid, keep, last, stream, deliver);
        } else {
            deliver(Ok(last));
        }
    }))
}

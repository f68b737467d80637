//! The request path from a parsed request: validate → admit → codec → dispatch → a stream, or a whole body. It
//! knows the doors only through `Door` (`crate::doors`): a door differs in its request checks and its wire
//! protocol; the codec converts its body, and its errors use its envelope.
//!
//! Every refusal (400, 404, 413, 429, 503) is decided before the answer starts, so a streaming client gets a real
//! HTTP status, never a 200 followed by an error event.

use super::AppState;
use super::answer::{Answer, Unary};
use super::keep;
use super::origin::{Call, Origin};
use super::pending::Entered;
use super::sse_body::SseBody;
use crate::codec::PrepareRequest;
use crate::dispatch::{Job, RequestMeta};
use crate::error::ApiError;
use crate::ring::records::{ImageSet, Submit};
use crate::stream::{Outlet, StreamBuf};
use bytes::Bytes;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// The answer to one call: a batch line comes with its slot; a client's request and a background run are admitted
/// here.
pub async fn serve(st: &Arc<AppState>, call: Call) -> Result<Answer, ApiError> {
    let Call { door, mut req, origin, arrival, request_id, traced } = call;
    let (trace, guard) = traced.unzip();
    let sibling = matches!(origin, Origin::Sibling);
    let (slot, run) = match origin {
        Origin::Client | Origin::Sibling => (None, None),
        Origin::BatchLine(slot) => (Some(slot), None),
        Origin::Background(run) => (None, Some(run)),
    };
    let background = req.background();
    let keep = keep::continue_from(st, &mut req).await?;
    let parsed = Instant::now();
    if let Some(err) = st.unavailable() {
        return Err(err);
    }
    // A client's request can be aborted by its id (`/abort_request`) from here on: while it waits for a slot, or
    // at the paused gate, here; once on its rank, through its rank's map.
    let client = slot.is_none() && run.is_none();
    let pending = client.then(|| st.pending.enter(&request_id));
    // Past capacity the request may wait here (the wait queue); its response has not started, so a refusal is
    // still a real status. A queued request whose client goes away is dropped, and leaves the queue with it.
    // A grammar is built and checked on the codec's grammar thread, before the request's prepare (which then
    // finds it cached): a client's costly schema takes that thread's time, not a text thread's. With no slot free
    // it is checked before the wait, so one that cannot be enforced is refused at once, not after the wait.
    let mut grammar_checked = false;
    let permit = match slot.map_or_else(|| st.admission.try_admit(), Ok) {
        Ok(permit) => permit,
        Err(_) => {
            if req.may_constrain() {
                st.codec.check_constraint(req.body.clone(), door, req.forced_tool.clone()).await?;
                grammar_checked = true;
            }
            let priority = if st.config.priority_scheduling { req.priority } else { 0 };
            tokio::select! {
                admitted = st.admission.admit(priority, sibling) => admitted?,
                () = aborted(pending.as_ref()) => return Err(ApiError::Aborted),
            }
        }
    };
    let admitted = Instant::now();
    if let Some(err) = st.unavailable() {
        return Err(err); // the server began to drain, or a rank failed, while the request waited
    }
    if !grammar_checked && req.may_constrain() {
        st.codec.check_constraint(req.body.clone(), door, req.forced_tool.clone()).await?;
    }
    // Image URLs are fetched now, with the slot held (it bounds how many fetches run), by the request's deadline.
    let deadline = st.config.request_timeout().map(|t| tokio::time::Instant::from_std(arrival + t));
    let has_images = !req.images.is_empty();
    let fetched = if has_images { st.media.fetch(&req.images, deadline).await? } else { Default::default() };
    let id = st.dispatcher.next_id();
    let response_id = match &run {
        Some(bg) => bg.id().to_string(),
        // The counter keeps ids unique; 64 random bits keep a stored response's id from being guessed.
        None => format!("{}{id:x}{:016x}", door.id_prefix(), crate::ids::random_u64()),
    };
    if let Some(t) = &trace {
        t.requested(&req.model, &response_id);
    }
    let echo = keep::echo(keep.as_ref(), background);
    let on_finish = keep::on_finish(st, keep, run, &response_id, req.stream, echo.clone());
    let prepare = PrepareRequest {
        door,
        body: req.body,
        response_id,
        model: req.model,
        ignore_eos: req.ignore_eos,
        include_usage: req.include_usage,
        continuous_usage: req.continuous_usage,
        forced_tool: req.forced_tool,
        has_images,
        fetched: fetched.into_iter().collect(),
    };
    let (outlet, reply) = if req.stream {
        let buf = StreamBuf::new(door, st.config.limits.max_stream_buffer_bytes);
        (Outlet::Stream(buf.clone()), Reply::Stream(buf))
    } else {
        let (outlet, rx) = Outlet::unary();
        (outlet, Reply::Unary(rx))
    };
    let (top_k, seed, ignore_eos) = (req.top_k, req.seed, req.ignore_eos);
    let dispatcher = st.dispatcher.clone();
    // Dispatch runs on the codec thread right after the conversion; the opening events go first in a stream.
    let ticket = st
        .codec
        .prepare_then(prepare, move |prepared| {
            if let Outlet::Stream(buf) = &outlet {
                match &echo {
                    Some(e) => buf.push(&e.apply(&prepared.first), false),
                    None => buf.push(&prepared.first, false), // the opening events: well under the cap
                };
            }
            let job = Job {
                submit: Submit {
                    request_id: id,
                    prompt: &prepared.prompt,
                    max_tokens: prepared.max_tokens,
                    temperature: prepared.temperature,
                    top_p: prepared.top_p,
                    // The prompt's logprobs are the model's own distribution (as OpenAI's and vLLM's are): DeepInfer
                    // computes them with the request's sampling parameters, so the codec sets temperature and
                    // top_p to 1 for such a request, and top-k is off.
                    top_k: if prepared.prompt_logprobs { -1 } else { top_k },
                    seed,
                    ignore_eos,
                    logprobs: prepared.logprobs,
                    prompt_logprobs: prepared.prompt_logprobs,
                    constraint: prepared.constraint,
                    images: prepared.images,
                },
                incremental: prepared.incremental,
            };
            if let Some(t) = &trace {
                t.sampling(prepared.max_tokens, prepared.temperature, prepared.top_p);
            }
            let meta = RequestMeta { id, request_id, arrival, parsed, admitted, on_finish, trace, abortable: client };
            let images = job.submit.images.clone();
            let sent = dispatcher.submit(meta, job, prepared.decoder, outlet, permit);
            if sent.is_err() {
                images.iter().for_each(ImageSet::discard); // no rank will read them
            }
            sent
        })
        .await?;
    if pending.as_ref().is_some_and(|p| p.is_aborted()) {
        ticket.abort_request(); // aborted on its way to its rank: it ends now, with nothing
    }
    drop(pending);
    let timeout = st.config.request_timeout();
    let rx = match reply {
        Reply::Stream(buf) => {
            let keep_alive = Duration::from_secs_f64(st.config.sse_keep_alive_s);
            return Ok(Answer::Stream(Box::pin(SseBody::new(buf, ticket, timeout, keep_alive, guard))));
        }
        Reply::Unary(rx) => rx,
    };
    let result = match timeout {
        Some(t) => match tokio::time::timeout(t, rx).await {
            Ok(r) => r,
            Err(_) => {
                ticket.abort("timeout");
                return Err(ApiError::Timeout(t.as_secs_f64()));
            }
        },
        None => rx.await,
    };
    drop(ticket);
    let json = result.map_err(|_| ApiError::Internal)??;
    Ok(Answer::Unary(Unary { json, guard }))
}

/// Resolves once a client's request is aborted (never for a request that cannot be).
async fn aborted(pending: Option<&Entered<'_>>) {
    match pending {
        Some(p) => p.aborted().await,
        None => std::future::pending().await,
    }
}

/// Where the path gets the answer: a stream's buffer, or a non-stream's whole body once.
enum Reply {
    Stream(Arc<StreamBuf>),
    Unary(oneshot::Receiver<Result<Bytes, ApiError>>),
}

//! The one request path of every generation door (Chat Completions, Completions, Messages, Responses):
//! validate → admit → codec → dispatch → stream or collect. It knows the doors only through `Door`
//! (`crate::doors`): a door differs in its request checks and its wire protocol; the codec converts its body, and
//! its errors use its envelope.
//!
//! Every refusal (400, 404, 413, 429, 503) is decided before the response starts, so a streaming client gets a
//! real HTTP status, never a 200 followed by an error event.

use super::AppState;
use super::body::RawBody;
use super::request_id::RequestId;
use super::sse::SseBody;
use super::traced::TraceParent;
use crate::admission::Permit;
use crate::codec::PrepareRequest;
use crate::dispatch::{Job, OnFinish, RequestMeta};
use crate::doors::{Door, GenerateRequest};
use crate::error::ApiError;
use crate::owner::Owner;
use crate::ring::records::{ImageSet, Submit};
use crate::store::background::Run;
use crate::store::responses::{Echo, Keep};
use crate::stream::{Deliver, Outlet, StreamBuf};
use crate::trace::{Outcome, RequestTrace, ResponseGuard, body::TracedBody};
use axum::Extension;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// The handler of every door's route (`http::app` registers one per `Door`).
pub async fn generate(
    door: Door,
    State(st): State<Arc<AppState>>,
    Extension(RequestId(request_id)): Extension<RequestId>,
    owner: Owner,
    parent: TraceParent,
    RawBody(body): RawBody,
) -> Response {
    if crate::fatal::fail_point("http") {
        panic!("fail point: http");
    }
    let arrival = Instant::now();
    let traced = parent.begin(&st, arrival, door.operation(), door.path());
    let trace = traced.as_ref().map(|(t, _)| t.clone());
    // Boxed, and only for a body that arrived: a request's whole state machine is allocated once its body is in,
    // not while a slow client is still sending it (axum allocates a handler's future, the largest of its states
    // included, before the body), nor for the 408s of a thousand trickled bodies that time out together.
    let handled = match body {
        Ok(body) => Box::pin(handle(&st, door, body, owner, arrival, request_id.clone(), traced)).await,
        Err(e) => Err(e),
    };
    match handled {
        Ok(resp) => resp,
        Err(e) => {
            st.dispatcher.metrics.rejected.with_label_values(&[e.code()]).inc();
            let trace_id = trace.as_ref().map(|t| tracing::field::display(t.trace_id()));
            tracing::info!(
                target: "deepinfer_server::request",
                request_id = %request_id,
                trace_id,
                status = e.status().as_u16(),
                reason = e.code(),
                "request refused: {e}"
            );
            if let Some(t) = &trace {
                t.ended(Outcome::of(e.status().as_u16(), e.code()));
            }
            door.respond(e)
        }
    }
}

async fn handle(
    st: &Arc<AppState>,
    door: Door,
    body: Bytes,
    owner: Owner,
    arrival: Instant,
    request_id: String,
    traced: Option<(Arc<RequestTrace>, ResponseGuard)>,
) -> Result<Response, ApiError> {
    let mut req = door.parse(&body, &st.config.served_model_names)?;
    req.owner = owner;
    if req.background {
        return super::background::start(st, door, req, arrival, request_id, traced).await;
    }
    serve(st, door, req, arrival, request_id, None, None, traced).await
}

/// The request path from a parsed request. `run`: the background response it is (`super::background` runs it
/// here, as a stream, once it has answered the client). `slot`: a batch line's slot, taken already
/// (`crate::batches`); others go through admission here. `traced`: its trace, when traces are on.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn serve(
    st: &Arc<AppState>,
    door: Door,
    mut req: GenerateRequest,
    arrival: Instant,
    request_id: String,
    run: Option<Arc<Run>>,
    slot: Option<Permit>,
    traced: Option<(Arc<RequestTrace>, ResponseGuard)>,
) -> Result<Response, ApiError> {
    let (trace, guard) = traced.unzip();
    if let Some(&on) = st.config.thinking_pins.get(&req.model) {
        req.body = door.pin_thinking(&req.body, on)?;
    }
    let keep = stored(st, &mut req).await?;
    let parsed = Instant::now();
    if let Some(err) = st.unavailable() {
        return Err(err);
    }
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
            st.admission.admit(if st.config.priority_scheduling { req.priority } else { 0 }).await?
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
        Some(run) => run.id.clone(),
        // The counter keeps ids unique; 64 random bits keep a stored response's id from being guessed.
        None => format!("{}{id:x}{:016x}", door.id_prefix(), crate::ids::random_u64()),
    };
    if let Some(t) = &trace {
        t.requested(&req.model, &response_id);
    }
    // What the Response says that deepseek-recipe cannot know: in its opening events, and at its end.
    let echo = keep.as_ref().map(|k| Echo {
        previous: k.previous.clone(),
        conversation: k.conversation.clone(),
        background: req.background,
    });
    let echo = echo.filter(Echo::needed);
    let on_finish = match (keep, &st.store) {
        (Some(keep), Some(store)) => {
            let (store, rid, stream, echo) = (store.clone(), response_id.clone(), req.stream, echo.clone());
            Some(Box::new(move |last: Bytes, deliver: Deliver| {
                // A background run's request has ended: its place in the lane is free before it reads as ended.
                if let Some(run) = &run {
                    run.release();
                }
                let last = match &echo {
                    Some(e) => Bytes::from(e.apply(&last)),
                    None => last,
                };
                // A background response's final state is written under its claim, by whoever ends it first (its
                // run, or a cancel or a stop, which then writes it), never by the batched writer.
                if let Some(run) = run {
                    super::background::record_then(&store, run, keep, last, deliver);
                } else if keep.writes() {
                    store.record_then(rid, keep, last, stream, deliver);
                } else {
                    deliver(Ok(last));
                }
            }) as OnFinish)
        }
        _ => None,
    };
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
        let buf = StreamBuf::new(door, st.config.max_stream_buffer_bytes);
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
            let meta = RequestMeta { id, request_id, arrival, parsed, admitted, on_finish, trace };
            let images = job.submit.images.clone();
            let sent = dispatcher.submit(meta, job, prepared.decoder, outlet, permit);
            if sent.is_err() {
                images.iter().for_each(ImageSet::discard); // no rank will read them
            }
            sent
        })
        .await?;
    let timeout = st.config.request_timeout();
    let rx = match reply {
        Reply::Stream(buf) => {
            let keep_alive = Duration::from_secs_f64(st.config.sse_keep_alive_s);
            return Ok(sse_response(Body::from_stream(SseBody::new(buf, ticket, timeout, keep_alive, guard))));
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
    let content_type = [(header::CONTENT_TYPE, "application/json")];
    Ok(match guard {
        Some(guard) => (content_type, Body::new(TracedBody::new(json, guard))).into_response(),
        None => (content_type, json).into_response(),
    })
}

/// Where the handler gets the answer: a stream's buffer, or a non-stream's whole body once.
enum Reply {
    Stream(Arc<StreamBuf>),
    Unary(oneshot::Receiver<Result<Bytes, ApiError>>),
}

pub(super) fn sse_response(body: impl Into<Body>) -> Response {
    let headers = [
        (header::CONTENT_TYPE, "text/event-stream"),
        (header::CACHE_CONTROL, "no-cache"),
        (header::HeaderName::from_static("x-accel-buffering"), "no"),
    ];
    (headers, body.into()).into_response()
}

/// A stored Responses request, or one that continues a chain or a conversation: the chain's or conversation's
/// items put before its input, and what its response will be recorded with (None for a request that neither
/// stores nor continues).
async fn stored(st: &AppState, req: &mut GenerateRequest) -> Result<Option<Keep>, ApiError> {
    if !req.store && req.previous_response_id.is_none() && req.conversation.is_none() {
        return Ok(None);
    }
    let Some(store) = &st.store else {
        let msg = "This server keeps no responses or conversations (its state store is off): send the whole input.";
        if req.previous_response_id.is_some() {
            return Err(ApiError::bad_param("previous_response_id", msg));
        }
        if req.conversation.is_some() {
            return Err(ApiError::bad_param("conversation", msg));
        }
        return Ok(None);
    };
    let body = std::mem::take(&mut req.body);
    let (previous, conversation) = (req.previous_response_id.take(), req.conversation.take());
    let (body, keep) = store.continue_from(body, previous, conversation, req.store, req.owner.clone()).await?;
    req.body = body;
    Ok(Some(keep))
}

//! The route of a door whose body may ask for several sequences (`Spec::FANS_OUT`: `/generate`'s batches and `n`,
//! Chat's and Completions' `n`): the door splits the body, each sequence is parsed as one request and run down the
//! one request path as its own call (its own slot), all at once, and their answers make one response. The first
//! sequence is admitted as any client's request; the others wait for slots however full the wait queue is
//! (`path::Origin::Sibling`), as SGLang queues every sequence it is given, so a rollout of 256 prompts × n 8 runs
//! on a server of 16 slots:
//! - `/generate`: the one answer, or a list of them in the door's order (one body that was a batch, or `n` > 1); a
//!   stream: every sequence's events as they come, then one `data: [DONE]`;
//! - Chat and Completions: one response whose choice i is sequence i's (`super::choices`).
//!
//! A body that asks for one sequence is answered as it is, at no cost beyond the split. Every refusal is decided
//! before the response starts: if any sequence is refused (a 429 when the first finds neither a slot nor a place
//! in the queue, a 400 from the codec), the whole request is, and the sequences already running are aborted
//! (their answers dropped).

use super::AppState;
use crate::doors::{Body as DoorBody, Door, sse};
use crate::error::ApiError;
use crate::owner::Owner;
use crate::path::{Answer, Call, Gathered, Origin, Unary, serve};
use crate::trace::Traced;
use axum::body::{Body, Bytes};
use axum::response::Response;
use futures_util::StreamExt;
use futures_util::future::try_join_all;
use serde_json::Value;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Split, run and gather one fan-out request.
pub(super) async fn handle(
    st: &Arc<AppState>,
    door: Door,
    body: Bytes,
    owner: Owner,
    arrival: Instant,
    request_id: String,
    traced: Traced,
) -> Result<Response, ApiError> {
    let DoorBody { json, may_have_images } = DoorBody::read(&body)?;
    let limits = &st.config.limits;
    let bounds = (limits.max_generate_fanout, limits.max_generate_fanout_bytes);
    let split = door.split(json, &request_id, body.len(), bounds)?;
    // What every `/generate` sequence's answer reports: the weights that serve it, and when its request arrived
    // (SGLang's `received_time`, from which `e2e_latency` counts). The server's, never the client's.
    let stamp = (!split.choices).then(|| {
        let received = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        (Value::String(crate::path::weight_version(st)), Value::from(received - arrival.elapsed().as_secs_f64()))
    });
    let mut calls = Vec::with_capacity(split.bodies.len());
    let mut traced = Some(traced); // the request's trace follows its first sequence
    for (i, (mut one, rid)) in split.bodies.into_iter().zip(split.rids).enumerate() {
        if let (Some(obj), Some((version, received))) = (one.as_object_mut(), &stamp) {
            obj.insert("weight_version".into(), version.clone());
            obj.insert("received_time".into(), received.clone());
        }
        let mut req = door.parse_body(DoorBody { json: one, may_have_images }, (&st.config).into())?;
        req.owner = owner.clone();
        let traced = traced.take().flatten();
        let origin = if i == 0 { Origin::Client } else { Origin::Sibling };
        calls.push(Call { door, req, origin, arrival, request_id: rid, traced });
    }
    // Each sequence fetches its own copy of the images (with its slot held): the copies count together against
    // the one request's bound, so n cannot multiply what a client makes the server fetch and decode.
    let images: usize = calls.iter().map(|c| c.req.images.len()).sum();
    if calls.len() > 1 && images > st.config.limits.max_images_per_request {
        let most = st.config.limits.max_images_per_request;
        let msg = format!(
            "{} sequences of this request carry {images} images in all, more than the {most} allowed.",
            calls.len()
        );
        return Err(ApiError::bad_param("n", msg));
    }
    let mut answers = try_join_all(calls.into_iter().map(|call| serve(st, call))).await?;
    Ok(match (split.choices, split.single) {
        (true, true) => super::generate::respond(answers.pop().ok_or(ApiError::Internal)?),
        (true, false) => {
            let id = format!("{}{:016x}", door.id_prefix(), crate::ids::random_u64());
            super::generate::respond(super::choices::merge(answers, id))
        }
        (false, single) => gather(answers, single),
    })
}

/// One response from the sequences' answers, in order.
fn gather(answers: Vec<Answer>, single: bool) -> Response {
    let Gathered { streams, mut jsons, guard } = Gathered::of(answers);
    if !streams.is_empty() {
        let done = futures_util::stream::once(async { Ok(Bytes::from_static(sse::DONE)) });
        let merged = futures_util::stream::select_all(streams).chain(done);
        return super::generate::sse_response(Body::from_stream(merged));
    }
    let json = match (single, jsons.len()) {
        (true, 1) => jsons.pop().unwrap_or_default(),
        _ => {
            let mut list = Vec::with_capacity(jsons.iter().map(|j| j.len() + 1).sum::<usize>() + 2);
            list.push(b'[');
            for (i, j) in jsons.iter().enumerate() {
                if i > 0 {
                    list.push(b',');
                }
                list.extend_from_slice(j);
            }
            list.push(b']');
            Bytes::from(list)
        }
    };
    super::generate::respond(Answer::Unary(Unary { json, guard }))
}

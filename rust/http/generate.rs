//! The route of every generation door (Chat Completions, Completions, Messages, Responses): the body parsed by
//! its door, then the one request path (`crate::path`), whose answer becomes the response; a background request
//! goes to its worker (`crate::workers::background`), which answers at once. A door whose body may ask for several
//! sequences (`/generate`) goes through `fanout`.

use super::body::RawBody;
use super::request_id::RequestId;
use super::route_state::RouteState;
use super::traced::{TraceParent, Traced};
use crate::doors::Door;
use crate::error::ApiError;
use crate::owner::Owner;
use crate::path::{Answer, Call, Origin, Unary, serve};
use crate::trace::{Outcome, body::TracedBody};
use axum::Extension;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use std::time::Instant;

/// The handler of every door's route (`http::app` registers one per `Door`).
pub async fn generate(
    door: Door,
    State(routes): State<RouteState>,
    Extension(RequestId(request_id)): Extension<RequestId>,
    owner: Owner,
    parent: TraceParent,
    RawBody(body): RawBody,
) -> Response {
    if crate::fatal::fail_point("http") {
        panic!("fail point: http");
    }
    let arrival = Instant::now();
    let st = &routes.path;
    let traced = parent.begin(st, arrival, door.operation(), door.path());
    let trace = traced.as_ref().map(|(t, _)| t.clone());
    // Boxed, and only for a body that arrived: a request's whole state machine is allocated once its body is in,
    // not while a slow client is still sending it (axum allocates a handler's future, the largest of its states
    // included, before the body), nor for the 408s of a thousand trickled bodies that time out together.
    let handled = match body {
        Ok(body) => Box::pin(handle(&routes, door, body, owner, arrival, request_id.clone(), traced)).await,
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
    routes: &RouteState,
    door: Door,
    body: Bytes,
    owner: Owner,
    arrival: Instant,
    request_id: String,
    traced: Traced,
) -> Result<Response, ApiError> {
    let st = &routes.path;
    if door.fans_out() {
        return super::fanout::handle(st, door, body, owner, arrival, request_id, traced).await;
    }
    let mut req = door.parse(&body, (&st.config).into())?;
    req.owner = owner;
    let answer = if req.background() {
        let background = routes.background.as_ref();
        crate::workers::background::start(background, st, door, req, arrival, request_id, traced).await?
    } else {
        serve(st, Call { door, req, origin: Origin::Client, arrival, request_id, traced }).await?
    };
    Ok(respond(answer))
}

/// The response an answer makes: an SSE stream, or a JSON body (whose trace ends once it is written).
pub(super) fn respond(answer: Answer) -> Response {
    let json = [(header::CONTENT_TYPE, "application/json")];
    match answer {
        Answer::Stream(events) => sse_response(Body::from_stream(events)),
        Answer::Unary(Unary { json: body, guard: Some(guard) }) => {
            (json, Body::new(TracedBody::new(body, guard))).into_response()
        }
        Answer::Unary(Unary { json: body, guard: None }) => (json, body).into_response(),
    }
}

pub(super) fn sse_response(body: impl Into<Body>) -> Response {
    let headers = [
        (header::CONTENT_TYPE, "text/event-stream"),
        (header::CACHE_CONTROL, "no-cache"),
        (header::HeaderName::from_static("x-accel-buffering"), "no"),
    ];
    (headers, body.into()).into_response()
}

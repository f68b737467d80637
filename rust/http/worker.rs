//! The worker metadata the gateways in front of several replicas read, in their own shapes:
//! `/version` (vLLM), `/v1/loads` and `/loads` (SGLang, read by smg), `/get_load` (vllm-router),
//! `/server_info` and `/model_info` with their `get_*` aliases (SGLang, read by smg and sglang-router), and
//! `POST /v1/chat/completions/render` (vLLM: the prompt token IDs a chat body renders to).
//!
//! Everything but `render` is answered from Rust state (config, admission, the ranks' status words): no GIL, no
//! rank round trip, so a gateway polling every replica every second costs next to nothing.

use super::AppState;
use super::body::RawBody;
use super::request_id::RequestId;
use crate::codec::PrepareRequest;
use crate::doors::Door;
use crate::error::ApiError;
use crate::ring::status::{AUX_KV_CAPACITY_TOKENS, AUX_KV_USAGE_PPM, AUX_QUEUED_TOKENS};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::Arc;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub async fn version() -> Response {
    Json(json!({"version": VERSION})).into_response()
}

#[derive(Deserialize)]
pub struct LoadsQuery {
    model: Option<String>,
}

/// One entry per data-parallel rank. Requests in flight on a rank beyond `--max-num-seqs` wait in its engine,
/// as `vllm:num_requests_running`/`_waiting` count them; KV figures come from the rank's status words.
pub async fn loads(State(st): State<Arc<AppState>>, q: Result<Query<LoadsQuery>, QueryRejection>) -> Response {
    let q = match q {
        Ok(Query(q)) => q,
        Err(e) => return ApiError::bad_request(format!("Invalid query string: {}", e.body_text())).into_response(),
    };
    if let Some(model) = q.model.filter(|m| !st.config.served_model_names.contains(m)) {
        return ApiError::ModelNotFound(model).into_response();
    }
    let seqs = st.config.max_num_seqs as usize;
    // The wait queue is the server's, not a rank's: spread it over the ranks, which its requests will go to.
    let (queued, ranks) = (st.admission.queued(), st.dispatcher.ranks.len().max(1));
    let loads: Vec<Value> = st
        .dispatcher
        .ranks
        .iter()
        .map(|link| {
            let waiting = queued / ranks + usize::from(link.index < queued % ranks);
            let n = link.in_flight();
            let capacity = link.output.aux(AUX_KV_CAPACITY_TOKENS);
            let usage = link.output.aux(AUX_KV_USAGE_PPM).min(1_000_000) as f64 / 1e6;
            json!({
                "dp_rank": link.index,
                "num_running_reqs": n.min(seqs),
                "num_waiting_reqs": n.saturating_sub(seqs) + waiting,
                "num_total_reqs": n + waiting,
                "num_waiting_uncached_tokens": link.output.aux(AUX_QUEUED_TOKENS),
                "num_used_tokens": (usage * capacity as f64).round() as u64,
                "max_total_num_tokens": capacity,
                "token_usage": usage,
                "max_running_requests": seqs,
                "paused": st.admission.is_paused(),
            })
        })
        .collect();
    Json(json!({
        "timestamp": rfc3339_now(),
        "version": VERSION,
        "dp_rank_count": loads.len(),
        "paused": st.admission.is_paused(), // a paused replica's requests wait (`/pause_generation`)
        "loads": loads,
    }))
    .into_response()
}

/// vllm-router's power-of-two load: requests this replica holds (admitted and not yet done, or queued).
pub async fn get_load(State(st): State<Arc<AppState>>) -> Response {
    // vllm-router reads exactly `{"load": n}`; a paused replica's waiting requests count in it (`/v1/loads` says
    // `paused`).
    Json(json!({"load": st.admission.in_flight() + st.admission.queued()})).into_response()
}

pub async fn server_info(State(st): State<Arc<AppState>>) -> Response {
    let c = &st.config;
    let mut info = common_info(&st);
    info.extend([
        ("max_num_seqs".into(), json!(c.max_num_seqs)),
        ("ep_size".into(), json!(c.engine.expert_parallel_size)),
        ("cp_size".into(), json!(c.engine.context_parallel_size)),
        ("max_total_tokens".into(), json!(kv_capacity(&st))),
        ("engine".into(), json!(c.engine.engine)),
        ("is_embedding".into(), json!(false)),
        ("disaggregation_mode".into(), json!("null")),
    ]);
    Json(Value::Object(info)).into_response()
}

pub async fn model_info(State(st): State<Arc<AppState>>) -> Response {
    let mut info = common_info(&st);
    info.extend([
        ("is_generation".into(), json!(true)),
        ("has_image_understanding".into(), json!(st.media.is_enabled())),
        ("has_audio_understanding".into(), json!(false)),
        ("model_type".into(), json!(st.config.engine.model_type)),
    ]);
    Json(Value::Object(info)).into_response()
}

/// The fields both info routes carry, under SGLang's names.
fn common_info(st: &AppState) -> serde_json::Map<String, Value> {
    let c = &st.config;
    let name = c.served_model_names.first().cloned().unwrap_or_default();
    let fields = json!({
        "served_model_name": name,
        "served_model_names": c.served_model_names,
        "model_path": c.engine.model_path.clone().unwrap_or(name),
        "max_running_requests": st.admission.capacity(),
        "context_length": c.max_model_len,
        "dp_size": st.dispatcher.ranks.len(),
        "version": VERSION,
        "weight_version": crate::path::weight_version(st),
        "paused": st.admission.is_paused(),
    });
    let Value::Object(map) = fields else { unreachable!("a JSON object literal") };
    map
}

/// Total KV capacity in tokens over the ranks (0 when the engine does not report it).
fn kv_capacity(st: &AppState) -> u64 {
    st.dispatcher.ranks.iter().map(|l| l.output.aux(AUX_KV_CAPACITY_TOKENS)).sum()
}

/// `POST /v1/chat/completions/render` in vLLM's shape (a `GenerateRequest`): the body goes through the same checks
/// and the same codec conversion and encoding as a chat request, and nothing is sent to a rank. It takes an
/// admission slot as a request does: it costs a codec thread and may fetch images.
pub async fn render_chat(
    State(st): State<Arc<AppState>>,
    Extension(RequestId(request_id)): Extension<RequestId>,
    RawBody(body): RawBody,
) -> Result<Response, ApiError> {
    let body = body?;
    let req = Door::Chat.parse(&body, (&st.config).into())?;
    let _slot = st.admission.admit(0, false).await?;
    let deadline = st.config.request_timeout().map(|t| tokio::time::Instant::now() + t);
    if req.may_constrain() {
        st.codec.check_constraint(req.body.clone(), Door::Chat, req.forced_tool.clone()).await?;
    }
    let prepare = PrepareRequest {
        door: Door::Chat,
        body: req.body,
        response_id: format!("render-{:x}", st.dispatcher.next_id()),
        model: req.model.clone(),
        ignore_eos: req.ignore_eos,
        include_usage: false,
        continuous_usage: false,
        forced_tool: req.forced_tool.clone(),
        has_images: !req.images.is_empty(),
        fetched: st.media.fetch(&req.images, deadline).await?.into_iter().collect(),
    };
    // Only plain values leave the codec thread; the request's decoder is dropped there (its images too: no rank
    // will read them).
    let seed = req.seed;
    let (token_ids, max_tokens, temperature, top_p) = st
        .codec
        .prepare_then(prepare, |p| {
            p.discard_images();
            Ok((p.prompt, p.max_tokens, p.temperature, p.top_p))
        })
        .await?;
    Ok(Json(json!({
        "request_id": request_id,
        "token_ids": token_ids,
        "features": null,
        "sampling_params": {
            "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": req.top_k, "seed": seed,
            "ignore_eos": req.ignore_eos,
        },
        "model": req.model,
        "stream": req.stream,
        "stream_options": null,
        "cache_salt": null,
        "priority": req.priority, // vLLM's: what the request sent (0 when absent)
        "kv_transfer_params": null,
    }))
    .into_response())
}

/// Now as RFC 3339 UTC with milliseconds (the `timestamp` SGLang's `/v1/loads` carries).
fn rfc3339_now() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    rfc3339(now.as_secs(), now.subsec_millis())
}

/// Unix seconds (and milliseconds) as RFC 3339 UTC (also Anthropic's message batches' times).
pub(super) fn rfc3339(secs: u64, millis: u32) -> String {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::rfc3339;

    #[test]
    fn rfc3339_dates() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400, 5), "2000-02-29T00:00:00.005Z");
        assert_eq!(rfc3339(1_796_083_199, 999), "2026-11-30T23:59:59.999Z");
    }
}

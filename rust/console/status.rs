//! `GET /console/status`: what the console's status view draws, as one compact JSON document read from Rust state
//! alone (no GIL, no rank lock, no database on the call's path): the layout, each rank's state, slots and the wait
//! queue, the last five minutes (`crate::pulse`), refusals and aborts by code, and the store's size against its quotas
//! (counted in the background at most every `STORE_EVERY`). No prompt or output text is ever in it.

use crate::path::AppState;
use crate::ring::status::{AUX_HEARTBEAT_MS, AUX_KV_USAGE_PPM, monotonic_ms};
use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use prometheus::IntCounterVec;
use prometheus::core::Collector;
use serde_json::{Map, Value, json};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A rank with requests that has not stamped its heartbeat for this long shows as stalled (the watchdog acts
/// later, at --watchdog-timeout; a console should say so before).
const STALL_MS: u64 = 5_000;
/// How stale the store's sizes may be: they are sums over tables, not something to run once a second per poller.
const STORE_EVERY: Duration = Duration::from_secs(5);

/// The store's sizes as last counted, and whether a count is on its way.
#[derive(Default)]
pub struct StoreSizes {
    last: Mutex<Option<(Instant, Value)>>,
    counting: AtomicBool,
}

pub async fn status(State(st): State<Arc<AppState>>, sizes: Arc<StoreSizes>) -> Response {
    let body = document(&st, &sizes);
    ([(header::CACHE_CONTROL, "no-store")], Json(body)).into_response()
}

pub fn document(st: &Arc<AppState>, sizes: &Arc<StoreSizes>) -> Value {
    let c = &st.config;
    let draining = st.draining.load(Ordering::Acquire);
    let now_ms = monotonic_ms();
    let ranks: Vec<Value> = st
        .dispatcher
        .ranks
        .iter()
        .map(|link| {
            let in_flight = link.in_flight();
            let heartbeat = link.output.aux(AUX_HEARTBEAT_MS);
            let silent_ms = now_ms.saturating_sub(heartbeat.max(link.busy_since_ms()));
            let state = if !link.is_alive() {
                "down"
            } else if draining {
                "draining"
            } else if in_flight > 0 && silent_ms >= STALL_MS {
                "stalled"
            } else {
                "ready"
            };
            json!({
                "rank": link.index, "state": state, "in_flight": in_flight,
                "kv_usage": link.output.aux(AUX_KV_USAGE_PPM) as f64 / 1e6,
                "heartbeat_age_s": (now_ms.saturating_sub(heartbeat) as f64 / 100.0).round() / 10.0,
            })
        })
        .collect();
    let metrics = &st.dispatcher.metrics;
    json!({
        "model": c.served_model_names.first(),
        "served_names": c.served_model_names,
        "engine": c.engine.engine,
        "version": env!("CARGO_PKG_VERSION"),
        "parallel": {"dp": st.dispatcher.ranks.len(), "ep": c.engine.expert_parallel_size,
                     "cp": c.engine.context_parallel_size},
        "max_model_len": c.max_model_len,
        "healthy": st.unavailable().is_none(),
        "draining": draining,
        "started_unix": st.started_unix,
        "ranks": ranks,
        "slots": {
            "used": st.admission.in_flight(), "total": st.admission.capacity(),
            "queued": st.admission.queued(), "batch": st.admission.batch_in_flight(),
        },
        "window": metrics.pulse.window(),
        "refused": by_label(&metrics.rejected),
        "aborted": by_label(&metrics.aborted),
        "finished": by_label(&metrics.success),
        "store": store(st, sizes),
    })
}

/// A counter family's non-zero values by their one label (a refusal's code, an abort's reason).
fn by_label(counters: &IntCounterVec) -> Map<String, Value> {
    let mut out = Map::new();
    for family in counters.collect() {
        for m in family.get_metric() {
            let n = m.get_counter().get_value();
            if let (Some(label), true) = (m.get_label().first(), n > 0.0) {
                out.insert(label.value().to_string(), json!(n as u64));
            }
        }
    }
    out
}

/// The last count (Null until the first is in), starting a new one in the background when it is stale.
fn store(st: &Arc<AppState>, sizes: &Arc<StoreSizes>) -> Value {
    let Some(store) = st.store.clone() else { return Value::Null };
    let last = sizes.last.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let stale = last.as_ref().is_none_or(|(at, _)| at.elapsed() >= STORE_EVERY);
    if stale && !sizes.counting.swap(true, Ordering::AcqRel) {
        let (sizes, limits) = (sizes.clone(), st.config.limits.clone());
        tokio::spawn(async move {
            let stored = store.db.stored_bytes().await.ok();
            let files = match store.files {
                Some(_) => store.db.files_bytes(None).await.ok(),
                None => None,
            };
            let cap = |v: u64| (v > 0).then_some(v);
            let value = json!({
                "bytes": stored, "max_bytes": cap(limits.max_state_store_bytes),
                "files": store.files.is_some(), "files_bytes": files,
                "files_max_bytes": store.files.as_ref().and_then(|f| f.total_max),
            });
            *sizes.last.lock().unwrap_or_else(|e| e.into_inner()) = Some((Instant::now(), value));
            sizes.counting.store(false, Ordering::Release);
        });
    }
    last.map_or(Value::Null, |(_, v)| v)
}

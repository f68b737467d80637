//! The one request path of every generation door, below HTTP: a parsed request (`crate::doors`) and where it came
//! from (`Origin`: a client, a batch line, a background run) go through admission → codec → dispatch, and come
//! back as a typed `Answer` (a stream of SSE events, or a whole JSON body). HTTP handlers turn an answer into a
//! response (`crate::http`); the workers that run requests without a client (`crate::workers`) use it directly.

mod answer;
pub mod control;
mod keep;
mod origin;
pub mod pending;
pub mod reload;
mod serve;
pub mod sse_body;
pub mod weights;

pub use answer::{Answer, Events, Gathered, Unary};
pub use origin::{BackgroundRun, Call, Origin};
pub use serve::serve;

use crate::admission::Admission;
use crate::codec::Codec;
use crate::config::ServerConfig;
use crate::dispatch::Dispatcher;
use crate::error::ApiError;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// What the request path runs on, shared by every handler and worker.
pub struct AppState {
    pub config: ServerConfig,
    pub admission: Admission,
    pub codec: Arc<Codec>,
    pub dispatcher: Arc<Dispatcher>,
    /// Fetches image URLs behind the address guard.
    pub media: crate::media::Fetcher,
    /// Stored responses and conversations; None when the state store is off (`--state-store off`,
    /// `--disable-response-store`).
    pub store: Option<Arc<crate::store::Store>>,
    /// OpenTelemetry traces; None when off (no OTLP endpoint).
    pub traces: Option<Arc<crate::trace::Traces>>,
    /// Set on SIGTERM: stop admitting, report 503 on /health, let in-flight requests finish.
    pub draining: AtomicBool,
    pub started_unix: u64,
    /// Clients' requests not yet on a rank, by request id (`/abort_request`).
    pub pending: pending::Pending,
    /// The served weights' version.
    pub weights: weights::Weights,
}

/// The version of the weights being served (SGLang's `weight_version`, "default" until one is named): what
/// `/generate` tags each answer with (`meta_info.weight_version`), `/get_weight_version` and the worker info.
pub fn weight_version(st: &AppState) -> String {
    st.weights.version()
}

impl AppState {
    /// Why the service cannot take requests right now, if it cannot.
    pub fn unavailable(&self) -> Option<ApiError> {
        if crate::fatal::is_fatal() {
            return Some(ApiError::Unavailable("The server hit an internal error and is restarting.".into()));
        }
        if self.draining.load(Ordering::Acquire) {
            return Some(ApiError::Unavailable("The server is shutting down.".into()));
        }
        if let Some(r) = self.dispatcher.ranks.iter().find(|r| !r.is_alive()) {
            return Some(ApiError::Unavailable(format!("Engine rank {} is not running.", r.index)));
        }
        if self.dispatcher.ranks.is_empty() {
            return Some(ApiError::Unavailable("No engine rank is running.".into()));
        }
        None
    }
}

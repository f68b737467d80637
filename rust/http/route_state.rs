//! What the routes run on: the request path's state, and the background worker's context beside it (the path sits
//! below the workers and names none of them, so the worker's state cannot ride in `AppState`). A handler takes the
//! part it needs (`State<Arc<AppState>>`, `State<Option<Arc<Background>>>`), each typed.

use super::AppState;
use crate::workers::background::Background;
use axum::extract::FromRef;
use std::sync::Arc;

#[derive(Clone)]
pub struct RouteState {
    pub path: Arc<AppState>,
    /// None without a state store: background responses are refused.
    pub background: Option<Arc<Background>>,
}

impl FromRef<RouteState> for Arc<AppState> {
    fn from_ref(routes: &RouteState) -> Self {
        routes.path.clone()
    }
}

impl FromRef<RouteState> for Option<Arc<Background>> {
    fn from_ref(routes: &RouteState) -> Self {
        routes.background.clone()
    }
}

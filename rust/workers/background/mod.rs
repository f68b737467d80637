//! Background responses (Responses' `background: true`): the client gets the queued Response at once (or, with
//! `stream: true`, its stream), and the request then runs through the one request path like any other, admission
//! included, as a stream whose events are kept (`runs`) for `GET /v1/responses/{id}?stream=true&
//! starting_after=N`. The Response is in the store from the moment it is queued, so any replica answers `GET`;
//! `POST /v1/responses/{id}/cancel` stops it on the replica that runs it, asked through any (`lease`,
//! which also runs it again elsewhere if its replica dies).
//!
//! Its writes name its claim (`store::background::Claim`, issue 40): `in_progress` as it reaches a rank, then one
//! final state, written by whoever ends it first (its run, a cancel, a DELETE); a run whose claim was lost writes
//! nothing. A drain hands it over instead of failing it (`hand_over`).
//!
//! Traced, the `POST` has its own short span, and the run a trace of its own linked to it (`crate::trace`).

mod events;
mod lease;
mod queued;
mod run;
pub mod runs;

pub use lease::start as keep_claims;
pub use run::{cancel, start};
pub use runs::{Limits, Run, Runs};

use crate::store::Store;
use std::sync::Arc;

/// What the worker runs on: the store its runs are written to, and the registry of the runs on this replica. Made
/// with the store (`server.rs`: none without one) and handed to what starts, reads and cancels runs (their routes,
/// `keep_claims`); the store itself knows nothing of it.
pub struct Background {
    pub store: Arc<Store>,
    pub runs: Runs,
}

//! Who asks the request path for an answer, and what it brings: a client's request is admitted on the path (the
//! wait queue included); a batch line comes with the slot its lane took; a background run with its run, whose id
//! its Response has and whose claim its end is written under.

use crate::admission::Permit;
use crate::doors::{Door, GenerateRequest};
use crate::store::Store;
use crate::store::responses::Keep;
use crate::stream::Deliver;
use crate::trace::Traced;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Instant;

/// Where a request on the path comes from.
pub enum Origin {
    /// A client over HTTP: admitted here, through the wait queue.
    Client,
    /// A further sequence of a request that asks for several (`/generate`'s batch or `n`): admitted as a client's,
    /// but it waits for a slot past the wait queue's bound, as SGLang queues every sequence it is given: its
    /// request's first sequence was admitted, and the fan-out is bounded by a limit of its own.
    Sibling,
    /// A batch line, in the slot its batch's lane took for it (`crate::workers::batches`).
    BatchLine(Permit),
    /// A background response's run (`crate::workers::background`), admitted here like a client's request.
    Background(Arc<dyn BackgroundRun>),
}

/// A background response's run as the path sees it (its worker's `workers::background::Run`): the id its Response
/// has, and how its worker records its end: under the run's claim, by whoever ends it first, never by the batched
/// writer.
pub trait BackgroundRun: Send + Sync {
    /// The Response's id.
    fn id(&self) -> &str;
    /// Its request has ended: its place in the lane is free.
    fn release(&self);
    /// Write its final Response (`keep`, whose last bytes are `last`), then `deliver` them.
    fn record(self: Arc<Self>, store: &Arc<Store>, keep: Keep, last: Bytes, deliver: Deliver);
}

/// One request on its way down the path.
pub struct Call {
    pub door: Door,
    pub req: GenerateRequest,
    pub origin: Origin,
    /// When it arrived: its TTFT and its deadline count from here.
    pub arrival: Instant,
    pub request_id: String,
    /// Its trace, when traces are on.
    pub traced: Traced,
}

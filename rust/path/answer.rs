//! What the request path answers, with no HTTP type in it: `crate::http` turns it into a response; a worker
//! (a batch line, a background run) reads it directly.

use crate::trace::ResponseGuard;
use bytes::Bytes;
use futures_util::Stream;
use std::io;
use std::pin::Pin;

/// A stream's framed SSE events. An error ends it, and the connection with it (a client cut for falling behind).
pub type Events = Pin<Box<dyn Stream<Item = io::Result<Bytes>> + Send>>;

pub enum Answer {
    /// A stream: its framed SSE events as they come (keep-alives while it is silent), to its end or its deadline.
    /// Dropping it aborts the request if it still runs.
    Stream(Events),
    /// A non-stream's whole JSON body.
    Unary(Unary),
}

/// A non-stream's JSON body, and its trace's guard, which ends the trace's last stage once the body is delivered.
pub struct Unary {
    pub json: Bytes,
    pub guard: Option<ResponseGuard>,
}

impl Unary {
    /// The body, for a caller that uses it where it is (a batch line): delivered now, as far as its trace goes.
    pub fn delivered(self) -> Bytes {
        if let Some(mut guard) = self.guard {
            guard.complete();
        }
        self.json
    }
}

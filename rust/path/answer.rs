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

/// The answers of one request's sequences (a fan-out), sorted: their streams, their JSON bodies, and the first
/// trace guard among the bodies (the request's trace follows its first sequence).
pub struct Gathered {
    pub streams: Vec<Events>,
    pub jsons: Vec<Bytes>,
    pub guard: Option<ResponseGuard>,
}

impl Gathered {
    pub fn of(answers: Vec<Answer>) -> Self {
        let mut all = Gathered { streams: Vec::new(), jsons: Vec::new(), guard: None };
        for answer in answers {
            match answer {
                Answer::Stream(events) => all.streams.push(events),
                Answer::Unary(Unary { json, guard }) => {
                    all.guard = all.guard.or(guard);
                    all.jsons.push(json);
                }
            }
        }
        all
    }
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

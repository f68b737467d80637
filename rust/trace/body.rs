//! A non-streaming response's body for a traced request: the JSON, then, as hyper drops it (the bytes went to the
//! connection, or the client left first), the end of the request's `stream` stage.

use super::ResponseGuard;
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

pub struct TracedBody {
    bytes: Option<Bytes>,
    guard: ResponseGuard,
}

impl TracedBody {
    pub fn new(bytes: Bytes, guard: ResponseGuard) -> Self {
        TracedBody { bytes: Some(bytes), guard }
    }
}

impl Body for TracedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        match this.bytes.take() {
            Some(b) => {
                this.guard.complete();
                Poll::Ready(Some(Ok(Frame::data(b))))
            }
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.bytes.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.bytes.as_ref().map_or(0, |b| b.len() as u64))
    }
}

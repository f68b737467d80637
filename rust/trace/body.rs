//! Response bodies for a traced request that does not stream through `SseBody`: a non-streaming response's JSON,
//! and the events a background response's `POST` follows. As hyper drops one (the bytes went to the connection,
//! or the client left first), the request's `stream` stage ends.

use super::ResponseGuard;
use bytes::Bytes;
use futures_util::Stream;
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

/// A stream of chunks, complete when its end is read.
pub struct TracedStream<S> {
    inner: Pin<Box<S>>,
    guard: ResponseGuard,
}

impl<S> TracedStream<S> {
    pub fn new(inner: S, guard: ResponseGuard) -> Self {
        TracedStream { inner: Box::pin(inner), guard }
    }
}

impl<S: Stream> Stream for TracedStream<S> {
    type Item = S::Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let this = self.get_mut();
        let next = this.inner.as_mut().poll_next(cx);
        if let Poll::Ready(None) = next {
            this.guard.complete();
        }
        next
    }
}

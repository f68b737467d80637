//! An upload's multipart form (multer), with what comes before each part's content bounded: the preamble before
//! the first boundary at `MAX_FORM_PREAMBLE_BYTES` bytes, a part's boundary line and headers at `MAX_FORM_PART_HEAD_BYTES`.
//!
//! Why: multer holds everything it reads while it looks for a boundary or the blank line that ends a part's
//! headers, and has no bound for either (its `SizeLimit` counts the whole stream or a part's content). A body whose
//! boundary never came was held whole: 4 uploads of 256 MiB held 1.5 GB, kept after they closed. Here the body
//! reaches multer a piece at a time while it reads a head, so it never holds more than the head's budget, and past
//! it the form fails at once (`HeadTooLong`); a part's content goes through whole, as it comes.

use crate::limits::{MAX_FORM_PART_HEAD_BYTES, MAX_FORM_PREAMBLE_BYTES};
use axum::body::{Body, Bytes};
use futures_util::Stream;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};

/// The body is handed to multer in pieces of this while it reads a head.
const PIECE: usize = 512;

/// The bytes a head may still take; `usize::MAX` while a part's content is read.
#[derive(Clone)]
pub struct HeadBudget(Arc<AtomicUsize>);

impl HeadBudget {
    /// Before asking for the next part: its head may take `bytes`.
    pub fn head(&self, bytes: usize) {
        self.0.store(bytes, Ordering::Relaxed);
    }

    /// The part is here: its content goes through unbounded by this (the file's own bound is the store's).
    pub fn content(&self) {
        self.0.store(usize::MAX, Ordering::Relaxed);
    }
}

/// A multipart form over `body` whose heads are bounded by the returned budget. Its parts' contents are the
/// caller's to bound (the file by `--max-file-bytes` as it goes to disk, text parts by their own bound).
pub fn multipart(body: Body, boundary: String) -> (multer::Multipart<'static>, HeadBudget) {
    let budget = HeadBudget(Arc::new(AtomicUsize::new(MAX_FORM_PREAMBLE_BYTES + MAX_FORM_PART_HEAD_BYTES)));
    let stream = Pieces { body: body.into_data_stream(), budget: budget.clone(), rest: Bytes::new(), gave: false };
    (multer::Multipart::new(stream, boundary), budget)
}

/// A head ran past its budget: the boundary, or the blank line ending a part's headers, never came.
#[derive(Debug, thiserror::Error)]
#[error(
    "the preamble (past {MAX_FORM_PREAMBLE_BYTES} bytes) or a part's headers (past {MAX_FORM_PART_HEAD_BYTES}) never ended"
)]
pub struct HeadTooLong;

/// Whether the form failed on a head past its budget.
pub fn head_too_long(e: &multer::Error) -> bool {
    matches!(e, multer::Error::StreamReadFailed(inner) if inner.is::<HeadTooLong>())
}

/// The body, in pieces while a head is read; each piece is followed by a `Pending` (the task woken at once) so
/// that multer, which takes all a stream has ready, looks for the head's end before it takes more.
struct Pieces {
    body: axum::body::BodyDataStream,
    budget: HeadBudget,
    rest: Bytes,
    gave: bool,
}

impl Stream for Pieces {
    type Item = Result<Bytes, axum::BoxError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let left = this.budget.0.load(Ordering::Relaxed);
        if left != usize::MAX && std::mem::take(&mut this.gave) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let mut chunk = if this.rest.is_empty() {
            match ready!(Pin::new(&mut this.body).poll_next(cx)) {
                Some(Ok(chunk)) => chunk,
                Some(Err(e)) => return Poll::Ready(Some(Err(e.into_inner()))),
                None => return Poll::Ready(None),
            }
        } else {
            std::mem::take(&mut this.rest)
        };
        if left == usize::MAX {
            return Poll::Ready(Some(Ok(chunk)));
        }
        if left == 0 {
            return Poll::Ready(Some(Err(HeadTooLong.into())));
        }
        let piece = chunk.split_to(chunk.len().min(PIECE).min(left));
        this.rest = chunk;
        this.budget.0.store(left - piece.len(), Ordering::Relaxed);
        this.gave = true;
        Poll::Ready(Some(Ok(piece)))
    }
}

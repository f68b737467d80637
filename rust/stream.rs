//! Per-request output: where rank_io puts framed SSE bytes (or the final JSON) and where the HTTP body
//! (`http::sse`) takes them.
//!
//! A stream's pending bytes sit in one buffer; each time hyper polls the body it takes everything pending as one
//! frame, so events that arrive while a client is behind leave in one write. The buffer has a cap
//! (`--max-stream-buffer-bytes`): a client further behind than that is cut (its request aborted, its connection
//! closed), so what a slow reader holds is bounded whatever its `max_tokens` and `top_logprobs`.

use crate::doors::Door;
use crate::error::ApiError;
use bytes::{Bytes, BytesMut};
use futures_util::task::AtomicWaker;
use std::io;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::sync::oneshot;

#[derive(Default)]
struct Pending {
    buf: BytesMut,
    done: bool,
    /// The client fell more than the cap behind: its pending bytes were dropped and the body ends in an error.
    cut: bool,
    /// Called when the body takes bytes past this offset of `buf` (see `on_written`).
    probe: Option<(usize, Probe)>,
}

/// Told when the bytes it waits for leave for the client.
pub type Probe = Box<dyn FnOnce(std::time::Instant) + Send>;

/// Bytes produced for a streaming request and not yet taken by its HTTP body.
pub struct StreamBuf {
    pending: Mutex<Pending>,
    waker: AtomicWaker,
    /// How the stream ends, keeps alive and fails.
    pub door: Door,
    /// Most bytes held for a client that reads slower than they come.
    cap: usize,
}

impl StreamBuf {
    pub fn new(door: Door, cap: usize) -> Arc<Self> {
        Arc::new(StreamBuf { pending: Mutex::default(), waker: AtomicWaker::new(), door, cap })
    }

    /// End the stream with an error (its door's error event).
    pub fn fail(&self, err: &ApiError) {
        self.push(&self.door.error_tail(err), true);
    }

    /// Append bytes (already framed) and, with `done`, close the stream after them. False when the client is
    /// now more than the cap behind: the stream is cut (the caller ends its request).
    pub fn push(&self, bytes: &[u8], done: bool) -> bool {
        let kept = {
            let mut p = self.pending.lock().unwrap();
            if p.done {
                return !p.cut;
            }
            if p.buf.len() + bytes.len() > self.cap {
                p.buf = BytesMut::new(); // freed now, not when the connection closes
                p.done = true;
                p.cut = true;
                false
            } else {
                p.buf.extend_from_slice(bytes);
                p.done = done;
                true
            }
        };
        self.waker.wake();
        kept
    }

    /// Run `f` on the pending buffer (to frame straight into it), then wake the body.
    pub fn with_buf(&self, done: bool, f: impl FnOnce(&mut BytesMut)) {
        {
            let mut p = self.pending.lock().unwrap();
            if p.done {
                return;
            }
            f(&mut p.buf);
            p.done = done;
        }
        self.waker.wake();
    }

    /// Call `probe` when the body hands hyper the bytes pushed after this call (the next push): the `sse` stage
    /// of the TTFT breakdown. Bytes already pending do not count.
    pub fn on_written(&self, probe: Probe) {
        let mut p = self.pending.lock().unwrap();
        let at = p.buf.len();
        p.probe = Some((at, probe));
    }

    pub fn is_done(&self) -> bool {
        self.pending.lock().unwrap().done
    }

    /// Everything pending as one frame (waking `cx` when more comes), `None` once done, or an error once cut.
    pub fn poll_take(&self, cx: &mut Context<'_>) -> Poll<Option<io::Result<Bytes>>> {
        self.waker.register(cx.waker());
        let mut p = self.pending.lock().unwrap();
        if p.cut {
            return Poll::Ready(Some(Err(io::Error::other("the client fell too far behind the stream"))));
        }
        if !p.buf.is_empty() {
            let len = p.buf.len();
            let fire = match &mut p.probe {
                Some((at, _)) if len > *at => p.probe.take().map(|(_, f)| f),
                Some((at, _)) => {
                    *at = 0; // only older bytes go now; the awaited ones will start the buffer
                    None
                }
                None => None,
            };
            let bytes = p.buf.split().freeze();
            drop(p);
            if let Some(f) = fire {
                f(std::time::Instant::now());
            }
            return Poll::Ready(Some(Ok(bytes)));
        }
        if p.done { Poll::Ready(None) } else { Poll::Pending }
    }
}

/// Sends a request's last bytes (and ends its output), from any thread, once; or, instead, an error (a stored
/// response whose record could not be committed: the client is never told it is done when it was not kept).
pub type Deliver = Box<dyn FnOnce(Result<Bytes, ApiError>) + Send>;

/// Where a request's output goes.
pub enum Outlet {
    Stream(Arc<StreamBuf>),
    /// Non-streaming: the whole response body, or the error, once.
    Unary(Mutex<Option<oneshot::Sender<Result<Bytes, ApiError>>>>),
}

impl Outlet {
    pub fn unary() -> (Self, oneshot::Receiver<Result<Bytes, ApiError>>) {
        let (tx, rx) = oneshot::channel();
        (Outlet::Unary(Mutex::new(Some(tx))), rx)
    }

    /// End the request with an error: its door's error event for a stream, the error itself otherwise.
    pub fn fail(&self, err: ApiError) {
        match self {
            Outlet::Stream(s) => s.fail(&err),
            Outlet::Unary(tx) => {
                if let Some(tx) = tx.lock().unwrap().take() {
                    let _ = tx.send(Err(err));
                }
            }
        }
    }

    /// What sends the request's last bytes: a stream's, followed by its door's end (`[DONE]`), or a non-stream's
    /// whole body. It holds only the outlet's end, not the request, so it may run later on another thread.
    pub fn last_bytes(&self) -> Deliver {
        match self {
            Outlet::Stream(s) => {
                let s = s.clone();
                Box::new(move |last| match last {
                    Ok(bytes) => s.with_buf(true, |buf| {
                        buf.extend_from_slice(&bytes);
                        buf.extend_from_slice(s.door.done());
                    }),
                    Err(e) => s.fail(&e),
                })
            }
            Outlet::Unary(tx) => {
                let tx = tx.lock().unwrap().take();
                Box::new(move |last| {
                    if let Some(tx) = tx {
                        let _ = tx.send(last);
                    }
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_bytes_coalesce_until_taken() {
        let s = StreamBuf::new(Door::Chat, 1 << 20);
        s.push(b"data: 1\n\n", false);
        s.push(b"data: 2\n\n", false);
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        match s.poll_take(&mut cx) {
            Poll::Ready(Some(Ok(b))) => assert_eq!(&b[..], b"data: 1\n\ndata: 2\n\n"),
            _ => panic!("expected bytes"),
        }
        assert!(s.poll_take(&mut cx).is_pending());
        s.push(b"", true);
        assert!(matches!(s.poll_take(&mut cx), Poll::Ready(None)));
        s.push(b"late", false); // ignored once done
        assert!(matches!(s.poll_take(&mut cx), Poll::Ready(None)));
    }

    #[test]
    fn a_probe_fires_when_the_bytes_pushed_after_it_are_taken_not_older_ones() {
        let s = StreamBuf::new(Door::Chat, 1 << 20);
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        let fired = Arc::new(Mutex::new(0));
        let probe = |fired: &Arc<Mutex<i32>>| -> Probe {
            let fired = fired.clone();
            Box::new(move |_| *fired.lock().unwrap() += 1)
        };
        s.push(b"data: role\n\n", false);
        s.on_written(probe(&fired));
        assert!(matches!(s.poll_take(&mut cx), Poll::Ready(Some(Ok(_))))); // the role chunk only: not yet
        assert_eq!(*fired.lock().unwrap(), 0);
        s.push(b"data: token\n\n", false);
        assert!(matches!(s.poll_take(&mut cx), Poll::Ready(Some(Ok(_)))));
        assert_eq!(*fired.lock().unwrap(), 1);
        s.push(b"data: more\n\n", false);
        let _ = s.poll_take(&mut cx);
        assert_eq!(*fired.lock().unwrap(), 1, "once");
        // Armed while older bytes are pending: those and the new ones leave together, which is its write.
        s.push(b"data: old\n\n", false);
        s.on_written(probe(&fired));
        s.push(b"data: new\n\n", false);
        let _ = s.poll_take(&mut cx);
        assert_eq!(*fired.lock().unwrap(), 2);
    }

    #[test]
    fn a_client_further_behind_than_the_cap_is_cut_and_its_bytes_freed() {
        let s = StreamBuf::new(Door::Chat, 64);
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(s.push(&[b'x'; 40], false));
        assert!(matches!(s.poll_take(&mut cx), Poll::Ready(Some(Ok(_)))), "taken: nothing pending");
        assert!(s.push(&[b'x'; 40], false));
        assert!(!s.push(&[b'x'; 40], false), "80 bytes pending is over the cap of 64");
        assert_eq!(s.pending.lock().unwrap().buf.capacity(), 0);
        assert!(!s.push(b"late", false));
        assert!(matches!(s.poll_take(&mut cx), Poll::Ready(Some(Err(_)))));
    }
}

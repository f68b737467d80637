//! A stream's SSE response body: what its `StreamBuf` holds, keep-alives while it is silent, and the request's
//! deadline. It owns the request's ticket, so a client that goes away aborts its request, and its trace's response
//! guard, which ends the trace's `stream` stage when the body ends or is dropped.

use crate::dispatch::Ticket;
use crate::error::ApiError;
use crate::stream::StreamBuf;
use crate::trace::ResponseGuard;
use bytes::Bytes;
use futures_util::Stream;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::{Instant, Sleep};

/// The SSE response body. It owns the request's ticket: dropping the body (client gone) aborts the request if it
/// still runs.
pub struct SseBody {
    buf: Arc<StreamBuf>,
    ticket: SharedTicket,
    keep_alive: Pin<Box<Sleep>>,
    keep_alive_every: Duration,
    deadline: Option<JoinHandle<()>>,
    finished: bool,
    /// Dropped with the body: when, and whether the client had the whole stream (`crate::trace`).
    trace: Option<ResponseGuard>,
}

/// Taken by whoever ends the request first: the body (finished, or dropped) or its deadline.
type SharedTicket = Arc<Mutex<Option<Ticket>>>;

impl SseBody {
    /// `keep_alive_every`: the longest silence before a `: keep-alive` comment (proxies, dead-peer detection).
    pub fn new(
        buf: Arc<StreamBuf>,
        ticket: Ticket,
        timeout: Option<Duration>,
        keep_alive_every: Duration,
        trace: Option<ResponseGuard>,
    ) -> Self {
        let ticket = Arc::new(Mutex::new(Some(ticket)));
        SseBody {
            deadline: timeout.map(|t| tokio::spawn(deadline(t, ticket.clone(), buf.clone()))),
            buf,
            ticket,
            keep_alive: Box::pin(tokio::time::sleep(keep_alive_every)),
            keep_alive_every,
            finished: false,
            trace,
        }
    }
}

/// The request timeout runs on a timer of its own, not when hyper polls the body: a client that stopped reading
/// (its socket full, the body unpolled) must not keep its request running past it.
async fn deadline(timeout: Duration, ticket: SharedTicket, buf: Arc<StreamBuf>) {
    tokio::time::sleep(timeout).await;
    let running = ticket.lock().unwrap().take();
    if let Some(ticket) = running {
        ticket.abort("timeout");
        buf.fail(&ApiError::Timeout(timeout.as_secs_f64()));
    }
}

impl Drop for SseBody {
    fn drop(&mut self) {
        self.ticket.lock().unwrap().take(); // client gone: abort now, not when the deadline task is dropped
        if let Some(deadline) = &self.deadline {
            deadline.abort();
        }
    }
}

impl Stream for SseBody {
    /// An error closes the connection: the client was cut for falling behind.
    type Item = io::Result<Bytes>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.finished {
            return Poll::Ready(None);
        }
        match this.buf.poll_take(cx) {
            Poll::Ready(Some(Ok(bytes))) => {
                this.keep_alive.as_mut().reset(Instant::now() + this.keep_alive_every);
                return Poll::Ready(Some(Ok(bytes)));
            }
            Poll::Ready(Some(Err(e))) => {
                this.finished = true;
                return Poll::Ready(Some(Err(e)));
            }
            Poll::Ready(None) => {
                this.finished = true;
                this.ticket.lock().unwrap().take(); // the request already ended on its rank: nothing to abort
                if let Some(mut guard) = this.trace.take() {
                    guard.complete(); // every byte went to the connection: the trace's stream stage ends now
                }
                return Poll::Ready(None);
            }
            Poll::Pending => {}
        }
        if this.keep_alive.as_mut().poll(cx).is_ready() {
            this.keep_alive.as_mut().reset(Instant::now() + this.keep_alive_every);
            return Poll::Ready(Some(Ok(Bytes::from_static(this.buf.door.keep_alive()))));
        }
        Poll::Pending
    }
}

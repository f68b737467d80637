//! Deadlines on what a client sends and takes, so that no client holds a connection (a file descriptor, buffers,
//! a running request) by going slow:
//! - `ClientIo`: a response the client stops taking, or takes a few bytes at a time, closes the connection once
//!   it has taken less than `MIN_WRITE_PROGRESS_BYTES` bytes in `client_timeout` while the socket stayed full. Any progress
//!   would reset a plain write timeout (tokio-io-timeout's), so a reader that takes a byte every 25 s was never cut.
//! - `DeadlineBody`: a request body must arrive whole within `client_timeout` of its head. A per-chunk timeout
//!   (tower-http's) restarts with every chunk, so a body trickled a byte at a time was never cut either.
//!   A request that may take longer (an upload) gets a `LongerDeadline` it holds until a handler grants it, after
//!   the key check and routing: a request nobody has let in gets no more than the ordinary deadline.
//! - Closing, `ClientIo` lingers: it sends its FIN, then reads and drops what the client still sends, for at most
//!   `MAX_LINGER_S`, until the client closes or goes quiet. A client still sending a body we refused would
//!   otherwise get a reset in place of the answer (the kernel resets a socket closed on unread bytes, and the
//!   client's kernel may drop the answer it holds unread).

use crate::limits::{MAX_LINGER_QUIET_S, MAX_LINGER_S, MIN_WRITE_PROGRESS_BYTES};
use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// A client connection whose writes have a progress deadline.
pub struct ClientIo<T> {
    inner: T,
    timeout: Duration,
    /// Since the socket stopped taking everything it was offered: the deadline, and the bytes taken since.
    stalled: Option<(Pin<Box<Sleep>>, usize)>,
    /// Once our side is shut: how long we go on reading what the client sends.
    linger: Option<Linger>,
}

struct Linger {
    /// `MAX_LINGER_S` after the FIN.
    until: Pin<Box<Sleep>>,
    /// `MAX_LINGER_QUIET_S` after the client last sent anything.
    quiet: Pin<Box<Sleep>>,
}

impl Linger {
    fn new() -> Self {
        Linger {
            until: Box::pin(tokio::time::sleep(Duration::from_secs_f64(MAX_LINGER_S))),
            quiet: Box::pin(tokio::time::sleep(Duration::from_secs_f64(MAX_LINGER_QUIET_S))),
        }
    }

    /// Read and drop what `io` has until the client closes, goes quiet or the linger ends (`Ready`), or nothing
    /// is there yet (`Pending`, woken by the socket or a deadline).
    fn poll_drain<T: AsyncRead + Unpin>(&mut self, cx: &mut Context<'_>, io: &mut T) -> Poll<()> {
        let mut scratch = [0u8; 16 << 10];
        while !self.until.is_elapsed() {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut *io).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(()), // the client closed too
                Poll::Ready(Ok(())) => {
                    let quiet = Instant::now() + Duration::from_secs_f64(MAX_LINGER_QUIET_S);
                    self.quiet.as_mut().reset(quiet);
                }
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Pending => {
                    let ended = self.until.as_mut().poll(cx).is_ready() || self.quiet.as_mut().poll(cx).is_ready();
                    return if ended { Poll::Ready(()) } else { Poll::Pending };
                }
            }
        }
        Poll::Ready(())
    }
}

impl<T> ClientIo<T> {
    pub fn new(inner: T, timeout: Duration) -> Self {
        ClientIo { inner, timeout, stalled: None, linger: None }
    }

    /// Account for a write that took `written` of `offered` bytes (`None`: the socket took nothing yet), and fail
    /// it once the client has been too slow for too long.
    fn progress(&mut self, cx: &mut Context<'_>, written: Option<usize>, offered: usize) -> io::Result<()> {
        match written {
            // The socket had room for all of it: the client keeps up.
            Some(n) if n == offered => self.stalled = None,
            Some(n) => match &mut self.stalled {
                Some((_, taken)) => {
                    *taken += n;
                    if *taken >= MIN_WRITE_PROGRESS_BYTES {
                        self.stalled = None;
                    }
                }
                None => self.stall(),
            },
            None => {
                if self.stalled.is_none() {
                    self.stall();
                }
            }
        }
        if let Some((deadline, _)) = &mut self.stalled
            && deadline.as_mut().poll(cx).is_ready()
        {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "the client stopped taking the response"));
        }
        Ok(())
    }

    fn stall(&mut self) {
        self.stalled = Some((Box::pin(tokio::time::sleep(self.timeout)), 0));
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ClientIo<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for ClientIo<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        let written = match &polled {
            Poll::Ready(Ok(n)) => Some(*n),
            Poll::Ready(Err(_)) => return polled,
            Poll::Pending => None,
        };
        self.progress(cx, written, buf.len())?;
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        let written = match &polled {
            Poll::Ready(Ok(n)) => Some(*n),
            Poll::Ready(Err(_)) => return polled,
            Poll::Pending => None,
        };
        self.progress(cx, written, bufs.iter().map(|b| b.len()).sum())?;
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let ClientIo { inner, linger, .. } = &mut *self;
        if linger.is_none() {
            // The FIN first: the client sees the answer end whatever comes after.
            ready!(Pin::new(&mut *inner).poll_shutdown(cx))?;
        }
        ready!(linger.get_or_insert_with(Linger::new).poll_drain(cx, inner));
        Poll::Ready(Ok(()))
    }
}

/// The body did not arrive whole by its deadline.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within the client timeout")]
pub struct BodyDeadline;

/// A later deadline a body may have, once a handler grants it (in the request's extensions, which the body
/// shares). Granted or not, it runs from the request head, as the ordinary one does.
#[derive(Clone)]
pub struct LongerDeadline(Arc<Longer>);

struct Longer {
    at: Instant,
    granted: AtomicBool,
}

impl LongerDeadline {
    pub fn new(timeout: Duration) -> Self {
        LongerDeadline(Arc::new(Longer { at: Instant::now() + timeout, granted: AtomicBool::new(false) }))
    }

    /// Let the body take until the longer deadline.
    pub fn grant(&self) {
        self.0.granted.store(true, Ordering::Release);
    }

    fn granted_at(&self) -> Option<Instant> {
        self.0.granted.load(Ordering::Acquire).then_some(self.0.at)
    }
}

/// A request body that fails once its deadline passes, however its bytes trickle in.
pub struct DeadlineBody<B> {
    inner: B,
    deadline: Pin<Box<Sleep>>,
    longer: Option<LongerDeadline>,
}

impl<B> DeadlineBody<B> {
    pub fn new(inner: B, timeout: Duration, longer: Option<LongerDeadline>) -> Self {
        DeadlineBody { inner, deadline: Box::pin(tokio::time::sleep_until(Instant::now() + timeout)), longer }
    }
}

impl<B> Body for DeadlineBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        loop {
            ready!(self.deadline.as_mut().poll(cx));
            // Looked at only when the ordinary deadline passes: a granted one moves it out once.
            match self.longer.as_ref().and_then(LongerDeadline::granted_at) {
                Some(at) if at > self.deadline.deadline() => self.deadline.as_mut().reset(at),
                _ => return Poll::Ready(Some(Err(Box::new(BodyDeadline)))),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test(start_paused = true)]
    async fn a_trickled_body_fails_at_its_deadline_not_at_a_pause() {
        let (mut tx, body) = http_body_util::channel::Channel::<Bytes, io::Error>::new(4);
        let body = DeadlineBody::new(body, Duration::from_secs(2), Some(LongerDeadline::new(Duration::from_secs(9))));
        let sender = tokio::spawn(async move {
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if tx.send_data(Bytes::from_static(b"x")).await.is_err() {
                    return;
                }
            }
        });
        let started = Instant::now();
        let err = body.collect().await.expect_err("cut at the deadline");
        assert!(err.is::<BodyDeadline>(), "{err}");
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        sender.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_arrives_in_time_is_whole() {
        let (mut tx, body) = http_body_util::channel::Channel::<Bytes, io::Error>::new(4);
        tokio::spawn(async move {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                tx.send_data(Bytes::from_static(b"ab")).await.unwrap();
            }
        });
        let got = DeadlineBody::new(body, Duration::from_secs(2), None).collect().await.unwrap().to_bytes();
        assert_eq!(&got[..], b"ababab");
    }

    #[tokio::test(start_paused = true)]
    async fn a_granted_longer_deadline_holds_from_the_head() {
        let (mut tx, body) = http_body_util::channel::Channel::<Bytes, io::Error>::new(4);
        let longer = LongerDeadline::new(Duration::from_secs(5));
        let body = DeadlineBody::new(body, Duration::from_secs(2), Some(longer.clone()));
        longer.grant();
        tokio::spawn(async move {
            for _ in 0..20 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if tx.send_data(Bytes::from_static(b"x")).await.is_err() {
                    return;
                }
            }
        });
        let started = Instant::now();
        let err = body.collect().await.expect_err("cut at the longer deadline");
        assert!(err.is::<BodyDeadline>(), "{err}");
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_reader_that_takes_a_little_at_a_time_is_cut_and_one_that_keeps_up_is_not() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let timeout = Duration::from_secs(5);
        // A socket pair with a small buffer: the writer fills it, the reader drains it at its own pace.
        let (server, mut client) = tokio::io::duplex(4096);
        let mut io = ClientIo::new(server, timeout);
        let reader = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                match client.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        });
        let started = Instant::now();
        let chunk = vec![7u8; 8192];
        let err = loop {
            if let Err(e) = io.write_all(&chunk).await {
                break e;
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() <= timeout + Duration::from_secs(1), "{:?}", started.elapsed());
        reader.abort();

        let (server, mut client) = tokio::io::duplex(4096);
        let mut io = ClientIo::new(server, timeout);
        let reader = tokio::spawn(async move {
            let mut buf = vec![0u8; 1 << 16];
            let mut total = 0;
            while total < 24 * 8192 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                total += client.read(&mut buf).await.unwrap();
            }
        });
        for _ in 0..24 {
            io.write_all(&chunk).await.expect("a reader taking 4 KiB every 100 ms keeps up");
        }
        reader.await.unwrap();
    }

    /// A client still sending its body when we close: what it sends is read (past what the pipe buffers), it sees
    /// our FIN, and the close waits for it; one that never stops is left at `MAX_LINGER_S`, a quiet one at once.
    #[tokio::test(start_paused = true)]
    async fn a_closing_connection_reads_what_its_client_still_sends_for_a_bounded_time() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let linger = Duration::from_secs_f64(MAX_LINGER_S);
        let quiet = Duration::from_secs_f64(MAX_LINGER_QUIET_S);
        let (server, mut client) = tokio::io::duplex(4096);
        let sender = tokio::spawn(async move {
            for _ in 0..64 {
                client.write_all(&[1u8; 4096]).await.expect("the closing side reads on");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let mut rest = Vec::new();
            client.read_to_end(&mut rest).await.expect("the FIN");
            rest.len()
        });
        let started = Instant::now();
        ClientIo::new(server, linger).shutdown().await.unwrap();
        assert_eq!(sender.await.unwrap(), 0);
        assert!(
            started.elapsed() >= Duration::from_millis(630) && started.elapsed() < linger,
            "{:?}",
            started.elapsed()
        );

        let (server, mut client) = tokio::io::duplex(4096);
        let endless = tokio::spawn(async move {
            while client.write_all(&[1u8; 1024]).await.is_ok() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        let started = Instant::now();
        ClientIo::new(server, linger).shutdown().await.unwrap();
        assert!(started.elapsed() >= linger && started.elapsed() < linger + quiet, "{:?}", started.elapsed());
        endless.abort();

        let (server, _client) = tokio::io::duplex(4096);
        let started = Instant::now();
        ClientIo::new(server, linger).shutdown().await.unwrap();
        assert!(started.elapsed() >= quiet && started.elapsed() < 2 * quiet, "{:?}", started.elapsed());
    }
}

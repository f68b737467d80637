//! The accept loop: one hyper HTTP/1.1 connection per socket, as `axum::serve` runs them, at most
//! `--max-connections` at once (past it, new ones wait in the listen backlog), plus the client deadlines it cannot
//! set. Each is `client_timeout`, so no client pins a connection (a file descriptor, buffered output) or a running
//! request by going quiet or slow:
//! - a request head that does not arrive whole in time (slowloris), or a keep-alive connection left idle: closed;
//! - a body that does not arrive whole in time: its read fails and the handler answers 408 (`client_io`);
//! - a response the client stops taking, or takes a trickle of: closed, which aborts its request if it runs;
//! - over TLS (`edge::tls`), a handshake that is not done in time: closed. It holds its connection slot meanwhile,
//!   so clients that open connections and never finish a handshake count against `--max-connections`.
//!
//! The loop is generic over the socket (`Listener`: TCP, or a Unix socket with `--uds`); with TLS off each
//! connection takes the same path it always took.

use crate::client_io::{ClientIo, DeadlineBody, LongerDeadline};
use crate::edge::tls::Tls;
use crate::limits::{MAX_HYPER_HEAD_BYTES, MAX_HYPER_HEADERS};
use axum::Router;
use futures_util::FutureExt;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::Semaphore;

/// How long to back off when `accept` fails for want of resources (EMFILE, ENOMEM) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// A listening socket the accept loop takes connections from.
pub trait Listener {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    fn accept(&self) -> impl Future<Output = io::Result<Self::Io>>;
}

impl Listener for TcpListener {
    type Io = TcpStream;
    async fn accept(&self) -> io::Result<TcpStream> {
        let (tcp, _) = TcpListener::accept(self).await?;
        // No Nagle: an SSE event must leave at once, not wait for the client's delayed ACK (40 ms).
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("cannot set TCP_NODELAY: {e}");
        }
        Ok(tcp)
    }
}

/// A Unix socket has no Nagle to turn off, and no peer address worth logging (the request log names none).
impl Listener for UnixListener {
    type Io = UnixStream;
    async fn accept(&self) -> io::Result<UnixStream> {
        Ok(UnixListener::accept(self).await?.0)
    }
}

/// How long a client may take: to send a request head or a body (`client`), or a file upload's body (`upload`,
/// `POST …/v1/files`: hundreds of megabytes cannot be asked of the 30 s a JSON body gets). The upload deadline is
/// only offered here (`LongerDeadline`): the upload handler grants it, once the key check and routing let the
/// request in, so a head nobody let in cannot hold its connection for it.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub client: Duration,
    pub upload: Duration,
}

impl Deadlines {
    fn longer(&self, req: &axum::http::Request<hyper::body::Incoming>) -> Option<LongerDeadline> {
        let upload = req.method() == axum::http::Method::POST && req.uri().path().ends_with("/v1/files");
        upload.then(|| LongerDeadline::new(self.upload))
    }
}

/// Serve `app` on `listener` until `shutdown` completes; then stop accepting, let every connection finish its
/// response (idle ones close at once) and return when all are closed. `max_connections` 0: no limit. With `tls`,
/// each connection first completes a handshake with the config current when it was accepted.
pub async fn serve<L: Listener>(
    listener: L,
    app: Router,
    deadlines: Deadlines,
    max_connections: usize,
    tls: Option<Arc<Tls>>,
    shutdown: impl Future<Output = ()>,
) {
    let client_timeout = deadlines.client;
    let mut http = http1::Builder::new();
    // hyper's head timer runs from the first byte of a head to its end (a total, not reset per chunk), and while
    // a keep-alive connection waits for its next request.
    http.timer(TokioTimer::new()).header_read_timeout(client_timeout);
    // Past these hyper answers a bare 431 itself; below them `head_limits` answers in the door's envelope.
    http.max_headers(MAX_HYPER_HEADERS).max_buf_size(MAX_HYPER_HEAD_BYTES);
    let app = tower::util::MapRequest::new(app, move |mut req: axum::http::Request<hyper::body::Incoming>| {
        let longer = deadlines.longer(&req);
        if let Some(longer) = &longer {
            req.extensions_mut().insert(longer.clone());
        }
        req.map(|body| axum::body::Body::new(DeadlineBody::new(body, client_timeout, longer)))
    });
    let slots = Arc::new(Semaphore::new(if max_connections == 0 { Semaphore::MAX_PERMITS } else { max_connections }));
    let connections = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // A connection slot first: past the limit, clients wait in the kernel's backlog, costing us nothing.
        let accepted = async {
            let slot = slots.clone().acquire_owned().await.expect("the semaphore is never closed");
            (slot, listener.accept().await)
        };
        let (slot, stream) = tokio::select! {
            (slot, accepted) = accepted => match accepted {
                Ok(stream) => (slot, stream),
                Err(e) => {
                    on_accept_error(e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Under TLS, so that the write deadline counts the bytes the client takes off the socket.
        let io = ClientIo::new(stream, client_timeout);
        if let Some(tls) = &tls {
            let (http, app, watcher) = (http.clone(), app.clone(), connections.watcher());
            let handshake = tokio::time::timeout(client_timeout, tls.acceptor().accept(io));
            tokio::spawn(async move {
                match handshake.await {
                    Ok(Ok(io)) => {
                        let conn = http.serve_connection(TokioIo::new(io), TowerToHyperService::new(app));
                        if let Err(e) = watcher.watch(conn).await {
                            tracing::debug!("connection ended: {e}");
                        }
                    }
                    Ok(Err(e)) => tracing::debug!("TLS handshake failed: {e}"),
                    Err(_) => tracing::debug!("TLS handshake not done within the client timeout: closed"),
                }
                drop(slot);
            });
            continue;
        }
        let conn = http.serve_connection(TokioIo::new(io), TowerToHyperService::new(app.clone()));
        // A combinator, not an `async move` block: the block would keep the connection it captured beside the
        // one it awaits (rustc does not overlap the two), and every connection's task would be twice its size.
        tokio::spawn(connections.watch(conn).map(move |ended| {
            if let Err(e) = ended {
                tracing::debug!("connection ended: {e}");
            }
            drop(slot);
        }));
    }
    drop(listener);
    connections.shutdown().await;
}

async fn on_accept_error(e: io::Error) {
    use io::ErrorKind::*;
    if matches!(e.kind(), ConnectionRefused | ConnectionAborted | ConnectionReset) {
        return; // the client gave up before we accepted: nothing wrong here
    }
    tracing::error!("accept failed: {e}; retrying in {} ms", ACCEPT_BACKOFF.as_millis());
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

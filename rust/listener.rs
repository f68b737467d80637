//! The accept loop: one hyper HTTP/1.1 connection per socket, as `axum::serve` runs them, plus the client
//! deadlines it cannot set. Each is `client_timeout`, so no client pins a connection (a file descriptor, buffered
//! output) or a running request by going quiet:
//! - a request head that trickles in (slowloris), or a keep-alive connection left idle: closed;
//! - a body that stops arriving: its read fails and the handler answers 408;
//! - a response the client stops reading (the socket stays full): closed, which aborts its request if it runs.

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::io;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_io_timeout::TimeoutStream;
use tower::Layer;
use tower_http::timeout::RequestBodyTimeoutLayer;

/// hyper's own bounds on a request head, well above `head_limits`' (hyper's defaults: 100 headers, ~400 KiB).
const HYPER_MAX_HEADERS: usize = 4 * crate::http::head_limits::MAX_HEADERS;
const HYPER_MAX_BUF: usize = 400 << 10;
/// How long to back off when `accept` fails for want of resources (EMFILE, ENOMEM) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serve `app` on `listener` until `shutdown` completes; then stop accepting, let every connection finish its
/// response (idle ones close at once) and return when all are closed.
pub async fn serve(listener: TcpListener, app: Router, client_timeout: Duration, shutdown: impl Future<Output = ()>) {
    let mut http = http1::Builder::new();
    // hyper's head timer also runs while a keep-alive connection waits for its next request.
    http.timer(TokioTimer::new()).header_read_timeout(client_timeout);
    // Past these hyper answers a bare 431 itself; below them `head_limits` answers in the OpenAI envelope.
    http.max_headers(HYPER_MAX_HEADERS).max_buf_size(HYPER_MAX_BUF);
    let app = RequestBodyTimeoutLayer::new(client_timeout).layer(app);
    let connections = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    on_accept_error(e).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // No Nagle: an SSE event must leave at once, not wait for the client's delayed ACK (40 ms).
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!("cannot set TCP_NODELAY: {e}");
        }
        let mut io = TimeoutStream::new(tcp);
        io.set_write_timeout(Some(client_timeout));
        let conn = http.serve_connection(TokioIo::new(Box::pin(io)), TowerToHyperService::new(app.clone()));
        let conn = connections.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection ended: {e}");
            }
        });
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

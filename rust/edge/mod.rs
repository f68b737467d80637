//! The server's edge as clients and proxies reach it: where it listens (TCP, or a Unix socket with `--uds`),
//! whether connections speak TLS (`--ssl-*`), and under which path prefix (`--root-path`). Everything here is
//! decided once at start-up; with none of these options the plain TCP path is the one `listener` always ran.

pub mod listener;
pub mod root_path;
pub mod tls;
pub mod uds;

use crate::py_record::py_record;
use axum::Router;
use std::future::Future;
use std::io;
use std::sync::Arc;
use tokio::net::{TcpListener, UnixListener};

py_record! {
    /// `--ssl-*`, `--uds` and `--root-path`, as `edge_args.server_config` builds them (`None` when an option is
    /// off).
    #[derive(Debug, Clone, Default)]
    pub struct EdgeConfig {
        pub tls: Option<tls::TlsFiles>,
        /// Serve on this Unix socket instead of `host:port`.
        pub uds: Option<String>,
        /// A path prefix the routes also answer under (`/prefix`, normalised: no trailing slash); `None`: no
        /// prefix.
        pub root_path: Option<String>,
    }
}

/// A bound listening socket; a Unix socket's file is removed when this is dropped.
pub enum Bound {
    Tcp(TcpListener),
    Unix(UnixListener, uds::SocketFile),
}

/// Bind where the configuration says: the Unix socket of `--uds` (host and port are then ignored, as vLLM does),
/// else `host:port`.
pub async fn bind(edge: &EdgeConfig, host: &str, port: u16) -> io::Result<Bound> {
    if let Some(path) = &edge.uds {
        let (listener, file) = uds::bind(path)?;
        return Ok(Bound::Unix(listener, file));
    }
    let addr = format!("{host}:{port}");
    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))?;
    Ok(Bound::Tcp(listener))
}

impl Bound {
    /// What the start-up line says (tests and operators read the address, the port `--port 0` picked, from it).
    pub fn describe(&self, tls: bool) -> io::Result<String> {
        let scheme = if tls { "https" } else { "http" };
        Ok(match self {
            Bound::Tcp(l) => format!("{scheme}://{}", l.local_addr()?),
            Bound::Unix(_, file) => format!("{scheme}+unix:{}", file.path().display()),
        })
    }

    /// Serve `app` here until `shutdown` completes (`listener::serve`, over TLS when `tls` is set). A Unix
    /// socket's file goes once the last connection has closed.
    pub async fn serve(
        self,
        app: Router,
        tls: Option<Arc<tls::Tls>>,
        deadlines: listener::Deadlines,
        max_connections: usize,
        shutdown: impl Future<Output = ()>,
    ) {
        match self {
            Bound::Tcp(l) => listener::serve(l, app, deadlines, max_connections, tls, shutdown).await,
            Bound::Unix(l, file) => {
                listener::serve(l, app, deadlines, max_connections, tls, shutdown).await;
                drop(file);
            }
        }
    }
}

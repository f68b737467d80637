//! Fetching one image: over HTTP(S) through a client whose resolver and redirect policy enforce the guard, or
//! from the allowed local directory. Bounded in bytes; the caller bounds the time.

use super::guard::{Policy, Refusal, local_path, within_root};
use crate::limits::MAX_MEDIA_REDIRECTS;
use bytes::{Bytes, BytesMut};
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::{StatusCode, Url, redirect};
use std::error::Error as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// Why a fetch failed, before the caller names the request field.
#[derive(Debug)]
pub(super) struct Failure {
    pub code: &'static str,
    pub message: String,
    pub retryable: bool,
}

impl Failure {
    fn new(code: &'static str, message: impl Into<String>, retryable: bool) -> Self {
        Failure { code, message: message.into(), retryable }
    }
}

impl From<Refusal> for Failure {
    fn from(r: Refusal) -> Self {
        Failure::new(r.code, r.message, false)
    }
}

fn too_large(limit: usize) -> Failure {
    Failure::new(
        "image_too_large",
        format!("The image is larger than this server's limit of {limit} bytes per image."),
        false,
    )
}

fn total_too_large(limit: usize) -> Failure {
    let msg = format!("The request's images together are larger than this server's limit of {limit} bytes.");
    Failure::new("image_too_large", msg, false)
}

/// Resolves with the system resolver, then keeps only the addresses the policy allows: the check happens on
/// the addresses actually connected to, so a name cannot point somewhere else between check and use.
struct GuardedResolver(Arc<Policy>);

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.0.clone();
        let host = name.as_str().to_string();
        Box::pin(async move {
            let resolved = tokio::net::lookup_host((host.as_str(), 0)).await?;
            let allowed: Vec<_> = resolved.filter(|a| policy.check_ip(a.ip()).is_ok()).collect();
            if allowed.is_empty() {
                // Which address it resolved to is the server's knowledge, not the client's: not said.
                let message = format!(
                    "The image host '{host}' resolves to no address the server may fetch from (non-public addresses \
                     are refused)."
                );
                return Err(Box::new(Refusal { code: "image_url_refused", message }) as _);
            }
            Ok(Box::new(allowed.into_iter()) as Addrs)
        })
    }
}

pub(super) struct Client {
    http: reqwest::Client,
    policy: Arc<Policy>,
    max_bytes: usize,
}

impl Client {
    pub fn new(policy: Arc<Policy>, connect_timeout: Duration, max_bytes: usize) -> Result<Self, String> {
        // webpki-roots (Mozilla's roots, bundled): the same trust in every container, whatever CA files it has.
        let roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("image fetcher TLS: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let hops = policy.clone();
        let redirects = redirect::Policy::custom(move |attempt| {
            if attempt.previous().len() > MAX_MEDIA_REDIRECTS {
                let message = format!("The image URL redirected more than {MAX_MEDIA_REDIRECTS} times.");
                return attempt.error(Refusal { code: "image_fetch_failed", message });
            }
            match hops.check_url(attempt.url()) {
                Ok(()) => attempt.follow(),
                Err(r) => {
                    let message = format!("The image URL redirected to a refused location. {}", r.message);
                    attempt.error(Refusal { code: r.code, message })
                }
            }
        });
        let http = reqwest::Client::builder()
            .no_proxy() // a proxy would connect for us, past the address check
            .tls_backend_preconfigured(tls)
            .dns_resolver(Arc::new(GuardedResolver(policy.clone())))
            .redirect(redirects)
            .connect_timeout(connect_timeout)
            .user_agent(concat!("deepinfer-server/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("image fetcher: {e}"))?;
        Ok(Client { http, policy, max_bytes })
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The image at `url` (checked by the caller), its bytes added to `total`, refused past `total_limit`.
    pub async fn get(&self, url: &Url, total: &AtomicUsize, total_limit: usize) -> Result<Bytes, Failure> {
        let bytes = match url.scheme() {
            "file" => self.read_file(url).await?,
            _ => return self.get_http(url, total, total_limit).await,
        };
        if total.fetch_add(bytes.len(), Ordering::Relaxed) + bytes.len() > total_limit {
            return Err(total_too_large(total_limit));
        }
        Ok(bytes)
    }

    async fn get_http(&self, url: &Url, total: &AtomicUsize, total_limit: usize) -> Result<Bytes, Failure> {
        let mut resp = self.http.get(url.clone()).send().await.map_err(from_reqwest)?;
        let status = resp.status();
        // A redirect left unfollowed: its location was missing or no http(s) URL (file://, say).
        if status.is_redirection() {
            let message = "The image URL redirected to a location the server does not follow (only http and https).";
            return Err(Failure::new("image_url_refused", message, false));
        }
        if !status.is_success() {
            let retryable = status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS;
            let retry = if retryable { "; the request may be retried" } else { "" };
            let message = format!("Fetching the image failed: its server answered {status}{retry}.");
            return Err(Failure::new("image_fetch_failed", message, retryable));
        }
        // Refused before reading when the server says it is too large.
        if resp.content_length().is_some_and(|n| n > self.max_bytes as u64) {
            return Err(too_large(self.max_bytes));
        }
        let mut buf = BytesMut::with_capacity(resp.content_length().map_or(64 << 10, |n| n as usize));
        while let Some(chunk) = resp.chunk().await.map_err(from_reqwest)? {
            if buf.len() + chunk.len() > self.max_bytes {
                return Err(too_large(self.max_bytes));
            }
            if total.fetch_add(chunk.len(), Ordering::Relaxed) + chunk.len() > total_limit {
                return Err(total_too_large(total_limit));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf.freeze())
    }

    /// A `file://` image under the allowed directory. A path that names a place outside it is refused; past
    /// that check, every failure (missing, a symlink out, not a regular file) reads the same, so that a client
    /// cannot probe the server's files.
    async fn read_file(&self, url: &Url) -> Result<Bytes, Failure> {
        let root = self.policy.local_root.as_deref().ok_or_else(|| super::guard::scheme_refusal("file"))?;
        let path = local_path(root, url)?;
        let unreadable = || {
            let message = "No readable image file at that path under the server's --allowed-local-media-path.";
            Failure::new("image_fetch_failed", message, false)
        };
        let real = tokio::fs::canonicalize(&path).await.map_err(|_| unreadable())?;
        if !within_root(root, &real) {
            return Err(unreadable());
        }
        let file = tokio::fs::File::open(&real).await.map_err(|_| unreadable())?;
        let meta = file.metadata().await.map_err(|_| unreadable())?;
        if !meta.is_file() {
            return Err(unreadable());
        }
        if meta.len() > self.max_bytes as u64 {
            return Err(too_large(self.max_bytes));
        }
        // The size may change after the check: read at most one byte past the limit.
        let mut buf = Vec::with_capacity(meta.len() as usize);
        file.take(self.max_bytes as u64 + 1).read_to_end(&mut buf).await.map_err(|_| unreadable())?;
        if buf.len() > self.max_bytes {
            return Err(too_large(self.max_bytes));
        }
        Ok(buf.into())
    }
}

/// A client error as a failure: a guard refusal found in its chain, else connection-level failures (retryable)
/// apart from the rest.
fn from_reqwest(e: reqwest::Error) -> Failure {
    let mut source = e.source();
    while let Some(s) = source {
        if let Some(r) = s.downcast_ref::<Refusal>() {
            return r.clone().into();
        }
        source = s.source();
    }
    if e.is_dns() {
        return Failure::new(
            "image_fetch_failed",
            "The image host could not be resolved; the request may be retried.",
            true,
        );
    }
    if e.is_connect() || e.is_timeout() || e.is_body() || e.is_request() {
        let message = "Fetching the image failed: the connection to its server failed; the request may be retried.";
        return Failure::new("image_fetch_failed", message, true);
    }
    Failure::new("image_fetch_failed", "Fetching the image failed.", false)
}

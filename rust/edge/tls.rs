//! TLS on the client side (rustls with the ring provider, the one image fetching already uses): `--ssl-certfile`
//! and `--ssl-keyfile`, and mutual TLS with `--ssl-ca-certs` and `--ssl-cert-reqs` (vLLM's flags, with the stdlib
//! `ssl` meaning of 0 none, 1 optional, 2 required).
//!
//! Certificates are rotated under a running server (cert-manager renews a Secret and the kubelet swaps it into the
//! pod's volume), so the files are polled every `POLL`: when one changed, a config built from them replaces the
//! current one. Each handshake takes the config current when it starts, so open connections keep theirs and new
//! ones get the new certificate. New files that do not load (half written, a key that does not match) leave the
//! current config in place and are logged, once per change.

use crate::py_record::py_record;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio_rustls::TlsAcceptor;

/// How often the files are checked for a change: a stat of each, nothing read unless one changed.
pub const POLL: Duration = Duration::from_secs(2);

py_record! {
    /// The files and the client-certificate policy, as the command line gives them.
    #[derive(Debug, Clone)]
    pub struct TlsFiles {
        pub certfile: String,
        pub keyfile: String,
        pub ca_certs: Option<String>,
        /// 0: no client certificate asked for; 1: asked for and verified when sent; 2: required.
        pub cert_reqs: u8,
    }
}

/// What a file looked like when last read: (modified, size, inode), or `None` while it is missing.
type Stamp = Vec<Option<(i64, i64, u64, u64)>>;

impl TlsFiles {
    /// A server config from the files, or a one-line error that names the file at fault.
    pub fn load(&self) -> Result<Arc<ServerConfig>, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&self.certfile)
            .and_then(Iterator::collect)
            .map_err(|e| pem_error("--ssl-certfile", &self.certfile, "certificate", e))?;
        if certs.is_empty() {
            return Err(format!("--ssl-certfile {}: no PEM certificate in it", self.certfile));
        }
        let key = PrivateKeyDer::from_pem_file(&self.keyfile)
            .map_err(|e| pem_error("--ssl-keyfile", &self.keyfile, "unencrypted private key", e))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?;
        let builder = match (self.cert_reqs, &self.ca_certs) {
            (0, _) => builder.with_no_client_auth(),
            (reqs, Some(ca)) => {
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(self.roots(ca)?), provider);
                let verifier = if reqs == 1 { verifier.allow_unauthenticated() } else { verifier };
                builder.with_client_cert_verifier(verifier.build().map_err(|e| format!("--ssl-ca-certs {ca}: {e}"))?)
            }
            (_, None) => return Err("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs".into()),
        };
        let mut config = builder.with_single_cert(certs, key).map_err(|e| match e {
            rustls::Error::InconsistentKeys(_) => {
                format!("--ssl-keyfile {} is not the key of --ssl-certfile {}", self.keyfile, self.certfile)
            }
            e => format!("--ssl-keyfile {} / --ssl-certfile {}: {e}", self.keyfile, self.certfile),
        })?;
        // The server speaks HTTP/1.1 only; a client that offers h2 as well settles on it.
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    fn roots(&self, ca: &str) -> Result<RootCertStore, String> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(ca).map_err(|e| pem_error("--ssl-ca-certs", ca, "certificate", e))? {
            let cert = cert.map_err(|e| pem_error("--ssl-ca-certs", ca, "certificate", e))?;
            roots.add(cert).map_err(|e| format!("--ssl-ca-certs {ca}: {e}"))?;
        }
        if roots.is_empty() {
            return Err(format!("--ssl-ca-certs {ca}: no PEM certificate in it"));
        }
        Ok(roots)
    }

    fn paths(&self) -> impl Iterator<Item = &str> {
        [Some(&self.certfile), Some(&self.keyfile), self.ca_certs.as_ref()].into_iter().flatten().map(String::as_str)
    }

    fn stamp(&self) -> Stamp {
        self.paths()
            .map(|p| std::fs::metadata(p).ok().map(|m| (m.mtime(), m.mtime_nsec(), m.ino(), m.size())))
            .collect()
    }
}

fn pem_error(flag: &str, path: &str, what: &str, e: pem::Error) -> String {
    match e {
        pem::Error::Io(e) => format!("{flag} {path}: {e}"),
        pem::Error::NoItemsFound => format!("{flag} {path}: no PEM {what} in it"),
        e => format!("{flag} {path}: not valid PEM ({e})"),
    }
}

/// The config new handshakes use, replaced when the files change.
pub struct Tls {
    files: TlsFiles,
    current: RwLock<Arc<ServerConfig>>,
}

impl Tls {
    pub fn new(files: TlsFiles) -> Result<Arc<Self>, String> {
        let config = files.load()?;
        Ok(Arc::new(Tls { files, current: RwLock::new(config) }))
    }

    /// An acceptor with the current config: the handshake, and the connection after it, keep that one.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.read().unwrap_or_else(|e| e.into_inner()).clone())
    }

    /// Poll the files every `POLL` on the current runtime, and reload them when they change.
    pub fn watch(self: &Arc<Self>) {
        let tls = self.clone();
        tokio::spawn(async move {
            let mut seen = tls.files.stamp();
            let mut tick = tokio::time::interval(POLL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                // File system work off the HTTP workers: a stat, and on a change a few small reads.
                let (t, before) = (tls.clone(), std::mem::take(&mut seen));
                match tokio::task::spawn_blocking(move || t.reload_if_changed(before)).await {
                    Ok(now) => seen = now,
                    Err(e) => tracing::error!("TLS reload check failed: {e}"),
                }
            }
        });
    }

    /// Reload when the files' stamp differs from `seen`; returns the stamp now.
    fn reload_if_changed(&self, seen: Stamp) -> Stamp {
        let now = self.files.stamp();
        if now == seen {
            return now;
        }
        match self.files.load() {
            Ok(config) => {
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = config;
                tracing::info!("TLS: loaded the new certificate from {}; new connections use it", self.files.certfile);
            }
            Err(e) => tracing::error!("TLS: keeping the current certificate, the new files do not load: {e}"),
        }
        now
    }
}

/// Load the TLS files as the server will (`--ssl-*`), so that a bad one stops the start-up before any rank
/// loads: raises ValueError with a one-line message naming the file.
#[pyfunction]
#[pyo3(signature = (certfile, keyfile, ca_certs=None, cert_reqs=0))]
pub fn check_tls(certfile: String, keyfile: String, ca_certs: Option<String>, cert_reqs: u8) -> PyResult<()> {
    TlsFiles { certfile, keyfile, ca_certs, cert_reqs }.load().map(drop).map_err(PyValueError::new_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(certfile: &str, keyfile: &str) -> TlsFiles {
        TlsFiles { certfile: certfile.into(), keyfile: keyfile.into(), ca_certs: None, cert_reqs: 0 }
    }

    #[test]
    fn a_bad_file_is_a_one_line_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let missing = missing.to_str().unwrap();
        let err = files(missing, missing).load().unwrap_err();
        assert!(err.starts_with(&format!("--ssl-certfile {missing}: ")) && !err.contains('\n'), "{err}");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let err = files(empty.to_str().unwrap(), missing).load().unwrap_err();
        assert_eq!(err, format!("--ssl-certfile {}: no PEM certificate in it", empty.display()));
        let mut mtls = files(missing, missing);
        mtls.cert_reqs = 2;
        assert!(mtls.load().unwrap_err().starts_with("--ssl-certfile"), "the certificate is read first");
    }
}

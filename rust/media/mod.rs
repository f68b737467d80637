//! Image input: find a request's images, check them against the limits and the fetch policy, and fetch the
//! external ones, after admission and before the codec. data: URLs and base64 blocks are only counted here; the
//! Python side decodes them.
//!
//! Everything refused or failed is a 400 naming the request field (`param`); see `ApiError::Media`.

mod addr;
mod fetch;
pub mod guard;
mod refs;

use crate::config::ServerConfig;
use crate::error::ApiError;
use bytes::Bytes;
use futures_util::stream::{self, StreamExt, TryStreamExt};
use guard::Policy;
use reqwest::Url;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;
use tokio::time::Instant;

pub use refs::{ImageRef, Source};

/// The fetched bytes of a request's external images, by URL as the request spelled it.
pub type Fetched = HashMap<String, Bytes>;

/// Fetches of one request in flight at once.
const CONCURRENT_FETCHES: usize = 4;

/// Limits of one request.
#[derive(Debug, Clone, Copy)]
struct Limits {
    images: usize,
    bytes: usize,
    total_bytes: usize,
}

/// The image fetcher, built once at start-up and shared by every request.
pub struct Fetcher {
    client: fetch::Client,
    limits: Limits,
    timeout: Duration,
}

/// A refusal or failure of the image at `param`.
fn media(param: &str, code: &'static str, message: impl Into<String>, retryable: bool) -> ApiError {
    ApiError::Media { message: message.into(), code, param: param.to_string(), retryable }
}

impl Fetcher {
    pub fn new(cfg: &ServerConfig) -> Result<Self, String> {
        let policy = Policy::new(
            cfg.media.allow_private_media_urls,
            &cfg.media.allowed_media_networks,
            &cfg.media.allowed_media_domains,
            cfg.media.allowed_local_media_path.as_deref(),
        )?;
        for net in policy.networks_with_metadata() {
            tracing::warn!(%net, "--allowed-media-networks includes a cloud-metadata address: images may be fetched from it");
        }
        if !(cfg.limits.media_fetch_timeout_s > 0.0 && cfg.limits.media_fetch_timeout_s.is_finite()) {
            return Err(format!("--media-fetch-timeout must be positive, got {}", cfg.limits.media_fetch_timeout_s));
        }
        let timeout = Duration::from_secs_f64(cfg.limits.media_fetch_timeout_s);
        let limits = Limits {
            images: cfg.limits.max_images_per_request,
            bytes: cfg.limits.max_image_bytes,
            total_bytes: cfg.limits.max_image_total_bytes,
        };
        Ok(Fetcher { client: fetch::Client::new(Arc::new(policy), timeout, limits.bytes)?, limits, timeout })
    }

    /// False when `--max-images-per-request 0`: every image is refused.
    pub fn is_enabled(&self) -> bool {
        self.limits.images > 0
    }

    pub fn max_images(&self) -> usize {
        self.limits.images
    }

    /// Check `refs` against the limits and the policy, then fetch their external URLs (each once, a few at a
    /// time) by the earlier of `deadline` and the fetch timeout. Nothing is fetched unless every image passes
    /// the checks.
    pub async fn fetch(&self, refs: &[ImageRef], deadline: Option<Instant>) -> Result<Fetched, ApiError> {
        let (urls, inline) = self.check(refs)?;
        if urls.is_empty() {
            return Ok(Fetched::new());
        }
        let own = Instant::now() + self.timeout;
        let deadline = deadline.map_or(own, |d| d.min(own));
        let total = Arc::new(AtomicUsize::new(inline));
        let limit = self.limits.total_bytes;
        stream::iter(urls)
            .map(|Pending { spelled, url, param }| {
                let total = total.clone();
                async move {
                    let got = tokio::time::timeout_at(deadline, self.client.get(&url, &total, limit)).await;
                    match got {
                        Ok(Ok(bytes)) => Ok((spelled, bytes)),
                        Ok(Err(f)) => Err(media(&param, f.code, format!("{param}: {}", f.message), f.retryable)),
                        Err(_) => Err(media(
                            &param,
                            "image_fetch_timeout",
                            format!(
                                "Fetching the image at {param} did not finish in time (this server allows {:.3} s for \
                                 a request's images, less when the request's own timeout ends sooner); the request \
                                 may be retried.",
                                self.timeout.as_secs_f64()
                            ),
                            true,
                        )),
                    }
                }
            })
            .buffer_unordered(CONCURRENT_FETCHES)
            .try_collect()
            .await
    }

    /// The checks made before any fetch: count, inline sizes, URL syntax, scheme, domain and IP literal. Returns
    /// the distinct URLs to fetch (as spelled and parsed) with the first param naming each, and the inline bytes.
    fn check(&self, refs: &[ImageRef]) -> Result<(Vec<Pending>, usize), ApiError> {
        let Some(first) = refs.first() else { return Ok((Vec::new(), 0)) };
        let Limits { images, bytes, total_bytes } = self.limits;
        if images == 0 {
            return Err(media(&first.param, "images_disabled", "This server does not accept images.", false));
        }
        if let Some(extra) = refs.get(images) {
            let msg = format!("The request has {} images; this server accepts at most {images}.", refs.len());
            return Err(media(&extra.param, "too_many_images", msg, false));
        }
        let (mut urls, mut inline) = (Vec::<Pending>::new(), 0usize);
        for r in refs {
            let spelled = match &r.source {
                Source::Inline { bytes: n } => {
                    inline += n;
                    if *n > bytes || inline > total_bytes {
                        return Err(too_large(&r.param, *n > bytes, bytes, total_bytes));
                    }
                    continue;
                }
                Source::Url(url) => url,
            };
            if urls.iter().any(|p| p.spelled == *spelled) {
                continue;
            }
            let url = Url::parse(spelled).map_err(|e| {
                media(
                    &r.param,
                    "image_url_invalid",
                    format!("The image URL at {} is not a valid URL: {e}.", r.param),
                    false,
                )
            })?;
            let policy = self.client.policy();
            let checked = match (url.scheme(), &policy.local_root) {
                ("file", Some(root)) => guard::local_path(root, &url).map(drop),
                ("file", None) => Err(guard::scheme_refusal("file")),
                _ => policy.check_url(&url),
            };
            checked.map_err(|e| media(&r.param, e.code, format!("{}: {}", r.param, e.message), false))?;
            urls.push(Pending { spelled: spelled.clone(), url, param: r.param.clone() });
        }
        Ok((urls, inline))
    }
}

/// A URL to fetch: as the request spelled it (the key of `Fetched`), parsed, and the first field naming it.
/// Owned: a borrowed one would make the fetch stream's closure higher-ranked, which a `Send` handler future
/// cannot prove (rust-lang/rust#102211).
struct Pending {
    spelled: String,
    url: Url,
    param: String,
}

/// Over the per-image limit (`one`) or the per-request total.
fn too_large(param: &str, one: bool, bytes: usize, total_bytes: usize) -> ApiError {
    let msg = if one {
        format!("The image at {param} is larger than this server's limit of {bytes} bytes per image.")
    } else {
        format!("The request's images together are larger than this server's limit of {total_bytes} bytes.")
    };
    media(param, "image_too_large", msg, false)
}

#[cfg(test)]
mod tests;

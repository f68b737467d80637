//! The built-in console (`--console on`, the default): a page at `/` with live status, batch progress and a
//! playground. Its files (`rust/console/assets/`: plain HTML, CSS and JS modules, no build step, nothing from
//! another origin) are compiled into the module. The page and its assets are open, as a login page is; the data
//! behind them is not: `/console/status` sits behind --api-key with the API, and the page asks for the key.
//!
//! Every console response carries a strict Content-Security-Policy (scripts and styles from this origin only, no
//! inline script, no eval, requests to this origin only) and `frame-ancestors 'none'`: model output that slipped
//! into the DOM as HTML could still run nothing, and no other site can frame the page.

mod status;

use crate::path::AppState;
use axum::Router;
use axum::extract::{FromRef, Path};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use std::sync::Arc;

pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; \
                       connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The console's files: name, content type, content.
const ASSETS: &[(&str, &str, &str)] = &[
    ("style.css", "text/css; charset=utf-8", include_str!("assets/style.css")),
    ("app.js", "text/javascript; charset=utf-8", include_str!("assets/app.js")),
    ("api.js", "text/javascript; charset=utf-8", include_str!("assets/api.js")),
    ("chart.js", "text/javascript; charset=utf-8", include_str!("assets/chart.js")),
    ("status.js", "text/javascript; charset=utf-8", include_str!("assets/status.js")),
    ("batches.js", "text/javascript; charset=utf-8", include_str!("assets/batches.js")),
    ("playground.js", "text/javascript; charset=utf-8", include_str!("assets/playground.js")),
    ("snippets.js", "text/javascript; charset=utf-8", include_str!("assets/snippets.js")),
    ("sse.js", "text/javascript; charset=utf-8", include_str!("assets/sse.js")),
];
const PAGE: &str = include_str!("assets/index.html");

/// The status route, for the router's keyed part (behind --api-key with the API).
pub fn keyed<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S>
where
    Arc<AppState>: FromRef<S>,
{
    let sizes = Arc::new(status::StoreSizes::default());
    router.route("/console/status", get(move |st| status::status(st, sizes.clone())))
}

/// The page and its files, open.
pub fn open<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    router.route("/", get(page)).route("/console/{file}", get(asset))
}

async fn page() -> Response {
    secured("text/html; charset=utf-8", PAGE)
}

async fn asset(Path(file): Path<String>) -> Response {
    match ASSETS.iter().find(|(name, _, _)| *name == file) {
        Some((_, kind, body)) => secured(kind, body),
        None => crate::error::ApiError::RouteNotFound(format!("/console/{file}")).into_response(),
    }
}

fn secured(kind: &'static str, body: &'static str) -> Response {
    let mut resp = (StatusCode::OK, body).into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    // The files change only with the server's version: a short cache keeps a reload after an upgrade fresh.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_only_files_it_ships_and_nothing_inline() {
        for (name, _, body) in ASSETS {
            assert!(!body.contains("eval(") && !body.contains("new Function"), "{name}");
            assert!(!body.contains("innerHTML") && !body.contains("insertAdjacentHTML"), "{name}: text only");
            assert!(!body.contains("http://") && !body.contains("https://"), "{name}: no other origin");
        }
        assert!(!PAGE.contains("<script>") && !PAGE.contains("style="), "no inline script or style");
        for src in PAGE.split("src=\"").skip(1).chain(PAGE.split("href=\"").skip(1)) {
            let target = &src[..src.find('"').unwrap()];
            if let Some(file) = target.strip_prefix("console/") {
                assert!(ASSETS.iter().any(|(n, _, _)| *n == file), "{target} is shipped");
            }
        }
        assert!(CSP.contains("frame-ancestors 'none'") && !CSP.contains("unsafe"));
    }
}

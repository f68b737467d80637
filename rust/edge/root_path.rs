//! `--root-path /prefix`: the server is reached through a proxy under a path prefix.
//!
//! Proxies do this two ways: some strip the prefix (nginx `proxy_pass http://up/;`), some forward the full path
//! (`proxy_pass http://up;`). The server answers both: a path under the prefix is routed without it, and any
//! other path as it is. That is what Starlette does with an ASGI `root_path` (so vLLM's `--root-path` and
//! uvicorn's), and `/openapi.json` names the prefix in `servers`, as FastAPI's does. Only with the option: without
//! it nothing is wrapped and no request pays for it.

use axum::Router;
use axum::extract::Request;
use axum::http::Uri;
use std::sync::Arc;

/// `app` answering under `prefix` too (`/prefix`, no trailing slash). The rewrite runs before routing, so every
/// route, fallback and refusal envelope sees the path without the prefix.
pub fn mount(app: Router, prefix: &str) -> Router {
    let prefix: Arc<str> = prefix.into();
    let rewrite = move |mut req: Request| {
        if let Some(uri) = strip(req.uri(), &prefix) {
            *req.uri_mut() = uri;
        }
        req
    };
    Router::new().fallback_service(tower::util::MapRequest::new(app, rewrite))
}

/// The URI without `prefix`, when its path is the prefix or lies under it; `None` otherwise.
fn strip(uri: &Uri, prefix: &str) -> Option<Uri> {
    let rest = uri.path().strip_prefix(prefix)?;
    if !(rest.is_empty() || rest.starts_with('/')) {
        return None; // `/prefixed`, not `/prefix/...`
    }
    let path = if rest.is_empty() { "/" } else { rest };
    let path_and_query = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(path_and_query.parse().ok()?);
    Uri::from_parts(parts).ok()
}

/// The OpenAPI document with `servers` set to the prefix, so that clients generated from it call the paths the
/// proxy serves. A document that is not JSON is served unchanged.
pub fn openapi_servers(doc: &str, prefix: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(doc) {
        Ok(mut v) if v.is_object() => {
            v["servers"] = serde_json::json!([{"url": prefix}]);
            v.to_string()
        }
        _ => doc.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::routing::get;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    #[test]
    fn only_the_prefix_and_paths_under_it_are_stripped() {
        let s = |u: &str| strip(&u.parse().unwrap(), "/api").map(|u| u.to_string());
        assert_eq!(s("/api/v1/models").as_deref(), Some("/v1/models"));
        assert_eq!(s("/api/v1/loads?model=m").as_deref(), Some("/v1/loads?model=m"));
        assert_eq!(s("/api").as_deref(), Some("/"));
        assert_eq!(s("/api?x=1").as_deref(), Some("/?x=1"));
        assert_eq!(s("/apiary/v1/models"), None);
        assert_eq!(s("/v1/models"), None);
    }

    #[tokio::test]
    async fn both_proxy_styles_reach_the_route() {
        let app = Router::new().route("/v1/models", get(|| async { "models" }));
        let app = mount(app.fallback(|| async { (axum::http::StatusCode::NOT_FOUND, "none") }), "/api");
        for (path, want) in [("/api/v1/models", "models"), ("/v1/models", "models"), ("/apiv1/models", "none")] {
            let resp = app.clone().oneshot(Request::get(path).body(Body::empty()).unwrap()).await.unwrap();
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], want.as_bytes(), "{path}");
        }
    }

    #[test]
    fn openapi_names_the_prefix() {
        let doc = openapi_servers(r#"{"openapi":"3.1.0","servers":[{"url":"/"}],"paths":{}}"#, "/api");
        let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
        assert_eq!(v["servers"], serde_json::json!([{"url": "/api"}]));
        assert_eq!(openapi_servers("not json", "/api"), "not json");
    }
}

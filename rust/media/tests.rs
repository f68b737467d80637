//! The fetcher end to end: the limits, and real fetches from small HTTP servers on loopback addresses.

use super::*;
use axum::Router;
use axum::body::Body;
use axum::extract::Query;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Redirect};
use axum::routing::get;
use std::net::SocketAddr;

const LIMIT: usize = 1000;

fn cfg(edit: impl FnOnce(&mut ServerConfig)) -> ServerConfig {
    let mut c = ServerConfig::for_tests();
    c.limits.max_image_bytes = LIMIT;
    c.limits.max_image_total_bytes = 2 * LIMIT;
    c.limits.media_fetch_timeout_s = 0.3;
    edit(&mut c);
    c
}

fn fetcher(edit: impl FnOnce(&mut ServerConfig)) -> Fetcher {
    Fetcher::new(&cfg(edit)).unwrap()
}

fn url(param: &str, u: &str) -> ImageRef {
    ImageRef { param: param.into(), source: Source::Url(u.into()) }
}

fn inline(param: &str, bytes: usize) -> ImageRef {
    ImageRef { param: param.into(), source: Source::Inline { bytes } }
}

/// (code, param, retryable) of a media error.
fn parts(e: ApiError) -> (&'static str, String, bool) {
    match e {
        ApiError::Media { code, param, retryable, .. } => (code, param, retryable),
        other => panic!("not a media error: {other:?}"),
    }
}

async fn refused(f: &Fetcher, refs: &[ImageRef]) -> (&'static str, String, bool) {
    parts(f.fetch(refs, None).await.expect_err("should be refused"))
}

async fn message(f: &Fetcher, refs: &[ImageRef]) -> String {
    f.fetch(refs, None).await.expect_err("should be refused").to_string()
}

/// A test image server on `ip`, port chosen by the system.
async fn serve(ip: [u8; 4]) -> SocketAddr {
    #[derive(serde::Deserialize)]
    struct To {
        to: String,
    }
    let app = Router::new()
        .route("/img.png", get(|| async { "PNGDATA" }))
        .route("/other.png", get(|| async { "OTHER" }))
        .route("/big", get(|| async { vec![0u8; LIMIT + 1] }))
        .route(
            "/chunked",
            get(|| async {
                let chunks = (0..4).map(|_| Ok::<_, std::io::Error>(vec![1u8; LIMIT / 2]));
                Body::from_stream(futures_util::stream::iter(chunks))
            }),
        )
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                "late"
            }),
        )
        .route("/500", get(|| async { StatusCode::INTERNAL_SERVER_ERROR }))
        .route("/429", get(|| async { StatusCode::TOO_MANY_REQUESTS }))
        .route("/404", get(|| async { StatusCode::NOT_FOUND }))
        .route("/redirect", get(|Query(q): Query<To>| async move { Redirect::temporary(&q.to) }))
        .route("/loop", get(|| async { (StatusCode::FOUND, [(header::LOCATION, "/loop")]).into_response() }));
    let listener = tokio::net::TcpListener::bind((std::net::Ipv4Addr::from(ip), 0)).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

#[tokio::test]
async fn limits_are_checked_before_any_fetch() {
    let f = fetcher(|c| c.limits.max_images_per_request = 2);
    // Nothing listens on these: a fetch would fail differently.
    let dead = "http://8.8.8.8:1/a.png";
    let three = [inline("a", 1), url("b", dead), url("c", dead)];
    assert_eq!(refused(&f, &three).await, ("too_many_images", "c".into(), false));
    assert_eq!(refused(&f, &[inline("a", LIMIT + 1)]).await, ("image_too_large", "a".into(), false));
    assert_eq!(refused(&f, &[inline("a", LIMIT), inline("b", LIMIT), inline("c", 1)]).await.0, "too_many_images");
    let f = fetcher(|c| c.limits.max_images_per_request = 3);
    let over_total = [inline("a", LIMIT), inline("b", LIMIT), inline("c", 1)];
    assert_eq!(refused(&f, &over_total).await, ("image_too_large", "c".into(), false));
    assert!(f.fetch(&[inline("a", LIMIT), inline("b", LIMIT)], None).await.unwrap().is_empty());
    assert_eq!(refused(&f, &[inline("a", 1), url("b", "ftp://x.example/a")]).await.0, "image_scheme_unsupported");
    assert_eq!(refused(&f, &[url("b", "not a url")]).await.0, "image_url_invalid");
    assert_eq!(refused(&f, &[url("b", "file:///etc/passwd")]).await, ("image_url_refused", "b".into(), false));

    let off = fetcher(|c| c.limits.max_images_per_request = 0);
    assert!(!off.is_enabled());
    assert_eq!(refused(&off, &[inline("x", 1)]).await, ("images_disabled", "x".into(), false));
    assert!(off.fetch(&[], None).await.unwrap().is_empty());
}

#[tokio::test]
async fn loopback_is_refused_by_default_and_fetched_when_allowed() {
    let addr = serve([127, 0, 0, 1]).await;
    let img = format!("http://{addr}/img.png");
    let strict = fetcher(|_| {});
    let (code, param, retry) = refused(&strict, &[url("messages[0].content[0].image_url.url", &img)]).await;
    assert_eq!((code, param.as_str(), retry), ("image_url_refused", "messages[0].content[0].image_url.url", false));
    // By name: the resolver's filter refuses what localhost resolves to.
    let named = format!("http://localhost:{}/img.png", addr.port());
    assert_eq!(refused(&strict, &[url("p", &named)]).await.0, "image_url_refused");
    assert!(message(&strict, &[url("p", &named)]).await.contains("resolves to no address"));

    let open = fetcher(|c| c.media.allow_private_media_urls = true);
    let other = format!("http://{addr}/other.png");
    let refs = [url("a", &img), url("b", &other), url("c", &img), url("d", &named)];
    let got = open.fetch(&refs, None).await.unwrap();
    assert_eq!(got.len(), 3, "deduplicated by URL as spelled");
    assert_eq!((&got[&img][..], &got[&other][..], &got[&named][..]), (&b"PNGDATA"[..], &b"OTHER"[..], &b"PNGDATA"[..]));
}

#[tokio::test]
async fn every_redirect_hop_is_checked() {
    let target = serve([127, 0, 0, 1]).await;
    let allowed = serve([127, 0, 0, 2]).await;
    let f = fetcher(|c| c.media.allowed_media_networks = vec!["127.0.0.2/32".into()]);
    assert_eq!(&f.fetch(&[url("a", &format!("http://{allowed}/img.png"))], None).await.unwrap().len(), &1);
    let hop = format!("http://{allowed}/redirect?to=http://{target}/img.png");
    let (code, param, retry) = refused(&f, &[url("a", &hop)]).await;
    assert_eq!((code, param.as_str(), retry), ("image_url_refused", "a", false));
    let why = message(&f, &[url("a", &hop)]).await;
    assert!(why.contains("redirected to a refused location") && why.contains("127.0.0.1"), "{why}");
    // Redirects to file:// are refused like any other scheme.
    let to_file = format!("http://{allowed}/redirect?to=file:///etc/passwd");
    assert_eq!(refused(&f, &[url("a", &to_file)]).await.0, "image_url_refused");
    // The domain allowlist too: 127.0.0.2 is allowed by name, a hop to localhost is not.
    let f = fetcher(|c| {
        c.media.allow_private_media_urls = true;
        c.media.allowed_media_domains = vec!["127.0.0.2".into()];
    });
    let to_localhost = format!("http://{allowed}/redirect?to=http://localhost:{}/img.png", target.port());
    assert!(message(&f, &[url("a", &to_localhost)]).await.contains("--allowed-media-domains"));
    let same = format!("http://{allowed}/redirect?to=/img.png");
    assert_eq!(&f.fetch(&[url("a", &same)], None).await.unwrap()[&same][..], b"PNGDATA");
    assert_eq!(
        refused(&f, &[url("a", &format!("http://{allowed}/loop"))]).await,
        ("image_fetch_failed", "a".into(), false)
    );
}

#[tokio::test]
async fn sizes_statuses_and_time() {
    let addr = serve([127, 0, 0, 1]).await;
    let f = fetcher(|c| c.media.allow_private_media_urls = true);
    let at = |path: &str| [url("p", &format!("http://{addr}{path}"))];
    assert_eq!(refused(&f, &at("/big")).await, ("image_too_large", "p".into(), false));
    assert_eq!(refused(&f, &at("/chunked")).await, ("image_too_large", "p".into(), false));
    assert_eq!(refused(&f, &at("/500")).await, ("image_fetch_failed", "p".into(), true));
    assert_eq!(refused(&f, &at("/429")).await, ("image_fetch_failed", "p".into(), true));
    assert_eq!(refused(&f, &at("/404")).await, ("image_fetch_failed", "p".into(), false));

    let start = Instant::now();
    assert_eq!(refused(&f, &at("/slow")).await, ("image_fetch_timeout", "p".into(), true));
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(250) && took < Duration::from_secs(2), "{took:?}");
    // The request's own deadline, when earlier, applies.
    let f = fetcher(|c| {
        c.media.allow_private_media_urls = true;
        c.limits.media_fetch_timeout_s = 60.0;
    });
    let start = Instant::now();
    let e = f.fetch(&at("/slow"), Some(start + Duration::from_millis(200))).await.unwrap_err();
    assert_eq!(parts(e).0, "image_fetch_timeout");
    assert!(start.elapsed() < Duration::from_secs(2));

    // A closed port: a connection failure, retryable.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap();
    assert_eq!(refused(&f, &[url("p", &format!("http://{closed}/x"))]).await, ("image_fetch_failed", "p".into(), true));
}

#[tokio::test]
async fn retryable_failures_set_the_header() {
    let addr = serve([127, 0, 0, 1]).await;
    let f = fetcher(|c| c.media.allow_private_media_urls = true);
    for (path, header) in [("/500", "true"), ("/404", "false")] {
        let e = f.fetch(&[url("messages[0].content[0].image_url.url", &format!("http://{addr}{path}"))], None).await;
        let resp = e.unwrap_err().into_response();
        assert_eq!(
            (resp.status(), resp.headers()["x-should-retry"].to_str().unwrap()),
            (StatusCode::BAD_REQUEST, header)
        );
    }
}

#[tokio::test]
async fn local_files_only_under_the_allowed_directory() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("images");
    std::fs::create_dir(&root).unwrap();
    std::fs::write(root.join("a.png"), b"LOCAL").unwrap();
    std::fs::write(root.join("big.png"), vec![0u8; LIMIT + 1]).unwrap();
    std::fs::write(dir.path().join("secret.txt"), b"SECRET").unwrap();
    std::os::unix::fs::symlink(dir.path().join("secret.txt"), root.join("link.png")).unwrap();
    std::fs::create_dir(root.join("sub")).unwrap();
    let file = |p: &std::path::Path| Url::from_file_path(p).unwrap().to_string();
    let a = file(&root.join("a.png"));

    assert_eq!(refused(&fetcher(|_| {}), &[url("p", &a)]).await, ("image_url_refused", "p".into(), false));

    let f = fetcher(|c| c.media.allowed_local_media_path = Some(root.to_str().unwrap().into()));
    assert_eq!(&f.fetch(&[url("p", &a)], None).await.unwrap()[&a][..], b"LOCAL");
    let root_s = file(&root);
    for escape in [
        file(&dir.path().join("secret.txt")),
        format!("{root_s}/../secret.txt"),
        format!("{root_s}/%2e%2e/secret.txt"),
        format!("{root_s}/..%2fsecret.txt"),
        "file:///etc/passwd".into(),
    ] {
        assert_eq!(refused(&f, &[url("p", &escape)]).await.0, "image_url_refused", "{escape}");
    }
    for unreadable in [file(&root.join("link.png")), file(&root.join("missing.png")), file(&root.join("sub"))] {
        let e = f.fetch(&[url("p", &unreadable)], None).await.unwrap_err();
        assert!(!e.to_string().contains("SECRET"));
        assert_eq!(parts(e).0, "image_fetch_failed", "{unreadable}");
    }
    assert_eq!(refused(&f, &[url("p", &file(&root.join("big.png")))]).await.0, "image_too_large");
}

#[test]
fn bad_options_fail_at_start_up() {
    assert!(Fetcher::new(&cfg(|c| c.media.allowed_media_networks = vec!["nope".into()])).is_err());
    assert!(Fetcher::new(&cfg(|c| c.limits.media_fetch_timeout_s = 0.0)).is_err());
    assert!(Fetcher::new(&cfg(|c| c.media.allowed_local_media_path = Some("/nonexistent".into()))).is_err());
    assert_eq!(fetcher(|_| {}).max_images(), 8);
}

//! HTTP routes. `app(state, background)` builds the router; binding and serving live in `server.rs`.

mod auth;
mod batches;
mod body;
mod choices;
mod control;
mod conversations;
mod cors;
mod cross_site;
mod drain;
mod fanout;
mod files;
mod form;
mod generate;
pub mod head_limits;
mod info;
mod message_batches;
pub mod request_id;
mod route_state;
mod stored;
mod tokens;
mod traced;
mod worker;

use crate::doors::Door;
use crate::error::ApiError;
pub use crate::path::AppState;
use crate::workers::background::Background;
use axum::Router;
use axum::extract::{DefaultBodyLimit, Request};
use axum::middleware;
use axum::response::Response;
use axum::routing::{get, post};
use route_state::RouteState;
use std::sync::Arc;

pub fn app(state: Arc<AppState>, background: Option<Arc<Background>>) -> Router {
    // Behind --api-key: everything under /v1 (as vLLM guards it), and the worker metadata that names the model's
    // path and its load in detail (as SGLang guards it; smg sends the key to these when it has one).
    let mut keyed = Router::new();
    // Every door's route goes to the one request path, which learns the door from it.
    for door in Door::ALL {
        keyed = keyed.route(
            door.path(),
            post(move |st, id, owner, parent, body| generate::generate(door, st, id, owner, parent, body)),
        );
    }
    let keyed = keyed
        .route("/v1/chat/completions/render", post(worker::render_chat))
        .route("/v1/messages/count_tokens", post(tokens::count_messages_tokens))
        .route("/v1/responses/{id}", get(stored::get_response).delete(stored::delete_response))
        .route("/v1/responses/{id}/input_items", get(stored::input_items))
        .route("/v1/responses/{id}/cancel", post(stored::cancel_response))
        // No body limit from axum here: `store::files` counts an upload against --max-file-bytes as it goes to disk.
        .route("/v1/files", post(files::upload).layer(DefaultBodyLimit::disable()).get(files::list))
        .route("/v1/files/{id}", get(files::retrieve).delete(files::delete))
        .route("/v1/files/{id}/content", get(files::content))
        .route("/v1/messages/batches", post(message_batches::create).get(message_batches::list))
        .route("/v1/messages/batches/{id}", get(message_batches::retrieve).delete(message_batches::delete))
        .route("/v1/messages/batches/{id}/cancel", post(message_batches::cancel))
        .route("/v1/messages/batches/{id}/results", get(message_batches::results))
        .route("/v1/batches", post(batches::create).get(batches::list))
        .route("/v1/batches/{id}", get(batches::retrieve))
        .route("/v1/batches/{id}/cancel", post(batches::cancel))
        .route("/v1/conversations", post(conversations::create))
        .route(
            "/v1/conversations/{id}",
            get(conversations::retrieve).post(conversations::update).delete(conversations::delete),
        )
        .route("/v1/conversations/{id}/items", get(conversations::list_items).post(conversations::add_items))
        .route(
            "/v1/conversations/{id}/items/{item_id}",
            get(conversations::get_item).delete(conversations::delete_item),
        )
        .route("/tokenize", post(tokens::tokenize))
        .route("/detokenize", post(tokens::detokenize))
        .route("/v1/models", get(info::models))
        .route("/v1/models/{*model}", get(info::model)) // names may hold slashes (repo ids)
        .route("/v1/loads", get(worker::loads))
        .route("/loads", get(worker::loads))
        .route("/server_info", get(worker::server_info))
        .route("/get_server_info", get(worker::server_info))
        .route("/model_info", get(worker::model_info))
        .route("/get_model_info", get(worker::model_info))
        .route("/abort_request", post(control::abort_request))
        .route("/pause_generation", post(control::pause_generation))
        .route("/continue_generation", post(control::continue_generation))
        .route("/pause", post(control::pause))
        .route("/resume", post(control::resume))
        .route("/is_paused", get(control::is_paused))
        .route("/get_weight_version", get(control::get_weight_version))
        .route("/update_weight_version", post(control::update_weight_version))
        .route("/update_weights_from_disk", post(control::update_weights_from_disk));
    // Only with a key: each layer costs every request a boxed future (hundreds of bytes) for as long as its body
    // takes to arrive. For the same reason no `DefaultBodyLimit`: `body::RawBody`, the one body extractor, applies
    // --max-request-body-bytes itself.
    let keyed = if state.config.console { crate::console::keyed(keyed) } else { keyed };
    let keyed = match state.config.api_key {
        Some(_) => keyed.route_layer(middleware::from_fn_with_state(state.clone(), auth::require_api_key)),
        None => keyed,
    };
    // Open, like /health and /metrics: vllm-router polls /get_load without a key, and neither says more than
    // /metrics does.
    let open = if state.config.console { crate::console::open(Router::new()) } else { Router::new() };
    let app = open
        .merge(keyed)
        .route("/health", get(info::health))
        .route("/metrics", get(info::metrics))
        .route("/openapi.json", get(info::openapi))
        .route("/version", get(worker::version))
        .route("/get_load", get(worker::get_load))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), cross_site::refuse_foreign_writes))
        .layer(middleware::from_fn_with_state(state.clone(), head_limits::head_limits))
        .layer(middleware::from_fn(request_id::request_id));
    let app = match cors::layer(&state.config) {
        Some(cors) => app.layer(cors),
        None => app,
    };
    app.with_state(RouteState { path: state, background })
}

/// A refusal decided before any handler (404, 405, and the middleware's 401 and 431) uses the envelope of the door
/// whose path the request names: Anthropic's under `/v1/messages`, the OpenAI one everywhere else.
async fn not_found(req: Request) -> Response {
    let door = Door::for_path(req.uri().path());
    let err = ApiError::RouteNotFound(req.uri().path().to_string());
    drain::refuse(req.into_body(), err, door).await
}

async fn method_not_allowed(req: Request) -> Response {
    let door = Door::for_path(req.uri().path());
    drain::refuse(req.into_body(), ApiError::MethodNotAllowed, door).await
}

#[cfg(test)]
mod tests {
    //! In-process router tests (tower `oneshot`), with no engine rank: everything decided before dispatch.
    use super::*;
    use crate::admission::Admission;
    use crate::codec::Codec;
    use crate::config::ServerConfig;
    use crate::dispatch::Dispatcher;
    use crate::metrics::Metrics;
    use axum::body::Body;
    use axum::http::{Request, StatusCode};
    use http_body_util::BodyExt;
    use pyo3::prelude::*;
    use std::sync::atomic::AtomicBool;
    use tower::ServiceExt;

    pub(crate) fn state(api_key: Option<&str>) -> Arc<AppState> {
        let mut config = ServerConfig::for_tests();
        config.api_key = api_key.map(str::to_string);
        let (codec, decode) = Python::attach(|py| (py.None(), py.None()));
        Arc::new(AppState {
            admission: Admission::new(4),
            codec: Codec::start(codec, decode, 1),
            dispatcher: Dispatcher::new(Vec::new(), Arc::new(Metrics::new("test-model"))),
            media: crate::media::Fetcher::new(&config).expect("media fetcher"),
            store: None,
            traces: None,
            draining: AtomicBool::new(false),
            started_unix: 0,
            pending: Default::default(),
            weights: Default::default(),
            config,
        })
    }

    async fn send(st: &Arc<AppState>, req: Request<Body>) -> (StatusCode, axum::http::HeaderMap, serde_json::Value) {
        let resp = app(st.clone(), None).oneshot(req).await.unwrap();
        let (status, headers) = (resp.status(), resp.headers().clone());
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, headers, serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null))
    }

    fn post(body: impl Into<Body>) -> Request<Body> {
        Request::post("/v1/chat/completions").header("content-type", "application/json").body(body.into()).unwrap()
    }

    fn code(v: &serde_json::Value) -> &str {
        v["error"]["code"].as_str().unwrap_or("")
    }

    #[tokio::test]
    async fn health_and_models() {
        let st = state(None);
        let (status, _, v) = send(&st, Request::get("/health").body(Body::empty()).unwrap()).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "no rank is running");
        assert_eq!(code(&v), "service_unavailable");
        let (status, _, v) = send(&st, Request::get("/v1/models").body(Body::empty()).unwrap()).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(v["data"][0]["id"], "test-model");
        assert_eq!(v["data"][0]["max_model_len"], 4096);
        let (status, _, v) = send(&st, Request::get("/v1/models/test-model").body(Body::empty()).unwrap()).await;
        assert_eq!((status, v["id"].as_str()), (StatusCode::OK, Some("test-model")));
        let (status, _, v) = send(&st, Request::get("/v1/models/other").body(Body::empty()).unwrap()).await;
        assert_eq!((status, code(&v)), (StatusCode::NOT_FOUND, "model_not_found"));
    }

    #[tokio::test]
    async fn every_refusal_is_an_envelope() {
        let st = state(None);
        let (s, _, v) = send(&st, Request::get("/nope").body(Body::empty()).unwrap()).await;
        assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"));
        let (s, _, v) = send(&st, Request::get("/v1/chat/completions").body(Body::empty()).unwrap()).await;
        assert_eq!((s, code(&v)), (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"));
        let (s, _, v) = send(&st, post("{oops")).await;
        assert_eq!((s, code(&v)), (StatusCode::BAD_REQUEST, "invalid_request_error"));
        let (s, _, v) = send(&st, post(r#"{"model":"other","messages":[{"role":"user","content":"x"}]}"#)).await;
        assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "model_not_found"));
        let (s, _, v) = send(&st, post(vec![b' '; 2 << 20])).await;
        assert_eq!((s, code(&v)), (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"));
        let (s, _, v) = send(&st, post(r#"{"model":"test-model","messages":[{"role":"user","content":"x"}]}"#)).await;
        assert_eq!((s, code(&v)), (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable"));
    }

    #[tokio::test]
    async fn oversized_heads_are_431_envelopes() {
        let st = state(None);
        let health = || Request::get("/health");
        let mut many = health();
        for i in 0..crate::limits::MAX_HEADERS + 1 {
            many = many.header(format!("x-h{i}"), "v");
        }
        let (s, _, v) = send(&st, many.body(Body::empty()).unwrap()).await;
        assert_eq!((s, code(&v)), (StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "request_header_fields_too_large"));
        let big = health().header("x-big", "a".repeat(crate::limits::MAX_HEAD_BYTES));
        let (s, _, v) = send(&st, big.body(Body::empty()).unwrap()).await;
        assert_eq!(s, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
        assert!(v["error"]["message"].as_str().unwrap().contains("65536 bytes"));
        let under = health().header("x-big", "a".repeat(crate::limits::MAX_HEAD_BYTES - 100));
        let (s, _, _) = send(&st, under.body(Body::empty()).unwrap()).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "under the limits: /health answers (no rank here)");
    }

    #[tokio::test]
    async fn worker_metadata_routes_and_their_key() {
        let st = state(Some("k"));
        let get = |path: &str, key: bool| {
            let r = Request::get(path);
            let r = if key { r.header("authorization", "Bearer k") } else { r };
            r.body(Body::empty()).unwrap()
        };
        for open in ["/version", "/get_load"] {
            assert_eq!(send(&st, get(open, false)).await.0, StatusCode::OK, "{open} is open");
        }
        let keyed = ["/v1/loads", "/loads", "/server_info", "/get_server_info", "/model_info", "/get_model_info"];
        let keyed = [&keyed[..], &["/is_paused", "/get_weight_version"]].concat();
        for path in keyed {
            let (s, _, v) = send(&st, get(path, false)).await;
            assert_eq!((s, code(&v)), (StatusCode::UNAUTHORIZED, "invalid_api_key"), "{path}");
            assert_eq!(send(&st, get(path, true)).await.0, StatusCode::OK, "{path}");
        }
        let (_, _, v) = send(&st, get("/version", false)).await;
        assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));
        let (_, _, v) = send(&st, get("/get_load", false)).await;
        assert_eq!(v, serde_json::json!({"load": 0}));
        let (_, _, v) = send(&st, get("/server_info", true)).await;
        assert_eq!(
            (v["served_model_name"].as_str(), v["max_running_requests"].as_u64()),
            (Some("test-model"), Some(4))
        );
        assert_eq!((v["context_length"].as_u64(), v["dp_size"].as_u64()), (Some(4096), Some(0)));
        let (_, _, v) = send(&st, get("/loads?model=test-model&include=core", true)).await;
        assert_eq!((v["dp_rank_count"].as_u64(), v["loads"].as_array().map(Vec::len)), (Some(0), Some(0)));
        let (s, _, v) = send(&st, get("/v1/loads?model=other", true)).await;
        assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "model_not_found"));
        let (s, _, v) = send(&st, get("/v1/loads?model=a&model=b", true)).await;
        assert_eq!((s, code(&v)), (StatusCode::BAD_REQUEST, "invalid_request_error"), "a bad query is an envelope");
        let render = || Request::post("/v1/chat/completions/render").header("authorization", "Bearer k");
        let json = render().header("content-type", "application/json");
        let (s, _, v) = send(&st, json.body(Body::from("{oops")).unwrap()).await;
        assert_eq!((s, code(&v)), (StatusCode::BAD_REQUEST, "invalid_request_error"));
        let (s, _, v) = send(&st, render().body(Body::from("{oops")).unwrap()).await;
        assert_eq!(
            (s, code(&v), v["error"]["param"].as_str()),
            (StatusCode::UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type", Some("Content-Type"))
        );
    }

    #[tokio::test]
    async fn the_console_page_is_open_and_its_status_keyed() {
        let st = state(Some("k"));
        let resp = app(st.clone(), None).oneshot(Request::get("/").body(Body::empty()).unwrap()).await.unwrap();
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()["content-security-policy"], crate::console::CSP);
        let status = |key: bool| {
            let r = Request::get("/console/status");
            let r = if key { r.header("authorization", "Bearer k") } else { r };
            r.body(Body::empty()).unwrap()
        };
        assert_eq!(send(&st, status(false)).await.0, StatusCode::UNAUTHORIZED);
        let (s, _, v) = send(&st, status(true)).await;
        assert_eq!(
            (s, v["model"].as_str(), v["slots"]["total"].as_u64()),
            (StatusCode::OK, Some("test-model"), Some(4))
        );
        assert_eq!(v["window"]["summary"]["seconds"].as_u64().map(|n| n <= 300), Some(true));
        let mut off = ServerConfig::for_tests();
        off.console = false;
        let off = Arc::new(AppState { config: off, ..Arc::into_inner(state(None)).unwrap() });
        for path in ["/", "/console/app.js", "/console/status"] {
            let (s, _, v) = send(&off, Request::get(path).body(Body::empty()).unwrap()).await;
            assert_eq!((s, code(&v)), (StatusCode::NOT_FOUND, "not_found"), "{path}");
        }
    }

    #[tokio::test]
    async fn api_key_and_request_id() {
        let st = state(Some("k"));
        let get = |auth: Option<&str>| {
            let mut r = Request::get("/v1/models").header("x-request-id", "abc");
            if let Some(a) = auth {
                r = r.header("authorization", a);
            }
            r.body(Body::empty()).unwrap()
        };
        let (s, h, v) = send(&st, get(None)).await;
        assert_eq!((s, code(&v)), (StatusCode::UNAUTHORIZED, "invalid_api_key"));
        assert_eq!(h["x-request-id"], "abc");
        assert_eq!(send(&st, get(Some("Bearer x"))).await.0, StatusCode::UNAUTHORIZED);
        assert_eq!(send(&st, get(Some("Bearer k"))).await.0, StatusCode::OK);
        let (s, _, _) = send(&st, Request::get("/health").body(Body::empty()).unwrap()).await;
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "/health is not behind the key");
    }

    #[tokio::test]
    async fn refusals_before_the_handler_follow_the_door() {
        let st = state(Some("k"));
        let anthropic = |v: &serde_json::Value| v["type"] == "error" && v["error"]["type"].is_string();
        let keyed = |r: axum::http::request::Builder| r.header("authorization", "Bearer k");
        // 431 from the head limits, before the key is even looked at.
        let mut many = Request::post("/v1/messages");
        for i in 0..crate::limits::MAX_HEADERS + 1 {
            many = many.header(format!("x-h{i}"), "v");
        }
        let (s, _, v) = send(&st, many.body(Body::empty()).unwrap()).await;
        assert_eq!(s, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
        assert!(anthropic(&v) && v["error"]["type"] == "invalid_request_error", "{v}");
        // 413 from the body limit, on the door and on its count_tokens.
        for path in ["/v1/messages", "/v1/messages/count_tokens"] {
            let big = keyed(Request::post(path)).header("content-type", "application/json");
            let (s, _, v) = send(&st, big.body(Body::from(vec![b' '; 2 << 20])).unwrap()).await;
            assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE, "{path}");
            assert!(anthropic(&v) && v["error"]["type"] == "request_too_large", "{path}: {v}");
        }
        // 401, 404 and 405 under the door's path.
        let (s, _, v) = send(&st, Request::post("/v1/messages").body(Body::empty()).unwrap()).await;
        assert!(s == StatusCode::UNAUTHORIZED && v["error"]["type"] == "authentication_error", "{v}");
        let (s, _, v) = send(&st, keyed(Request::get("/v1/messages")).body(Body::empty()).unwrap()).await;
        assert!(s == StatusCode::METHOD_NOT_ALLOWED && anthropic(&v), "{v}");
        let (s, _, v) = send(&st, keyed(Request::get("/v1/messages/no-such-route")).body(Body::empty()).unwrap()).await;
        assert!(s == StatusCode::NOT_FOUND && v["error"]["type"] == "not_found_error", "{v}");
        // 403 for a write from a page of another origin, before the key is looked at.
        let page = |path: &str| Request::post(path).header("origin", "https://evil.example").header("host", "h:1");
        let (s, _, v) = send(&st, page("/v1/messages").body(Body::empty()).unwrap()).await;
        assert!(s == StatusCode::FORBIDDEN && v["error"]["type"] == "permission_error", "{v}");
        let (s, _, v) = send(&st, keyed(page("/v1/files")).body(Body::empty()).unwrap()).await;
        assert_eq!((s, code(&v)), (StatusCode::FORBIDDEN, "origin_not_allowed"));
        // Every other path keeps the OpenAI envelope.
        for path in ["/v1/chat/completions", "/v1/responses", "/health"] {
            let mut many = Request::post(path);
            for i in 0..crate::limits::MAX_HEADERS + 1 {
                many = many.header(format!("x-h{i}"), "v");
            }
            let (s, _, v) = send(&st, many.body(Body::empty()).unwrap()).await;
            assert_eq!((s, code(&v)), (StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "request_header_fields_too_large"));
        }
    }
}

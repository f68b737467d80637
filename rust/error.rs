//! One error type for every HTTP failure, and its one status table (`ApiError::parts`). Its default rendering is
//! the OpenAI error envelope; each door renders it in its own at the edge (`crate::doors`, `Door::respond`).

use crate::limits::{MAX_ECHO_BYTES, MAX_ERROR_MESSAGE_BYTES};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest { message: String, param: Option<String> },
    /// A 4xx decided by deepseek-recipe: status and a ready-made envelope.
    #[error("codec rejected the request ({status})")]
    Codec { status: StatusCode, body: String },
    #[error("The model `{}` does not exist.", clip(.0, MAX_ECHO_BYTES))]
    ModelNotFound(String),
    #[error("The request body is larger than the limit of {0} bytes.")]
    PayloadTooLarge(usize),
    /// A JSON body with more values than `--max-json-elements` allows (`http::json_bounds`).
    #[error("The request body's JSON has more than {0} values (arrays' and objects' members at any depth).")]
    TooManyJsonElements(usize),
    /// An upload past what all stored files may hold together (`--files-max-total-bytes`).
    #[error(
        "The files {whose} would pass their limit of {cap} bytes with this upload ({stored} bytes are stored or \
         being uploaded): delete files, or let them expire, to make room."
    )]
    FilesFull { stored: u64, cap: u64, whose: &'static str },
    /// A stored request (a response, a conversation's items) past what its owner's responses and conversations
    /// may hold (`--state-store-max-bytes-per-owner`), or past what the whole store may (`--state-store-max-bytes`):
    /// a 429, as OpenAI's quota errors are; nobody else's records are removed to make room.
    #[error(
        "{whose} hold {held} bytes, the most {they} may hold is {cap}: delete stored responses or conversations, \
         let them expire, or send 'store: false'."
    )]
    StoreFull { held: i64, cap: i64, whose: &'static str, they: &'static str },
    /// The state store could not commit now (its database unreachable or busy, its disk full): nothing was kept.
    /// A 503 with Retry-After: the store recovers by itself, and a retry (on any replica) then succeeds.
    #[error("The state store cannot keep records right now ({0}): nothing was kept. Retry shortly.")]
    StoreUnavailable(&'static str),
    /// A head over the limits: what it had, and the limits (`http::head_limits`).
    #[error(
        "The request headers are too large: {headers} headers, {bytes} bytes; the limits are {max_headers} headers \
         and {max_bytes} bytes."
    )]
    HeadersTooLarge { headers: usize, bytes: usize, max_headers: usize, max_bytes: usize },
    #[error("The request body did not arrive within {0:.0} s.")]
    BodyTimeout(f64),
    #[error("The request body must be JSON: send 'Content-Type: application/json'.")]
    NotJson,
    /// A request whose prompt and grammar together are larger than this server can hand its engine.
    #[error("The request is too large for this server: its prompt and grammar take over {0} bytes.")]
    RecordTooLarge(usize),
    #[error("The server is at capacity: {0} requests are in flight. Retry later.")]
    Overloaded(usize),
    #[error("The server is at capacity and its wait queue is full ({0} requests). Retry later.")]
    QueueFull(usize),
    #[error("The server is at capacity: the request waited {0:.3} s in the queue without a slot. Retry later.")]
    QueueTimeout(f64),
    /// A background response past the replica's bound on runs queued or running (`--max-background-runs`).
    #[error("The background lane is full: {0} background responses are queued or running. Retry later.")]
    BackgroundFull(usize),
    /// A background response past its owner's (API key's) cap (`--max-background-runs-per-owner`).
    #[error(
        "This API key has {0} background responses queued or running, its most: retry once one has ended, or \
         cancel one."
    )]
    BackgroundOwnerFull(usize),
    #[error("{0}")]
    Unavailable(String),
    #[error("The request did not finish within the request timeout of {0:.3} s.")]
    Timeout(f64),
    #[error("{0}")]
    Engine(String),
    /// The engine refused the request for something in it (prompt too long for its KV cache, a grammar or an
    /// image it cannot handle): the client's to fix.
    #[error("{message}")]
    EngineRejected { message: String, code: &'static str },
    /// The engine lacked memory for the request right now (DeepInfer's "insufficient_system_resource"): retry.
    #[error("{0}")]
    EngineBusy(String),
    /// An image the request names was refused or could not be fetched (rust/media): always the client's 400,
    /// `retryable` when a retry may succeed (timeout, connection error, upstream 5xx or 429).
    #[error("{message}")]
    Media { message: String, code: &'static str, param: String, retryable: bool },
    #[error("Not found: {}", clip(.0, MAX_ECHO_BYTES))]
    RouteNotFound(String),
    /// A stored object (a response) the request names is not there.
    #[error("{what} with id '{}' not found.", clip(.id, MAX_ECHO_BYTES))]
    NotFound { what: &'static str, id: String, param: Option<&'static str> },
    /// `previous_response_id` names no stored response: a 400 with OpenAI's own code, which Codex-style clients
    /// key on to start the chain afresh.
    #[error("Previous response with id '{}' not found.", clip(.0, MAX_ECHO_BYTES))]
    PreviousResponseNotFound(String),
    /// `previous_response_id` names a background response still running after the wait for its end
    /// (`store::background::CHAIN_WAIT`): a 409, to continue from it once it has ended.
    #[error(
        "Response '{}' is still in progress: continue from it once it has ended (its status is 'completed').",
        clip(.0, MAX_ECHO_BYTES)
    )]
    ResponseInProgress(String),
    /// The state store failed (its database is down or refused the query); what failed is logged, not sent.
    #[error("The state store failed. Retry later.")]
    Store,
    #[error("Method not allowed.")]
    MethodNotAllowed,
    #[error("Invalid or missing API key: send 'Authorization: Bearer <key>'.")]
    Unauthorized,
    /// A write from a web page of an origin the server does not allow (`http::cross_site`).
    #[error("Requests from origin '{}' are not allowed: name it in --allowed-origins.", clip(.0, MAX_ECHO_BYTES))]
    CrossOrigin(String),
    /// A request aborted (`/abort_request`, a pause that aborts) before it reached its rank: nothing was generated.
    #[error("The request was aborted before it started (/abort_request).")]
    Aborted,
    #[error("Internal server error.")]
    Internal,
}

/// Seconds a client waits to retry a write the store could not commit (a busy SQLite, a PostgreSQL failover).
pub const STORE_RETRY_AFTER: &str = "2";

/// `text` cut to at most `max` bytes at a character boundary, with `…` when cut.
pub fn clip(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end]).into()
}

/// Whether an engine's finish reason may be shown to the client: a short phrase of plain words, as the engines'
/// own reasons are. Anything else (an exception's text, a path) stays in the server log.
fn presentable(reason: &str) -> bool {
    reason.len() <= 80 && reason.bytes().all(|b| b.is_ascii_alphanumeric() || b" _-'".contains(&b))
}

impl ApiError {
    /// What a client sees when the engine ends its request with `reason` and no token (DeepInfer's finish
    /// reasons, csrc/engine/sequence.hpp), with the metrics label for it.
    pub fn from_engine(reason: &str) -> (Self, &'static str) {
        let rejected = |code: &'static str, what: &str| ApiError::EngineRejected {
            message: format!("The engine rejected the request: {what} ({reason})."),
            code,
        };
        match reason {
            "prompt_length_exceeded" => (
                rejected("context_length_exceeded", "the prompt does not fit in the engine's context or KV cache"),
                "prompt_length_exceeded",
            ),
            "insufficient_system_resource" => (
                ApiError::EngineBusy(format!(
                    "The engine ran out of memory for the request ({reason}); retry later, or with a shorter request."
                )),
                "insufficient_system_resource",
            ),
            r if r.starts_with("xgrammar") => (rejected("invalid_grammar", "its grammar failed"), "grammar_error"),
            "ve_error" => (rejected("invalid_image", "an image could not be processed"), "ve_error"),
            "images_unsupported" => (rejected("images_disabled", "this model takes no images"), "ve_error"),
            // DeepInfer computes no prompt logprobs under YoCo prefill truncation (the adapter refuses them).
            "prompt_logprobs_unavailable" => (
                rejected("prompt_logprobs_unavailable", "the engine computes no prompt logprobs in its configuration"),
                "prompt_logprobs_unavailable",
            ),
            // The engine's scheduler gave up on a running request (DeepInfer's "abort"): a server error, counted
            // apart from the other engine errors so that dashboards can tell the two.
            "abort" => (ApiError::Engine(format!("The engine aborted the request ({reason}).")), "engine_abort"),
            r if presentable(r) => {
                (ApiError::Engine(format!("The engine could not complete the request: {reason}")), "engine_error")
            }
            _ => (ApiError::Engine("The engine could not complete the request.".into()), "engine_error"),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::BadRequest { message: message.into(), param: None }
    }

    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        ApiError::BadRequest { message: message.into(), param: Some(param.to_string()) }
    }

    /// (status, error type, error code) for every variant.
    fn parts(&self) -> (StatusCode, &'static str, &'static str) {
        use ApiError::*;
        match self {
            BadRequest { .. } => (StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_request_error"),
            Codec { status, .. } => (*status, "invalid_request_error", "invalid_request_error"),
            ModelNotFound(_) => (StatusCode::NOT_FOUND, "invalid_request_error", "model_not_found"),
            NotJson => (StatusCode::UNSUPPORTED_MEDIA_TYPE, "invalid_request_error", "unsupported_media_type"),
            PayloadTooLarge(_) | RecordTooLarge(_) | TooManyJsonElements(_) => {
                (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "payload_too_large")
            }
            FilesFull { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "file_storage_limit_exceeded"),
            StoreFull { .. } => (StatusCode::TOO_MANY_REQUESTS, "insufficient_quota", "storage_quota_exceeded"),
            HeadersTooLarge { .. } => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "invalid_request_error",
                "request_header_fields_too_large",
            ),
            BodyTimeout(_) => (StatusCode::REQUEST_TIMEOUT, "invalid_request_error", "body_timeout"),
            Overloaded(_) => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "rate_limit_exceeded"),
            QueueFull(_) => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "queue_full"),
            QueueTimeout(_) => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "queue_timeout"),
            BackgroundFull(_) => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "background_queue_full"),
            BackgroundOwnerFull(_) => {
                (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", "background_runs_per_owner_exceeded")
            }
            Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable_error", "service_unavailable"),
            Timeout(_) => (StatusCode::GATEWAY_TIMEOUT, "timeout_error", "request_timeout"),
            Engine(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", "engine_error"),
            EngineRejected { code, .. } => (StatusCode::BAD_REQUEST, "invalid_request_error", code),
            EngineBusy(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable_error", "insufficient_system_resource")
            }
            Media { code, .. } => (StatusCode::BAD_REQUEST, "invalid_request_error", code),
            PreviousResponseNotFound(_) => {
                (StatusCode::BAD_REQUEST, "invalid_request_error", "previous_response_not_found")
            }
            ResponseInProgress(_) => (StatusCode::CONFLICT, "invalid_request_error", "response_in_progress"),
            RouteNotFound(_) | NotFound { .. } => (StatusCode::NOT_FOUND, "invalid_request_error", "not_found"),
            StoreUnavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "service_unavailable_error", "store_unavailable"),
            Store => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", "store_error"),
            MethodNotAllowed => (StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method_not_allowed"),
            Unauthorized => (StatusCode::UNAUTHORIZED, "invalid_request_error", "invalid_api_key"),
            CrossOrigin(_) => (StatusCode::FORBIDDEN, "invalid_request_error", "origin_not_allowed"),
            Aborted => (StatusCode::BAD_REQUEST, "invalid_request_error", "request_aborted"),
            Internal => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error"),
        }
    }

    pub fn status(&self) -> StatusCode {
        self.parts().0
    }

    /// The error code, also used as the metrics label for rejections.
    pub fn code(&self) -> &'static str {
        self.parts().2
    }

    /// The envelope `{"error": {"message", "type", "param", "code"}}` as JSON text.
    pub fn envelope(&self) -> String {
        if let ApiError::Codec { body, .. } = self {
            return clip_message(body);
        }
        let (_, kind, code) = self.parts();
        let param = match self {
            ApiError::BadRequest { param, .. } => param.clone(),
            ApiError::ModelNotFound(_) => Some("model".to_string()),
            ApiError::Media { param, .. } => Some(param.clone()),
            ApiError::NotFound { param, .. } => param.map(str::to_string),
            ApiError::PreviousResponseNotFound(_) | ApiError::ResponseInProgress(_) => {
                Some("previous_response_id".to_string())
            }
            ApiError::NotJson => Some("Content-Type".to_string()),
            _ => None,
        };
        json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": code}}).to_string()
    }

    /// The `error` object of the OpenAI envelope (a codec refusal's ready-made body included).
    pub fn error_object(&self) -> Value {
        serde_json::from_str::<Value>(&self.envelope())
            .ok()
            .and_then(|mut v| v.get_mut("error").map(Value::take))
            .unwrap_or(
                json!({"message": self.to_string(), "type": "server_error", "param": null, "code": "internal_error"}),
            )
    }

    /// The message a client reads, whichever envelope carries it.
    pub fn message(&self) -> String {
        self.error_object()["message"].as_str().map_or_else(|| self.to_string(), str::to_string)
    }
}

/// A ready-made envelope with its message cut to `MAX_ERROR_MESSAGE_BYTES` (the codec's messages may quote the request).
fn clip_message(body: &str) -> String {
    if body.len() <= MAX_ERROR_MESSAGE_BYTES {
        return body.to_string();
    }
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(body) else { return body.to_string() };
    if let Some(m) = v.pointer_mut("/error/message")
        && let Some(text) = m.as_str()
    {
        *m = clip(text, MAX_ERROR_MESSAGE_BYTES).into_owned().into();
    }
    v.to_string()
}

impl ApiError {
    /// The refusal as an HTTP response with `body`, its envelope as the door renders it, and the headers its
    /// variant calls for.
    pub fn respond(self, body: String) -> Response {
        let status = self.status();
        let mut resp = (status, [(header::CONTENT_TYPE, "application/json")], body).into_response();
        if self.status() == StatusCode::TOO_MANY_REQUESTS || matches!(self, ApiError::EngineBusy(_)) {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if matches!(self, ApiError::StoreUnavailable(_)) {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static(STORE_RETRY_AFTER));
        }
        // The openai and anthropic SDKs read this header before their own status rules (which retry no 400).
        if let ApiError::Media { retryable, .. } = &self {
            let retry = HeaderValue::from_static(if *retryable { "true" } else { "false" });
            resp.headers_mut().insert("x-should-retry", retry);
        }
        // The rest of the body was left unread: hyper closes the connection, so say so.
        if matches!(self, ApiError::PayloadTooLarge(_) | ApiError::FilesFull { .. } | ApiError::BodyTimeout(_)) {
            resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// The OpenAI envelope: every route that is not a door's (`/health`, `/v1/models` ...).
impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.envelope();
        self.respond(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_has_the_openai_shape() {
        let e = ApiError::ModelNotFound("nope".into());
        let v: serde_json::Value = serde_json::from_str(&e.envelope()).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found");
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].as_str().unwrap().contains("nope"));
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
    }

    #[test]
    fn engine_finish_reasons_map_to_client_statuses() {
        let cases = [
            ("prompt_length_exceeded", 400, "context_length_exceeded", false),
            ("insufficient_system_resource", 503, "insufficient_system_resource", true),
            ("xgrammar runtime errors or timeout", 400, "invalid_grammar", false),
            ("ve_error", 400, "invalid_image", false),
            ("prompt_logprobs_unavailable", 400, "prompt_logprobs_unavailable", false),
            ("something new", 500, "engine_error", false),
            ("abort", 500, "engine_error", false),
        ];
        for (reason, status, code, retry) in cases {
            let (e, label) = ApiError::from_engine(reason);
            let want = match reason {
                "abort" => "engine_abort",
                "something new" => "engine_error",
                _ => label,
            };
            assert_eq!(label, want, "{reason}");
            assert_eq!((e.status().as_u16(), e.code()), (status, code), "{reason}");
            assert!(e.to_string().contains(reason), "{reason}: {e}");
            let resp = e.into_response();
            assert_eq!(resp.headers().contains_key(header::RETRY_AFTER), retry, "{reason}");
        }
    }

    #[test]
    fn media_errors_name_the_param_and_say_whether_to_retry() {
        for (retryable, header) in [(true, "true"), (false, "false")] {
            let e = || ApiError::Media {
                message: "no".into(),
                code: "image_fetch_failed",
                param: "messages[0].content[1].image_url.url".into(),
                retryable,
            };
            let v: serde_json::Value = serde_json::from_str(&e().envelope()).unwrap();
            assert_eq!(v["error"]["param"], "messages[0].content[1].image_url.url");
            assert_eq!(
                (v["error"]["code"].as_str(), e().status()),
                (Some("image_fetch_failed"), StatusCode::BAD_REQUEST)
            );
            let resp = e().into_response();
            assert_eq!(
                (resp.status(), resp.headers()["x-should-retry"].to_str().unwrap()),
                (StatusCode::BAD_REQUEST, header)
            );
        }
    }

    #[test]
    fn client_strings_and_engine_internals_are_not_echoed_at_length() {
        let long = "m".repeat(4 << 20);
        let e = ApiError::ModelNotFound(long.clone());
        assert!(e.to_string().len() < MAX_ECHO_BYTES + 64 && e.envelope().len() < MAX_ECHO_BYTES + 256);
        assert_eq!(clip("añb", 2), "a…"); // never inside a character
        let body = serde_json::json!({"error": {"message": long, "type": "invalid_request_error"}}).to_string();
        let codec = ApiError::Codec { status: StatusCode::BAD_REQUEST, body };
        assert!(codec.envelope().len() < MAX_ERROR_MESSAGE_BYTES + 256);
        let (leaky, _) = ApiError::from_engine("image file: [Errno 2] No such file: '/dev/shm/deepinfer-1-x/0'");
        assert!(!leaky.to_string().contains("/dev/shm"), "{leaky}");
        let (plain, _) = ApiError::from_engine("prompt contains a token id outside the vocabulary");
        assert!(plain.to_string().contains("outside the vocabulary"));
    }

    #[test]
    fn a_store_that_cannot_commit_is_a_503_with_retry_after() {
        let resp = ApiError::StoreUnavailable("its disk is full").into_response();
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()[header::RETRY_AFTER], STORE_RETRY_AFTER);
        assert_eq!(ApiError::StoreUnavailable("x").code(), "store_unavailable");
    }

    #[test]
    fn overload_sets_retry_after() {
        let resp = ApiError::Overloaded(8).into_response();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
    }
}

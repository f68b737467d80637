//! Server settings, as the Python launcher builds them (`_native.ServerConfig` and its groups, typed in
//! `_native.pyi`).

use crate::py_record::py_record;
use std::time::Duration;

py_record! {
    /// Everything the front end is told at start-up, grouped by concern.
    #[derive(Debug, Clone)]
    pub struct ServerConfig {
        pub host: String,
        pub port: u16,
        pub served_model_names: Vec<String>,
        /// Served names that pin the thinking mode (`--served-model-name NAME=thinking|no-thinking`): name -> on.
        pub thinking_pins: std::collections::HashMap<String, bool>,
        pub max_model_len: u32,
        pub max_num_seqs: u32,
        /// What one client, request or upload may cost (`crate::limits`, every one as the flags set it).
        pub limits: crate::limits::Limits,
        pub log_level: String,
        pub exit_on_rank_failure_s: f64,
        pub drain_timeout_s: f64,
        pub http_workers: usize,
        pub codec_threads: usize,
        /// How long a long prompt waits after it is encoded for others to go to the ranks with it (`gather`); 0: off.
        pub dispatch_gather_ms: f64,
        /// Prompts shorter than this (tokens) never wait.
        pub dispatch_gather_min_tokens: usize,
        pub api_key: Option<String>,
        pub log_format: String,
        /// Longest silence on an SSE stream before a keep-alive comment.
        pub sse_keep_alive_s: f64,
        /// Shortest gap between two token events of one stream: tokens that arrive sooner wait and leave together.
        /// Below an engine's step time it never delays a token; it bounds a fast engine's event rate per stream.
        pub stream_interval_ms: f64,
        /// Where and how clients connect: TLS, a Unix socket, a path prefix (`rust/edge/`).
        pub edge: crate::edge::EdgeConfig,
        /// Whether `/` serves the built-in console (`--console on|off`; `crate::console`).
        pub console: bool,
        /// Which browser origins may call the API (`edge_args`).
        pub cors: CorsConfig,
        /// Where state is kept (`state_args`).
        pub state: StateConfig,
        /// Where images may be fetched from (`media_args`; how many and how large are `limits`).
        pub media: MediaConfig,
        /// The engine behind the ranks, as the worker metadata routes report it.
        pub engine: EngineConfig,
        /// Seconds a rank with requests in flight may go without a heartbeat before the server declares it hung,
        /// kills every rank and exits non-zero; 0 disables the watchdog.
        pub watchdog_timeout_s: f64,
        /// Whether the wait queue honours a request's `priority` (`--scheduling-policy priority`); else first come,
        /// first served, whatever a client asks.
        pub priority_scheduling: bool,
        /// The OpenAPI document served at /openapi.json (read at start-up).
        pub openapi: Option<String>,
        /// Where to export OpenTelemetry traces (`--otlp-traces-endpoint` or the `OTEL_EXPORTER_OTLP_*` variables, as
        /// the launcher resolved them) and over which protocol (`http/protobuf` or `grpc`); None: tracing is off and
        /// costs nothing.
        pub otlp_traces: Option<(String, String)>,
    }
}

py_record! {
    /// CORS (`--allowed-origins` and its kin).
    #[derive(Debug, Clone, Default)]
    pub struct CorsConfig {
        /// Browser origins allowed to call the API (CORS); empty: CORS is off. `*`: any origin.
        pub allowed_origins: Vec<String>,
        pub allowed_methods: Vec<String>,
        pub allowed_headers: Vec<String>,
        pub allow_credentials: bool,
    }
}

py_record! {
    /// The state store and the files directory (`--state-store`, `--files-dir`, `--disable-response-store`).
    #[derive(Debug, Clone, Default)]
    pub struct StateConfig {
        /// The state store (`--state-store`): a SQLite path or URL, `memory`, or a PostgreSQL URL; empty: none.
        pub store: String,
        /// Keep Responses that do not say `store: false` (off: `--disable-response-store`).
        pub store_responses: bool,
        /// Where uploaded files' contents are kept (`--files-dir`, a volume the replicas share); empty: no files.
        pub files_dir: String,
    }
}

py_record! {
    /// Image fetching (rust/media): where from (the amounts are `Limits`').
    #[derive(Debug, Clone, Default)]
    pub struct MediaConfig {
        /// Image fetching (rust/media). Hosts images may be fetched from (every redirect hop too); empty: any host.
        /// An entry `*.example.com` matches the subdomains of example.com, not example.com itself.
        pub allowed_media_domains: Vec<String>,
        /// CIDRs fetched from even though not public (the precise way to reach a private image store).
        pub allowed_media_networks: Vec<String>,
        /// Fetch from loopback, private and link-local addresses too; cloud-metadata addresses stay refused.
        pub allow_private_media_urls: bool,
        /// A directory whose files `file://` image URLs may name; `None` refuses `file://`.
        pub allowed_local_media_path: Option<String>,
    }
}

py_record! {
    /// What the worker metadata routes (`/server_info`, `/model_info`) report.
    #[derive(Debug, Clone)]
    pub struct EngineConfig {
        /// What the worker metadata routes (`/server_info`, `/model_info`) report: MODEL as given, the checkpoint's
        /// `model_type`, the engine and its parallel sizes.
        pub model_path: Option<String>,
        pub model_type: Option<String>,
        /// The local checkpoint directory the ranks loaded (MODEL resolved), which a weight reload compares a new
        /// one with; None without MODEL.
        pub model_dir: Option<String>,
        pub engine: String,
        pub expert_parallel_size: u32,
        pub context_parallel_size: u32,
    }
}

impl ServerConfig {
    /// `None` means no per-request limit.
    pub fn request_timeout(&self) -> Option<Duration> {
        (self.limits.request_timeout_s > 0.0).then(|| Duration::from_secs_f64(self.limits.request_timeout_s))
    }

    /// `--dispatch-gather-ms` (0 turns gathering off).
    pub fn gather_window(&self) -> Duration {
        Duration::from_secs_f64(self.dispatch_gather_ms.max(0.0) / 1e3)
    }

    /// The longest a queued request waits for a slot: `--queue-timeout`, else the request timeout, else no limit.
    pub fn queue_timeout(&self) -> Option<Duration> {
        (self.limits.queue_timeout_s > 0.0)
            .then(|| Duration::from_secs_f64(self.limits.queue_timeout_s))
            .or(self.request_timeout())
    }

    /// What a JSON body may make once parsed (`--max-json-elements`, `--max-json-depth`).
    pub fn json_bounds(&self) -> crate::json_bounds::JsonBounds {
        crate::json_bounds::JsonBounds { elements: self.limits.max_json_elements, depth: self.limits.max_json_depth }
    }

    pub fn client_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.limits.client_timeout_s.max(0.001))
    }

    /// `None`: no watchdog.
    pub fn watchdog_timeout(&self) -> Option<Duration> {
        (self.watchdog_timeout_s > 0.0).then(|| Duration::from_secs_f64(self.watchdog_timeout_s))
    }

    pub fn stream_interval(&self) -> Duration {
        Duration::from_secs_f64(self.stream_interval_ms.max(0.0) / 1e3)
    }

    /// Settings for in-process tests.
    pub fn for_tests() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 0,
            served_model_names: vec!["test-model".into()],
            thinking_pins: Default::default(),
            max_model_len: 4096,
            max_num_seqs: 4,
            // Bodies of 1 MiB: the tests' oversized ones stay small.
            limits: crate::limits::Limits {
                max_request_body_bytes: 1 << 20,
                max_batch_line_bytes: 1 << 20,
                ..crate::limits::Limits::DEFAULT
            },
            priority_scheduling: false,
            log_level: "info".into(),
            exit_on_rank_failure_s: crate::timing::EXIT_ON_RANK_FAILURE_S,
            drain_timeout_s: crate::timing::DRAIN_TIMEOUT_S,
            http_workers: 1,
            codec_threads: 1,
            dispatch_gather_ms: 0.0, // the sim's ranks do not step together: off, as the launcher decides
            dispatch_gather_min_tokens: 4096,
            api_key: None,
            log_format: "text".into(),
            openapi: None,
            sse_keep_alive_s: crate::timing::SSE_KEEP_ALIVE_S,
            stream_interval_ms: crate::timing::STREAM_INTERVAL_MS,
            edge: Default::default(),
            console: true,
            cors: Default::default(),
            state: StateConfig { store: String::new(), store_responses: true, files_dir: String::new() },
            media: Default::default(),
            engine: EngineConfig {
                model_path: None,
                model_type: None,
                model_dir: None,
                engine: "sim".into(),
                expert_parallel_size: 1,
                context_parallel_size: 1,
            },
            watchdog_timeout_s: crate::timing::WATCHDOG_TIMEOUT_S,
            otlp_traces: None,
        }
    }
}

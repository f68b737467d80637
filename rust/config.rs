//! Server settings, handed over from the Python launcher as a dict.

use pyo3::FromPyObject;
use std::time::Duration;

#[derive(Debug, Clone, FromPyObject)]
#[pyo3(from_item_all)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    pub served_model_names: Vec<String>,
    /// Served names that pin the thinking mode (`--served-model-name NAME=thinking|no-thinking`): name -> on.
    #[pyo3(default)]
    pub thinking_pins: std::collections::HashMap<String, bool>,
    pub max_model_len: u32,
    pub max_num_seqs: u32,
    pub request_timeout_s: f64,
    pub max_body_bytes: usize,
    /// Most values a JSON body may have, at any depth (`--max-json-elements`, `http::json_bounds`).
    #[pyo3(default = 2_000_000)]
    pub max_json_elements: usize,
    /// Deepest a JSON body may nest (`--max-json-depth`).
    #[pyo3(default = 64)]
    pub max_json_depth: usize,
    /// Longest line of a batch's input file (`--max-batch-line-bytes`; by default `--max-request-body-bytes`).
    #[pyo3(default = 16 << 20)]
    pub max_batch_line_bytes: usize,
    pub log_level: String,
    #[pyo3(default = 3.0)]
    pub exit_on_rank_failure_s: f64,
    #[pyo3(default = 30.0)]
    pub drain_timeout_s: f64,
    #[pyo3(default = 2)]
    pub http_workers: usize,
    #[pyo3(default = 2)]
    pub codec_threads: usize,
    /// How long a long prompt waits after it is encoded for others to go to the ranks with it (`gather`); 0: off.
    #[pyo3(default = 0.0)]
    pub dispatch_gather_ms: f64,
    /// Prompts shorter than this (tokens) never wait.
    #[pyo3(default = 4096)]
    pub dispatch_gather_min_tokens: usize,
    #[pyo3(default)]
    pub api_key: Option<String>,
    #[pyo3(default = "text".to_string())]
    pub log_format: String,
    /// Longest silence on an SSE stream before a keep-alive comment.
    #[pyo3(default = 15.0)]
    pub sse_keep_alive_s: f64,
    /// Shortest gap between two token events of one stream: tokens that arrive sooner wait and leave together.
    /// Below an engine's step time it never delays a token; it bounds a fast engine's event rate per stream.
    #[pyo3(default = 0.0)]
    pub stream_interval_ms: f64,
    /// Browser origins allowed to call the API (CORS); empty: CORS is off. `*`: any origin.
    #[pyo3(default)]
    pub allowed_origins: Vec<String>,
    #[pyo3(default)]
    pub allowed_methods: Vec<String>,
    #[pyo3(default)]
    pub allowed_headers: Vec<String>,
    #[pyo3(default)]
    pub allow_credentials: bool,
    /// Where and how clients connect: TLS, a Unix socket, a path prefix (`rust/edge/`).
    #[pyo3(default)]
    pub edge: crate::edge::EdgeConfig,
    /// Longest a client may take to send a request head (or leave a keep-alive connection idle), to send a body
    /// (in all), and to take a share of a response it is sent (`listener::WRITE_PROGRESS` bytes).
    #[pyo3(default = 30.0)]
    pub client_timeout_s: f64,
    /// The state store (`--state-store`): a SQLite path or URL, `memory`, or a PostgreSQL URL; empty: none.
    #[pyo3(default)]
    pub state_store: String,
    /// Keep Responses that do not say `store: false` (off: `--disable-response-store`).
    #[pyo3(default = true)]
    pub store_responses: bool,
    /// How long a stored response is kept (`--response-store-ttl`); 0: for ever.
    #[pyo3(default = 2_592_000.0)]
    pub response_store_ttl_s: f64,
    /// Most bytes stored responses and conversations may hold (`--state-store-max-bytes`); past it the oldest go.
    /// 0: no cap.
    #[pyo3(default = 10 << 30)]
    pub state_store_max_bytes: u64,
    /// Most bytes one owner's (API key's) responses and conversations may hold (`--state-store-max-bytes-per-
    /// owner`); past it its stored requests are a 429. 0: the cap shared evenly by the keys (all of it with one).
    #[pyo3(default = 0)]
    pub state_store_max_bytes_per_owner: u64,
    /// Largest stored item (`--state-store-max-item-bytes`): a larger input item, as stored, is a 400.
    #[pyo3(default = 16 << 20)]
    pub state_store_max_item_bytes: u64,
    /// Most bytes a `previous_response_id` chain or a conversation may hold for a request to continue it
    /// (`--state-store-max-chain-bytes`): past it the request is a 400 naming the parameter.
    #[pyo3(default = 64 << 20)]
    pub state_store_max_chain_bytes: u64,
    /// Where uploaded files' contents are kept (`--files-dir`, a volume the replicas share); empty: no files.
    #[pyo3(default)]
    pub files_dir: String,
    /// The largest file one upload may hold (`--max-file-bytes`).
    #[pyo3(default = 512 << 20)]
    pub max_file_bytes: u64,
    /// Most bytes all stored files may hold together (`--files-max-total-bytes`); 0: no cap.
    #[pyo3(default = 100 << 30)]
    pub files_max_total_bytes: u64,
    /// Background responses queued or running on this replica (`--max-background-runs`); past it a 429.
    #[pyo3(default = 512)]
    pub max_background_runs: usize,
    /// Of those, how many one owner (API key) may have (`--max-background-runs-per-owner`).
    #[pyo3(default = 64)]
    pub max_background_runs_per_owner: usize,
    /// What background runs keep of their streams for replay, all together (`--background-replay-bytes`).
    #[pyo3(default = 64 << 20)]
    pub background_replay_bytes: usize,
    /// How long a claim on a batch or a background response holds without renewal (`--claim-lease`).
    #[pyo3(default = 15)]
    pub claim_lease_s: i64,
    /// Most bytes one owner's files (batch results included) may hold (`--files-max-bytes-per-owner`); 0: the
    /// files total shared evenly by the keys (all of it with one).
    #[pyo3(default = 0)]
    pub files_max_bytes_per_owner: u64,
    /// Longest a file upload's body may take to arrive (`--upload-timeout`).
    #[pyo3(default = 600.0)]
    pub upload_timeout_s: f64,
    /// Client connections open at once (`--max-connections`); 0: no limit.
    #[pyo3(default = 0)]
    pub max_connections: usize,
    /// Bytes of one response held for a client that reads slower than they are made (`--max-stream-buffer-bytes`).
    #[pyo3(default = 1 << 20)]
    pub max_stream_buffer_bytes: usize,
    /// Seconds a rank with requests in flight may go without a heartbeat before the server declares it hung,
    /// kills every rank and exits non-zero; 0 disables the watchdog.
    #[pyo3(default = 300.0)]
    pub watchdog_timeout_s: f64,
    /// Whether the wait queue honours a request's `priority` (`--scheduling-policy priority`); else first come,
    /// first served, whatever a client asks.
    #[pyo3(default)]
    pub priority_scheduling: bool,
    /// Requests that may wait for a slot when all are taken; 0 refuses them with 429 at once.
    #[pyo3(default = 0)]
    pub max_queued_requests: usize,
    /// Longest wait in that queue before a 429; 0 leaves only the request timeout to bound it.
    #[pyo3(default = 0.0)]
    pub queue_timeout_s: f64,
    /// The OpenAPI document served at /openapi.json (read at start-up).
    #[pyo3(default)]
    pub openapi: Option<String>,
    /// What the worker metadata routes (`/server_info`, `/model_info`) report: MODEL as given, the checkpoint's
    /// `model_type`, the engine and its parallel sizes.
    #[pyo3(default)]
    pub model_path: Option<String>,
    #[pyo3(default)]
    pub model_type: Option<String>,
    #[pyo3(default = "sim".to_string())]
    pub engine: String,
    #[pyo3(default = 1)]
    pub expert_parallel_size: u32,
    #[pyo3(default = 1)]
    pub context_parallel_size: u32,
    /// Image fetching (rust/media). Hosts images may be fetched from (every redirect hop too); empty: any host.
    /// An entry `*.example.com` matches the subdomains of example.com, not example.com itself.
    #[pyo3(default)]
    pub allowed_media_domains: Vec<String>,
    /// CIDRs fetched from even though not public (the precise way to reach a private image store).
    #[pyo3(default)]
    pub allowed_media_networks: Vec<String>,
    /// Fetch from loopback, private and link-local addresses too; cloud-metadata addresses stay refused.
    #[pyo3(default)]
    pub allow_private_media_urls: bool,
    /// A directory whose files `file://` image URLs may name; `None` refuses `file://`.
    #[pyo3(default)]
    pub allowed_local_media_path: Option<String>,
    /// Longest the image fetches of one request may take together.
    #[pyo3(default = 10.0)]
    pub media_fetch_timeout_s: f64,
    /// 0 refuses every image.
    #[pyo3(default = 8)]
    pub max_images_per_request: usize,
    /// Largest encoded image, fetched or inline.
    #[pyo3(default = 20 << 20)]
    pub max_image_bytes: usize,
    /// Largest sum of a request's encoded images.
    #[pyo3(default = 50 << 20)]
    pub max_image_total_bytes: usize,
    /// Where to export OpenTelemetry traces (`--otlp-traces-endpoint` or the `OTEL_EXPORTER_OTLP_*` variables, as
    /// the launcher resolved them); None: tracing is off and costs nothing.
    #[pyo3(default)]
    pub otlp_traces_endpoint: Option<String>,
    /// `http/protobuf` or `grpc`.
    #[pyo3(default = "http/protobuf".to_string())]
    pub otlp_traces_protocol: String,
}

impl ServerConfig {
    /// `None` means no per-request limit.
    pub fn request_timeout(&self) -> Option<Duration> {
        (self.request_timeout_s > 0.0).then(|| Duration::from_secs_f64(self.request_timeout_s))
    }

    /// `--dispatch-gather-ms` (0 turns gathering off).
    pub fn gather_window(&self) -> Duration {
        Duration::from_secs_f64(self.dispatch_gather_ms.max(0.0) / 1e3)
    }

    /// The longest a queued request waits for a slot: `--queue-timeout`, else the request timeout, else no limit.
    pub fn queue_timeout(&self) -> Option<Duration> {
        (self.queue_timeout_s > 0.0).then(|| Duration::from_secs_f64(self.queue_timeout_s)).or(self.request_timeout())
    }

    /// What a JSON body may make once parsed (`--max-json-elements`, `--max-json-depth`).
    pub fn json_bounds(&self) -> crate::json_bounds::JsonBounds {
        crate::json_bounds::JsonBounds { elements: self.max_json_elements, depth: self.max_json_depth }
    }

    pub fn client_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.client_timeout_s.max(0.001))
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
            request_timeout_s: 0.0,
            max_queued_requests: 0,
            priority_scheduling: false,
            queue_timeout_s: 0.0,
            max_body_bytes: 1 << 20,
            max_json_elements: 2_000_000,
            max_json_depth: 64,
            max_batch_line_bytes: 1 << 20,
            log_level: "info".into(),
            exit_on_rank_failure_s: 3.0,
            drain_timeout_s: 5.0,
            http_workers: 1,
            codec_threads: 1,
            dispatch_gather_ms: 0.0,
            dispatch_gather_min_tokens: 4096,
            api_key: None,
            log_format: "text".into(),
            openapi: None,
            sse_keep_alive_s: 15.0,
            stream_interval_ms: 0.0,
            client_timeout_s: 30.0,
            max_connections: 0,
            state_store: String::new(),
            store_responses: true,
            response_store_ttl_s: 2_592_000.0,
            state_store_max_bytes: 10 << 30,
            state_store_max_bytes_per_owner: 0,
            state_store_max_item_bytes: 16 << 20,
            state_store_max_chain_bytes: 64 << 20,
            files_dir: String::new(),
            max_file_bytes: 512 << 20,
            files_max_total_bytes: 100 << 30,
            max_background_runs: 512,
            max_background_runs_per_owner: 64,
            background_replay_bytes: 64 << 20,
            claim_lease_s: 15,
            files_max_bytes_per_owner: 0,
            upload_timeout_s: 600.0,
            allowed_origins: Vec::new(),
            allowed_methods: Vec::new(),
            allowed_headers: Vec::new(),
            allow_credentials: false,
            edge: Default::default(),
            max_stream_buffer_bytes: 1 << 20,
            model_path: None,
            model_type: None,
            engine: "sim".into(),
            expert_parallel_size: 1,
            context_parallel_size: 1,
            watchdog_timeout_s: 300.0,
            allowed_media_domains: Vec::new(),
            allowed_media_networks: Vec::new(),
            allow_private_media_urls: false,
            allowed_local_media_path: None,
            media_fetch_timeout_s: 10.0,
            max_images_per_request: 8,
            max_image_bytes: 20 << 20,
            max_image_total_bytes: 50 << 20,
            otlp_traces_endpoint: None,
            otlp_traces_protocol: "http/protobuf".into(),
        }
    }
}

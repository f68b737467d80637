//! Every limit of the server, declared once: what one client, request or upload may cost, with its default, its
//! flag (settable limits) or none (fixed limits), its unit and its help. From this table come `Limits` (the
//! launcher's values, `ServerConfig::limits`), its defaults (the flags' and the tests'), the fixed limits'
//! constants, and `_native.LIMITS`, from which Python builds the flags and a test checks the README's options
//! table. Names: `max_*` / `MAX_*` for a most, `*_s` for seconds. A leaf: it imports nothing of the crate.

mod declare;

pub use declare::register;
use declare::{Limit, Unit, help, limits};

limits! {
    settable {
        /// Largest request body; a larger one gets 413.
        max_request_body_bytes: usize = 16 << 20, "--max-request-body-bytes", Bytes, limits;
        /// Most values a JSON request body (or a batch line) may hold, at any depth, unknown keys included; past it
        /// a 413, decided in one pass over the bytes before anything is built from them. The default is more than
        /// any body of real requests within 16 MiB holds (a Message Batch of 100,000 two-turn requests is about 1.3
        /// million) and refuses a body of millions of bare values, which costs 50 bytes each to hold.
        max_json_elements: usize = 2_000_000, "--max-json-elements", Count, limits;
        /// Deepest a JSON request body (or a batch line) may nest, at most 127 (the parser's own limit is 128);
        /// deeper is a 400. Tool schemas and transcripts nest a dozen levels.
        max_json_depth: usize = 64, "--max-json-depth", Count, limits;
        /// Longest line of a batch's input file (a line is one request). A purpose=batch upload with a longer line
        /// is a 400 naming it, as is a batch created on such a file; the runner never reads more of one line.
        /// Default: --max-request-body-bytes, as one request's body is bounded when it is sent alone.
        max_batch_line_bytes: usize = 16 << 20, "--max-batch-line-bytes", Bytes, limits,
            derived "--max-request-body-bytes";
        /// Seconds a client has to send a request's headers, and again its body (each a total deadline, not reset
        /// by every byte: 408 for a body), to leave a keep-alive connection idle, and to take 16 KiB of a response
        /// it is being sent; past it the connection is closed.
        client_timeout_s: f64 = 30.0, "--client-timeout", Seconds, limits;
        /// Client connections open at once; past it new ones wait in the listen backlog until one closes. Default:
        /// the open-file limit (raised to its hard limit at start) less 256 kept for the server's own files.
        max_connections: usize = 0, "--max-connections", Count, limits, derived "the open-file limit less 256";
        /// Bytes of one response the server holds for a client that reads slower than they are made; a client
        /// further behind is disconnected and its request aborted. Bounds what a slow reader can hold, whatever
        /// its max_tokens and top_logprobs.
        max_stream_buffer_bytes: usize = 1 << 20, "--max-stream-buffer-bytes", Bytes, limits;
        /// Largest grammar (JSON schema, regex, or the tool-call grammar the server writes) handed to the engine
        /// for one request; a larger one is a 400 naming the field, decided before any work on it.
        max_grammar_bytes: usize = 256 << 10, "--max-grammar-bytes", Bytes, limits;
        /// CPU time building a request's grammar, and again checking it, may take; past it the request is a 400
        /// naming the field. Grammars are built and checked on a thread of their own, never the codec's.
        grammar_cpu_s: f64 = 0.5, "--grammar-cpu-seconds", Seconds, limits;
        /// Memory for checked grammars, reused by requests that send the same schema or tools (LRU).
        max_grammar_cache_bytes: usize = 32 << 20, "--grammar-cache-bytes", Bytes, limits;
        /// Seconds per request; 0 = no limit.
        request_timeout_s: f64 = 0.0, "--request-timeout", Seconds, limits;
        /// Requests that may wait for a slot when all DP x --max-num-seqs are taken, admitted FIFO within their
        /// 'priority' (lower first). A full queue answers 429 with Retry-After. 0 (the default) answers 429 at
        /// once, with no queue.
        max_queued_requests: usize = 0, "--max-queued-requests", Count, limits;
        /// Sequences one request may ask for (/generate: its prompts x sampling_params.n; Chat and Completions:
        /// n), each run as a request of its own (its own slot, through the wait queue); more is a 400 naming n.
        max_generate_fanout: usize = 4096, "--max-generate-fanout", Count, limits;
        /// Bytes the sequences of one request may hold together, each prompt and its sampling parameters counted
        /// once per sample (what the server copies for them); more is a 400 naming the prompt field (or n).
        max_generate_fanout_bytes: usize = 64 << 20, "--max-generate-fanout-bytes", Bytes, limits;
        /// Longest a queued request waits for a slot before a 429 with Retry-After; 0 leaves only --request-timeout
        /// to bound the wait.
        queue_timeout_s: f64 = 0.0, "--queue-timeout", Seconds, limits;

        /// Seconds all the image fetches of one request may take (or less, by --request-timeout); a timeout is a
        /// 400 the client may retry.
        media_fetch_timeout_s: f64 = 10.0, "--media-fetch-timeout", Seconds, media;
        /// Images (URLs, data: URLs and base64 blocks) one request may carry; 0 refuses every image.
        max_images_per_request: usize = 8, "--max-images-per-request", Count, media;
        /// Largest encoded image, fetched or inline; a larger one is refused before or while reading it.
        max_image_bytes: usize = 20 << 20, "--max-image-bytes", Bytes, media;
        /// Largest sum of one request's encoded images.
        max_image_total_bytes: usize = 50 << 20, "--max-image-total-bytes", Bytes, media;

        /// How long a stored response is kept (OpenAI keeps them 30 days, the default); older ones are removed
        /// every 10 minutes. 0: kept until deleted.
        response_store_ttl_s: f64 = 2_592_000.0, "--response-store-ttl", Seconds, state;
        /// Most bytes stored responses and conversations may hold together; past it a request that would store
        /// more is a 429 (storage_quota_exceeded): nothing stored is removed to make room. 0: no cap.
        max_state_store_bytes: u64 = 10 << 30, "--state-store-max-bytes", Bytes, state;
        /// Most bytes one owner (an API key of --api-key-file; every client, without keys) may keep in stored
        /// responses and conversations; past it its requests that would store more are a 429, and other owners'
        /// records are never removed for it. 0 (the default): --state-store-max-bytes split evenly between the
        /// keys.
        max_state_store_bytes_per_owner: u64 = 0, "--state-store-max-bytes-per-owner", Bytes, state;
        /// Largest input item a stored request may hold, as stored (what the prompt does not read, such as a
        /// reasoning item's summary or unknown keys, is not stored); larger is a 400 naming it.
        max_state_store_item_bytes: u64 = 16 << 20, "--state-store-max-item-bytes", Bytes, state;
        /// Most bytes of stored items a request may continue from (a previous_response_id chain, or a
        /// conversation); past it the request is a 400 naming the parameter, refused before the items are read.
        /// Far past any model's context by default.
        max_state_store_chain_bytes: u64 = 64 << 20, "--state-store-max-chain-bytes", Bytes, state;
        /// The largest file one upload may hold (OpenAI's limit, 512 MiB, by default); larger is a 413.
        max_file_bytes: u64 = 512 << 20, "--max-file-bytes", Bytes, state;
        /// Most bytes all uploaded files may hold together (0: no cap). An upload that would pass it is a 413 that
        /// says how much is stored; delete files, or let them expire, to make room. Batch results count too: a
        /// batch whose results would pass it takes no more lines and ends 'failed'.
        max_files_total_bytes: u64 = 100 << 30, "--files-max-total-bytes", Bytes, state;
        /// Most bytes one owner's files (an API key's; batch results included) may hold; past it an upload is a
        /// 413. 0 (the default): --files-max-total-bytes split evenly between the keys.
        max_files_bytes_per_owner: u64 = 0, "--files-max-bytes-per-owner", Bytes, state;
        /// Background responses queued or running on this replica; past it a 429 'background_queue_full'.
        max_background_runs: usize = 512, "--max-background-runs", Count, state;
        /// Of those, how many one API key may have; past it a 429 'background_runs_per_owner_exceeded'. Without
        /// API keys every client is one owner, capped by --max-background-runs only.
        max_background_runs_per_owner: usize = 64, "--max-background-runs-per-owner", Count, state;
        /// What background runs keep of their streams for GET ?stream=true: each run its latest BYTES /
        /// --max-background-runs (at least 64 KiB), ended runs at most BYTES together, oldest dropped first.
        max_background_replay_bytes: usize = 64 << 20, "--background-replay-bytes", Bytes, state;
        /// Longest a file upload's body may take to arrive (other bodies have --client-timeout).
        upload_timeout_s: f64 = 600.0, "--upload-timeout", Seconds, state;
        /// How long a replica's claim on a batch or a background response holds without renewal (renewed every
        /// second or two): past it, another replica takes the work over. Shorter takes over a dead replica's work
        /// sooner; longer tolerates longer pauses (a stalled host, a store outage) before the work moves.
        claim_lease_s: i64 = 15, "--claim-lease", Seconds, state;
    }
    fixed {
        /// Headers per request; more is a 431 in the door's envelope (`http::head_limits`).
        MAX_HEADERS: usize = 100, Count;
        /// Bytes of request line and headers; more is a 431 in the door's envelope.
        MAX_HEAD_BYTES: usize = 64 << 10, Bytes;
        /// hyper's own bound on a request's headers, well above the two above (past it hyper answers a bare 431).
        MAX_HYPER_HEADERS: usize = 4 * MAX_HEADERS, Count;
        /// hyper's bound on a request head's bytes.
        MAX_HYPER_HEAD_BYTES: usize = 400 << 10, Bytes;
        /// Bytes a client must take within --client-timeout while the server has output waiting for it.
        MIN_WRITE_PROGRESS_BYTES: usize = 16 << 10, Bytes;
        /// Most bytes of a refused request's body read to keep its connection (a chat request with a long prompt
        /// fits).
        MAX_DRAIN_BYTES: u64 = 64 << 10, Bytes;
        /// Most seconds a connection we close goes on reading, and dropping, what its client still sends: a body
        /// refused before it was read is still arriving, and closing on unread bytes resets the connection, which
        /// can destroy the answer before the client reads it (RFC 9112 §9.6, nginx's lingering_close).
        MAX_LINGER_S: f64 = 2.0, Seconds;
        /// Of that, how long a client that sends nothing is waited for (one that has stopped: close at once).
        MAX_LINGER_QUIET_S: f64 = 0.25, Seconds;
        /// A JSON body this small is checked against the JSON bounds on the runtime thread; larger, on a blocking
        /// one (16 MiB takes some milliseconds).
        MAX_INLINE_CHECK_BYTES: usize = 256 << 10, Bytes;
        /// Most choices (`n`) one Chat Completions or Completions request may ask for, OpenAI's bound; each is
        /// sampled as a request of its own, within --max-generate-fanout and --max-generate-fanout-bytes.
        MAX_CHOICES: usize = 128, Count;
        /// Most parts an upload's form may have: nothing but the file is large.
        MAX_FORM_PARTS: usize = 8, Count;
        /// Longest `rid` of `/abort_request` and weight version of `/update_weight_version`; longer is a 400 (a
        /// request id from `X-Request-Id` has at most 128).
        MAX_CONTROL_ID_BYTES: usize = 256, Bytes;
        /// Longest `model_path` of `/update_weights_from_disk` (Linux's PATH_MAX); longer is a 400.
        MAX_MODEL_PATH_BYTES: usize = 4096, Bytes;
        /// The longest text part of an upload's form.
        MAX_FORM_TEXT_BYTES: usize = 1024, Bytes;
        /// What may come before a form's first boundary: clients send nothing there (RFC 7578's preamble is for
        /// mail).
        MAX_FORM_PREAMBLE_BYTES: usize = 1 << 10, Bytes;
        /// A form part's boundary line and headers (its name, file name and type: a few hundred bytes).
        MAX_FORM_PART_HEAD_BYTES: usize = 8 << 10, Bytes;
        /// Longest uploaded file name kept, in characters.
        MAX_FILE_NAME_CHARS: usize = 255, Count;
        /// A page of files (OpenAI's limit), all by default.
        MAX_FILES_PAGE: usize = 10_000, Count;
        /// A page of batches (OpenAI's limit).
        MAX_BATCHES_PAGE: usize = 100, Count;
        /// A page of Message Batches (Anthropic's limit).
        MAX_MESSAGE_BATCHES_PAGE: usize = 1000, Count;
        /// Most items one page of a response's `input_items` holds (OpenAI's limit).
        MAX_INPUT_ITEMS_PAGE: usize = 100, Count;
        /// Most lines one batch runs: OpenAI's limit.
        MAX_BATCH_LINES: usize = 50_000, Count;
        /// Most requests one Message Batch holds (Anthropic's limit).
        MAX_MESSAGE_BATCH_LINES: usize = 100_000, Count;
        /// Most items one request adds to a conversation (OpenAI's limit).
        MAX_CONVERSATION_ADD_ITEMS: usize = 20, Count;
        /// Most items a conversation holds: one that would grow past it takes no more (a 400 for who adds).
        MAX_CONVERSATION_ITEMS: i64 = 10_000, Count;
        /// Longest `previous_response_id` chain walked: far past any session, short of a walk that never ends.
        MAX_CHAIN_DEPTH: i64 = 100_000, Count;
        /// Most messages one chat request may carry (a conversation this long is a mistake or an attack).
        MAX_MESSAGES: usize = 4096, Count;
        /// Most output tokens a request may ask for (deepseek-recipe's bound on max_tokens).
        MAX_OUTPUT_TOKENS: u64 = 393_216, Count;
        /// Most logprob alternatives per token a request may ask for (OpenAI's limit, and deepseek-recipe's).
        MAX_TOP_LOGPROBS: i64 = 20, Count;
        /// Most stop strings of a request (deepseek-recipe's limit).
        MAX_STOP_SEQUENCES: usize = 16, Count;
        /// Redirects an image fetch follows.
        MAX_MEDIA_REDIRECTS: usize = 5, Count;
        /// Longest client string echoed in an error message or a log line (a model name, a path).
        MAX_ECHO_BYTES: usize = 256, Bytes;
        /// Longest message of an error envelope (the codec's may quote a request at length).
        MAX_ERROR_MESSAGE_BYTES: usize = 1024, Bytes;
        /// The least of a stream a background run keeps for replay, whatever --background-replay-bytes leaves it
        /// (a short answer whole).
        MIN_REPLAY_WINDOW_BYTES: usize = 64 << 10, Bytes;
        /// Bytes of rank output drained per wake-up; bounds the latency of the first request in a huge backlog.
        MAX_RANK_DRAIN_BYTES: usize = 1 << 20, Bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_one_style() {
        pyo3::Python::initialize();
        pyo3::Python::attach(|py| {
            for l in declared(py).unwrap() {
                let upper = l.name.to_uppercase();
                let settable = l.flag.is_some();
                assert_eq!(l.name == upper, !settable, "{}: fields are snake case, constants upper", l.name);
                assert!(!upper.contains("_MAX"), "{}: a most is MAX_X, not X_MAX", l.name);
                assert!(!l.help.is_empty(), "{}", l.name);
            }
        });
    }
}

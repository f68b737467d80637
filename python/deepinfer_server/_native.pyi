"""Type stubs for the Rust extension `deepinfer_server._native` (rust/lib.rs)."""

from collections.abc import Callable, Sequence
from os import PathLike
from typing import Any, final

from deepinfer_server.decoding import Decoder

KIND_SUBMIT: int
KIND_ABORT: int
KIND_SHUTDOWN: int
KIND_RELOAD: int
KIND_TOKENS: int
KIND_TIMING: int
FINISH_NONE: int
FINISH_STOP: int
FINISH_LENGTH: int
FINISH_ABORT: int
FINISH_ERROR: int
SCHEMA_JSON: int
SCHEMA_REGEX: int
SCHEMA_EBNF: int
AUX_STATE: int
AUX_REQUESTS: int
AUX_QUEUED_TOKENS: int
AUX_HEARTBEAT_MS: int
AUX_KV_USAGE_PPM: int
AUX_KV_CAPACITY_TOKENS: int
AUX_PHASE: int
AUX_SPEC_DRAFT_TOKENS: int
AUX_SPEC_ACCEPTED_TOKENS: int
AUX_PREEMPTIONS: int
AUX_REABORTS: int
AUX_RELOADS: int
RELOAD_OK: int
RELOAD_FAILED: int
PHASE_STARTING: int
PHASE_IDLE: int
PHASE_ADD: int
PHASE_SYNC: int
PHASE_STEP: int
PHASE_FLUSH: int
PHASE_PUBLISH: int
PHASE_CLOSE: int
PHASE_RELOAD: int
STATE_STARTING: int
STATE_LOADING: int
STATE_READY: int
STATE_FAILED: int
STATE_STOPPED: int
# Each door's protocol code (rust/doors/, `Spec::CODE`).
DOOR_CHAT: int
DOOR_COMPLETIONS: int
DOOR_MESSAGES: int
DOOR_RESPONSES: int
DOOR_GENERATE: int
# What `decode_batch` says of each request (rust/codec/decode.rs, `DecodeState`).
DECODE_RUNNING: int
DECODE_FINISHED: int
DECODE_STOPPED_EARLY: int

class RingClosed(Exception): ...
class RingError(Exception): ...

# One token's logprob and its alternatives (token id, logprob), best first.
TokenLogprob = tuple[float, Sequence[tuple[int, float]]]

# What Rust asks the codec (rust/codec/seam.rs).
@final
class PrepareInput:
    """`Codec.prepare`'s request: its door (`DOOR_*`) and body, and what the front end decided about it."""

    def __new__(
        cls,
        *,
        door: int,
        body: bytes,
        response_id: str,
        model: str,
        ignore_eos: bool = False,
        include_usage: bool = False,
        continuous_usage: bool = False,
        forced_tool: str | None = None,
        parallel_tools: bool = True,
        images: dict[str, bytes] | None = None,
    ) -> PrepareInput: ...
    @property
    def door(self) -> int: ...
    @property
    def body(self) -> bytes: ...
    @property
    def response_id(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def include_usage(self) -> bool: ...
    @property
    def continuous_usage(self) -> bool: ...
    @property
    def forced_tool(self) -> str | None:
        """A tool choice that forces a call: "" any tool, else its name (Rust checked it names one)."""
    @property
    def parallel_tools(self) -> bool: ...
    @property
    def images(self) -> dict[str, bytes] | None:
        """The image URLs the front end fetched, and their bytes."""

@final
class ConstraintInput:
    """`Codec.check_constraint`'s request: its door, body and forced tool choice (as in `PrepareInput`)."""

    def __new__(
        cls, *, door: int, body: bytes, forced_tool: str | None = None, parallel_tools: bool = True
    ) -> ConstraintInput: ...
    @property
    def door(self) -> int: ...
    @property
    def body(self) -> bytes: ...
    @property
    def forced_tool(self) -> str | None: ...
    @property
    def parallel_tools(self) -> bool: ...

@final
class CallInput:
    """The request of the codec's other calls (`Codec.tokenize`, `detokenize`, `count_tokens`): its door, its body,
    and the images the front end fetched for it."""

    def __new__(cls, *, door: int, body: bytes, images: dict[str, bytes] | None = None) -> CallInput: ...
    @property
    def door(self) -> int: ...
    @property
    def body(self) -> bytes: ...
    @property
    def images(self) -> dict[str, bytes] | None: ...

@final
class DecodeBatch:
    """A decode batch (rust/codec/decode.rs), a column per field and a row per request: Rust builds one per batch,
    and `decode_batch` sets its answers (`states`, `outputs`) on it, a row per request."""

    def __new__(
        cls,
        *,
        decoders: Sequence[Decoder],
        tokens: Sequence[Sequence[int]],
        finishes: Sequence[int],
        logprobs: Sequence[Sequence[TokenLogprob] | None] | None = None,
        prompt_logprobs: Sequence[Sequence[float] | None] | None = None,
    ) -> DecodeBatch: ...
    def __len__(self) -> int: ...
    @property
    def decoders(self) -> list[Decoder]: ...
    @property
    def tokens(self) -> list[list[int]]: ...
    @property
    def finishes(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[list[tuple[float, list[tuple[int, float]]]] | None]: ...
    @property
    def prompt_logprobs(self) -> list[list[float] | None]: ...
    @property
    def states(self) -> list[int] | None:
        """Each request's state (`DECODE_*`); None until `decode_batch` sets them."""
    @states.setter
    def states(self, value: Sequence[int]) -> None: ...
    @property
    def outputs(self) -> list[list[str] | str] | None:
        """Each request's output: a stream's events, or a non-stream's whole body; None until set."""
    @outputs.setter
    def outputs(self, value: list[list[str] | str]) -> None: ...

# What the codec hands back to Rust (rust/codec/seam.rs).
@final
class Prepared:
    """A request converted and encoded, with its decoder."""

    def __new__(
        cls,
        *,
        prompt_ids: Sequence[int],
        max_tokens: int,
        temperature: float,
        top_p: float,
        decoder: Decoder,
        first_chunks: Sequence[str],
        incremental: bool,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        constraint: SubmitConstraint | None = None,
        images: SubmitImages | None = None,
    ) -> Prepared: ...
    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def decoder(self) -> Decoder: ...
    @property
    def first_chunks(self) -> list[str]: ...
    @property
    def incremental(self) -> bool: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def prompt_logprobs(self) -> bool: ...
    @property
    def constraint(self) -> SubmitConstraint | None: ...
    @property
    def images(self) -> SubmitImages | None: ...

@final
class Refusal:
    """A request the codec will not run: its HTTP status and error envelope (OpenAI's)."""

    def __new__(cls, status: int, body: str) -> Refusal: ...
    @property
    def status(self) -> int: ...
    @property
    def body(self) -> str: ...

# What a rank reads from its request ring (rust/ring/py/requests.rs).
@final
class Submit:
    """A generation request."""

    @property
    def request_id(self) -> int: ...
    @property
    def prompt(self) -> list[int]: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def prompt_logprobs(self) -> bool: ...
    @property
    def constraint(self) -> SubmitConstraint | None: ...
    @property
    def images(self) -> SubmitImages | None: ...

# What Python pushes onto a request ring (rust/ring/py/submit_input.rs). The grammar and image records are also
# what the codec's `Prepared` carries and what a rank reads back from a `Submit`.
@final
class SubmitConstraint:
    """A request's grammar as a rank enforces it."""

    def __new__(
        cls, *, schema_type: int, schema: str, triggers: Sequence[int], bound: int | None
    ) -> SubmitConstraint: ...
    @property
    def schema_type(self) -> int:
        """`SCHEMA_*`."""
    @property
    def schema(self) -> str: ...
    @property
    def triggers(self) -> list[int]: ...
    @property
    def bound(self) -> int | None: ...

@final
class SubmitImages:
    """A request's images as a rank reads them: their file, the prompt tokens beyond the placeholders, and each
    image's (width, height, bytes)."""

    def __new__(cls, *, path: str, extra_tokens: int, sizes: Sequence[Sequence[int]]) -> SubmitImages: ...
    @property
    def path(self) -> str: ...
    @property
    def extra_tokens(self) -> int: ...
    @property
    def sizes(self) -> list[list[int]]: ...

@final
class SubmitInput:
    """A generation request as Python pushes it (`Ring.push_submit`); a rank reads it back as a `Submit`."""

    def __new__(
        cls,
        *,
        request_id: int,
        prompt: bytes | Sequence[int],
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = ...,
        seed: int | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        constraint: SubmitConstraint | None = None,
        images: SubmitImages | None = None,
    ) -> SubmitInput: ...
    @property
    def request_id(self) -> int: ...
    @property
    def prompt(self) -> list[int]: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def prompt_logprobs(self) -> bool: ...
    @property
    def constraint(self) -> SubmitConstraint | None: ...
    @property
    def images(self) -> SubmitImages | None: ...

@final
class Abort:
    """Stop generating a request."""

    @property
    def request_id(self) -> int: ...

@final
class Reload:
    """Load the checkpoint in this directory in place of the one served (the server has drained the rank first)."""

    @property
    def model_path(self) -> str: ...

@final
class Shutdown:
    """Finish what is running and exit."""

# What a rank publishes on its output ring, and reads back (rust/ring/py/entries.rs).
@final
class Output:
    """One request's part of an engine step: new tokens (a token id or a sequence), finish code (`FINISH_*`), the
    reason of an error finish, the tokens' logprobs (one per token) and the prompt's (once, with its first token)."""

    def __new__(
        cls,
        *,
        request_id: int,
        tokens: Sequence[int] | int,
        finish: int,
        reason: str | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
        prompt_logprobs: Sequence[float] | None = None,
    ) -> Output: ...
    @property
    def request_id(self) -> int: ...
    @property
    def tokens(self) -> list[int]: ...
    @property
    def finish(self) -> int: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def logprobs(self) -> list[tuple[float, list[tuple[int, float]]]] | None: ...
    @property
    def prompt_logprobs(self) -> list[float] | None: ...

@final
class StepOutputs:
    """An engine step's plain rows as columns, one record per step (rust/ring/py/step.rs): row i is request
    `request_ids[i]`'s new tokens `tokens[i]` (a token id or a sequence) and finish code `finishes[i]` (`FINISH_NONE`,
    `_STOP`, `_LENGTH` or `_ABORT`: an error finish has a reason, so it is an `Output`). Checked when built: columns
    of equal lengths, ints, known finish codes (TypeError / ValueError naming the column and the row)."""

    def __new__(
        cls, *, request_ids: Sequence[int], tokens: Sequence[Sequence[int] | int], finishes: Sequence[int]
    ) -> StepOutputs: ...
    @property
    def request_ids(self) -> list[int]: ...
    @property
    def tokens(self) -> list[list[int]]: ...
    @property
    def finishes(self) -> list[int]: ...
    def __len__(self) -> int: ...
    def outputs(self) -> list[Output]: ...

@final
class Ring:
    """A single-producer single-consumer shared-memory ring of records in /dev/shm."""

    @staticmethod
    def create(path: str | PathLike[str], capacity: int) -> Ring: ...
    @staticmethod
    def open(path: str | PathLike[str]) -> Ring: ...
    @staticmethod
    def unlink(path: str | PathLike[str]) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def capacity(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    def aux(self, i: int) -> int: ...
    def set_aux(self, i: int, v: int) -> None: ...
    def wait(self, timeout: float | None = None) -> bool: ...
    def wait_drained(self, max_used: int, timeout: float | None = None) -> bool: ...
    def push_submit(self, submit: SubmitInput, timeout: float | None = None) -> None: ...
    def push_abort(self, request_id: int, timeout: float | None = None) -> None: ...
    def push_shutdown(self, timeout: float | None = None) -> None: ...
    def push_reload(self, model_path: str, timeout: float | None = None) -> None: ...
    def drain_requests(self, max_bytes: int = ...) -> list[Submit | Abort | Shutdown | Reload]: ...
    def publish(
        self,
        entries: Sequence[Output | StepOutputs],
        timeout: float | None = None,
        wake: bool = True,
        timings: Sequence[tuple[int, float, float]] | None = None,
    ) -> int: ...
    def wake_consumer(self) -> None: ...
    def drain_tokens(self, max_bytes: int = ...) -> list[Output]: ...

@final
class Lockstep:
    """A cross-process barrier: simulated DP ranks step together, each step as long as the slowest rank's."""

    @staticmethod
    def create(path: str | PathLike[str], parties: int) -> Lockstep: ...
    @staticmethod
    def open(path: str | PathLike[str]) -> Lockstep: ...
    def close(self) -> None: ...
    def sync(self, busy: bool, cost_ms: float) -> tuple[bool, float]: ...

@final
class Doorbell:
    """Wakes a lockstep rank group out of its idle sleep: a shared counter that ranks sleep on (futex)."""

    @staticmethod
    def create(path: str | PathLike[str]) -> Doorbell: ...
    @staticmethod
    def open(path: str | PathLike[str]) -> Doorbell: ...
    def value(self) -> int: ...
    def ring(self) -> None: ...
    def wait(self, seen: int, timeout: float) -> bool:
        """Sleep until the bell rings after `seen` was read (True) or `timeout` seconds pass (False)."""

def serve(
    config: ServerConfig,
    codec: Any,
    decode_batch: Callable[[DecodeBatch], None],
    rings: Sequence[tuple[Ring, Ring]],
    pids: Sequence[int],
    bell: Doorbell | None = None,
) -> int:
    """Run the HTTP front end until SIGTERM/SIGINT (returns 0) or a rank failure (returns 1)."""

def check_tls(certfile: str, keyfile: str, ca_certs: str | None = None, cert_reqs: int = 0) -> None:
    """Load the TLS files as the server will (rust/edge/tls.rs); ValueError with a one-line message naming the
    file that does not load."""

def mend_response(json: str, nested: bool) -> str | None:
    """A Responses Response (inside an event's `response` when `nested`) without the members OpenAI's schema does
    not have, cut from the text (rust/mend.rs); None when it holds a function call's `arguments` or is not JSON."""

# --- limits (rust/limits): every limit declared once; Python's flags and the README's check read these ---

@final
class Limit:
    """One declared limit: a settable one has a flag (the launcher sends it back by `name`), a fixed one none."""

    @property
    def name(self) -> str: ...
    @property
    def flag(self) -> str | None: ...
    @property
    def default(self) -> int | float: ...
    @property
    def unit(self) -> str: ...
    @property
    def group(self) -> str | None: ...
    @property
    def help(self) -> str: ...
    @property
    def derived(self) -> str | None: ...

LIMITS: tuple[Limit, ...]
# The timing settings that are not limits: each flag and its default (rust/timing.rs).
TIMING_DEFAULTS: dict[str, float]

# --- the server's settings (rust/config.rs, built with rust/py_record.rs): what the launcher hands `serve` ---

@final
class Limits:
    """The limits an operator sets by flag, every one (`LIMITS` declares them: name, default, flag, unit)."""

    def __new__(
        cls,
        *,
        max_request_body_bytes: int,
        max_json_elements: int,
        max_json_depth: int,
        max_batch_line_bytes: int,
        client_timeout_s: float,
        max_connections: int,
        max_stream_buffer_bytes: int,
        max_grammar_bytes: int,
        grammar_cpu_s: float,
        max_grammar_cache_bytes: int,
        request_timeout_s: float,
        max_queued_requests: int,
        max_generate_fanout: int,
        max_generate_fanout_bytes: int,
        queue_timeout_s: float,
        media_fetch_timeout_s: float,
        max_images_per_request: int,
        max_image_bytes: int,
        max_image_total_bytes: int,
        response_store_ttl_s: float,
        max_state_store_bytes: int,
        max_state_store_bytes_per_owner: int,
        max_state_store_item_bytes: int,
        max_state_store_chain_bytes: int,
        max_file_bytes: int,
        max_files_total_bytes: int,
        max_files_bytes_per_owner: int,
        max_background_runs: int,
        max_background_runs_per_owner: int,
        max_background_replay_bytes: int,
        upload_timeout_s: float,
        claim_lease_s: int,
    ) -> Limits: ...
    max_request_body_bytes: int
    max_json_elements: int
    max_json_depth: int
    max_batch_line_bytes: int
    client_timeout_s: float
    max_connections: int
    max_stream_buffer_bytes: int
    max_grammar_bytes: int
    grammar_cpu_s: float
    max_grammar_cache_bytes: int
    request_timeout_s: float
    max_queued_requests: int
    max_generate_fanout: int
    max_generate_fanout_bytes: int
    queue_timeout_s: float
    media_fetch_timeout_s: float
    max_images_per_request: int
    max_image_bytes: int
    max_image_total_bytes: int
    response_store_ttl_s: float
    max_state_store_bytes: int
    max_state_store_bytes_per_owner: int
    max_state_store_item_bytes: int
    max_state_store_chain_bytes: int
    max_file_bytes: int
    max_files_total_bytes: int
    max_files_bytes_per_owner: int
    max_background_runs: int
    max_background_runs_per_owner: int
    max_background_replay_bytes: int
    upload_timeout_s: float
    claim_lease_s: int

@final
class TlsFiles:
    """The files and the client-certificate policy, as the command line gives them."""

    def __new__(
        cls,
        *,
        certfile: str,
        keyfile: str,
        ca_certs: str | None,
        cert_reqs: int,
    ) -> TlsFiles: ...
    certfile: str
    keyfile: str
    ca_certs: str | None
    cert_reqs: int

@final
class EdgeConfig:
    """`--ssl-*`, `--uds` and `--root-path`, as `edge_args.server_config` builds them (`None` when an option is off)."""

    def __new__(
        cls,
        *,
        tls: TlsFiles | None,
        uds: str | None,
        root_path: str | None,
    ) -> EdgeConfig: ...
    tls: TlsFiles | None
    uds: str | None
    root_path: str | None

@final
class ServerConfig:
    """Everything the front end is told at start-up, grouped by concern."""

    def __new__(
        cls,
        *,
        host: str,
        port: int,
        served_model_names: list[str],
        thinking_pins: dict[str, bool],
        max_model_len: int,
        max_num_seqs: int,
        limits: Limits,
        log_level: str,
        exit_on_rank_failure_s: float,
        drain_timeout_s: float,
        http_workers: int,
        codec_threads: int,
        dispatch_gather_ms: float,
        dispatch_gather_min_tokens: int,
        api_key: str | None,
        log_format: str,
        sse_keep_alive_s: float,
        stream_interval_ms: float,
        edge: EdgeConfig,
        console: bool,
        cors: CorsConfig,
        state: StateConfig,
        media: MediaConfig,
        engine: EngineConfig,
        watchdog_timeout_s: float,
        priority_scheduling: bool,
        openapi: str | None,
        otlp_traces: tuple[str, str] | None,
    ) -> ServerConfig: ...
    host: str
    port: int
    served_model_names: list[str]
    thinking_pins: dict[str, bool]
    max_model_len: int
    max_num_seqs: int
    limits: Limits
    log_level: str
    exit_on_rank_failure_s: float
    drain_timeout_s: float
    http_workers: int
    codec_threads: int
    dispatch_gather_ms: float
    dispatch_gather_min_tokens: int
    api_key: str | None
    log_format: str
    sse_keep_alive_s: float
    stream_interval_ms: float
    edge: EdgeConfig
    console: bool
    cors: CorsConfig
    state: StateConfig
    media: MediaConfig
    engine: EngineConfig
    watchdog_timeout_s: float
    priority_scheduling: bool
    openapi: str | None
    otlp_traces: tuple[str, str] | None

@final
class CorsConfig:
    """CORS (`--allowed-origins` and its kin)."""

    def __new__(
        cls,
        *,
        allowed_origins: list[str],
        allowed_methods: list[str],
        allowed_headers: list[str],
        allow_credentials: bool,
    ) -> CorsConfig: ...
    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    allow_credentials: bool

@final
class StateConfig:
    """The state store and the files directory (`--state-store`, `--files-dir`, `--disable-response-store`)."""

    def __new__(
        cls,
        *,
        store: str,
        store_responses: bool,
        files_dir: str,
    ) -> StateConfig: ...
    store: str
    store_responses: bool
    files_dir: str

@final
class MediaConfig:
    """Image fetching (rust/media): where from (the amounts are `Limits`')."""

    def __new__(
        cls,
        *,
        allowed_media_domains: list[str],
        allowed_media_networks: list[str],
        allow_private_media_urls: bool,
        allowed_local_media_path: str | None,
    ) -> MediaConfig: ...
    allowed_media_domains: list[str]
    allowed_media_networks: list[str]
    allow_private_media_urls: bool
    allowed_local_media_path: str | None

@final
class EngineConfig:
    """What the worker metadata routes (`/server_info`, `/model_info`) report."""

    def __new__(
        cls,
        *,
        model_path: str | None,
        model_type: str | None,
        model_dir: str | None,
        engine: str,
        expert_parallel_size: int,
        context_parallel_size: int,
    ) -> EngineConfig: ...
    model_path: str | None
    model_type: str | None
    model_dir: str | None
    engine: str
    expert_parallel_size: int
    context_parallel_size: int

//! The rank status words kept in each output ring's `aux` slots (written by the rank, read by the server).

/// `aux` slot indices.
pub const AUX_STATE: usize = 0;
/// Requests the rank holds (running + waiting).
pub const AUX_REQUESTS: usize = 1;
/// Prompt tokens the rank still has to prefill.
pub const AUX_QUEUED_TOKENS: usize = 2;
/// `time.monotonic()` in ms at the end of the rank's last loop iteration.
pub const AUX_HEARTBEAT_MS: usize = 3;
/// KV-cache usage in parts per million (0..=1_000_000).
pub const AUX_KV_USAGE_PPM: usize = 4;
/// KV-cache capacity in tokens (0 when the engine does not say), written once the engine is built.
pub const AUX_KV_CAPACITY_TOKENS: usize = 5;

/// Values of `aux[AUX_STATE]`.
pub const STATE_STARTING: u64 = 0;
pub const STATE_LOADING: u64 = 1;
pub const STATE_READY: u64 = 2;
pub const STATE_FAILED: u64 = 3;
pub const STATE_STOPPED: u64 = 4;

/// (name, value) pairs exported to Python, so the ranks never re-declare them.
pub const EXPORTS: &[(&str, u64)] = &[
    ("AUX_STATE", AUX_STATE as u64),
    ("AUX_REQUESTS", AUX_REQUESTS as u64),
    ("AUX_QUEUED_TOKENS", AUX_QUEUED_TOKENS as u64),
    ("AUX_HEARTBEAT_MS", AUX_HEARTBEAT_MS as u64),
    ("AUX_KV_USAGE_PPM", AUX_KV_USAGE_PPM as u64),
    ("AUX_KV_CAPACITY_TOKENS", AUX_KV_CAPACITY_TOKENS as u64),
    ("STATE_STARTING", STATE_STARTING),
    ("STATE_LOADING", STATE_LOADING),
    ("STATE_READY", STATE_READY),
    ("STATE_FAILED", STATE_FAILED),
    ("STATE_STOPPED", STATE_STOPPED),
];

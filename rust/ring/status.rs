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
/// What the rank loop is doing (`PHASE_*`), written once per change, so a stalled rank can be named with it.
pub const AUX_PHASE: usize = 5;
/// Speculative decoding, cumulative since the rank started: draft tokens proposed, and accepted.
pub const AUX_SPEC_DRAFT_TOKENS: usize = 6;
pub const AUX_SPEC_ACCEPTED_TOKENS: usize = 7;
/// Sequences the engine preempted (and recomputes) since the rank started.
pub const AUX_PREEMPTIONS: usize = 8;
/// Aborts the engine lost (the request kept running), sent again by the rank, since the rank started.
pub const AUX_REABORTS: usize = 10;
/// Weight reloads (`RELOAD` records) the rank has finished since it started, and how the last one went: the
/// count in the high 32 bits, `RELOAD_OK` or `RELOAD_FAILED` in the low ones. One word, so that the server never
/// sees a new count with an old outcome.
pub const AUX_RELOADS: usize = 11;
pub const RELOAD_OK: u64 = 1;
pub const RELOAD_FAILED: u64 = 2;

/// Values of `aux[AUX_PHASE]`.
pub const PHASE_STARTING: u64 = 0;
pub const PHASE_IDLE: u64 = 1;
pub const PHASE_ADD: u64 = 2;
pub const PHASE_SYNC: u64 = 3;
pub const PHASE_STEP: u64 = 4;
pub const PHASE_FLUSH: u64 = 5;
pub const PHASE_PUBLISH: u64 = 6;
pub const PHASE_CLOSE: u64 = 7;
pub const PHASE_RELOAD: u64 = 8;

/// A phase word for logs.
pub fn phase_name(phase: u64) -> &'static str {
    match phase {
        PHASE_STARTING => "starting",
        PHASE_IDLE => "idle",
        PHASE_ADD => "add (taking requests)",
        PHASE_SYNC => "sync (the group's all-reduce)",
        PHASE_STEP => "step",
        PHASE_FLUSH => "flush",
        PHASE_PUBLISH => "publish (waiting for the server to read its output)",
        PHASE_CLOSE => "close",
        PHASE_RELOAD => "reload (loading a checkpoint)",
        _ => "unknown",
    }
}

/// `CLOCK_MONOTONIC` in ms: the clock of `AUX_HEARTBEAT_MS` (the ranks stamp it with Python's time.monotonic()).
pub fn monotonic_ms() -> u64 {
    monotonic_us() / 1000
}

/// `CLOCK_MONOTONIC` in µs: the clock of the ranks' TIMING records (Python's time.monotonic()).
pub fn monotonic_us() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000 + t.tv_nsec as u64 / 1_000
}
/// KV-cache capacity in tokens (0 when the engine does not say), written once the engine is built.
pub const AUX_KV_CAPACITY_TOKENS: usize = 9;

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
    ("AUX_PHASE", AUX_PHASE as u64),
    ("AUX_SPEC_DRAFT_TOKENS", AUX_SPEC_DRAFT_TOKENS as u64),
    ("AUX_SPEC_ACCEPTED_TOKENS", AUX_SPEC_ACCEPTED_TOKENS as u64),
    ("AUX_PREEMPTIONS", AUX_PREEMPTIONS as u64),
    ("AUX_REABORTS", AUX_REABORTS as u64),
    ("AUX_RELOADS", AUX_RELOADS as u64),
    ("RELOAD_OK", RELOAD_OK),
    ("RELOAD_FAILED", RELOAD_FAILED),
    ("PHASE_STARTING", PHASE_STARTING),
    ("PHASE_IDLE", PHASE_IDLE),
    ("PHASE_ADD", PHASE_ADD),
    ("PHASE_SYNC", PHASE_SYNC),
    ("PHASE_STEP", PHASE_STEP),
    ("PHASE_FLUSH", PHASE_FLUSH),
    ("PHASE_PUBLISH", PHASE_PUBLISH),
    ("PHASE_CLOSE", PHASE_CLOSE),
    ("PHASE_RELOAD", PHASE_RELOAD),
    ("STATE_STARTING", STATE_STARTING),
    ("STATE_LOADING", STATE_LOADING),
    ("STATE_READY", STATE_READY),
    ("STATE_FAILED", STATE_FAILED),
    ("STATE_STOPPED", STATE_STOPPED),
];

//! The server's timing settings that are not limits (no client controls them: the operator tunes them), each with
//! its default declared once, here. `_native.TIMING_DEFAULTS` hands them to the launcher's flags (`cli.py`), and
//! `ServerConfig::for_tests` starts from them; tests/test_timing_defaults.py checks the flags against this table.
//! A leaf: it imports nothing of the crate.

use pyo3::prelude::*;
use pyo3::types::PyDict;

/// `--exit-on-rank-failure`: seconds between a rank failure (health turns 503 at once) and exiting with status 1.
pub const EXIT_ON_RANK_FAILURE_S: f64 = 3.0;
/// `--drain-timeout`: seconds to finish in-flight requests on SIGTERM.
pub const DRAIN_TIMEOUT_S: f64 = 30.0;
/// `--sse-keep-alive`: seconds of silence on an SSE stream before a keep-alive comment.
pub const SSE_KEEP_ALIVE_S: f64 = 15.0;
/// `--stream-interval-ms`: shortest gap between two token events of one stream.
pub const STREAM_INTERVAL_MS: f64 = 3.0;
/// `--watchdog-timeout`: seconds a rank with requests in flight may go without a heartbeat; 0 disables it.
pub const WATCHDOG_TIMEOUT_S: f64 = 300.0;
/// `--dispatch-gather-ms` when the ranks step together (else 0, off): a closed loop's burst of 8k-token prompts
/// reaches the ranks over 5-15 ms; a 10 ms window split it in some runs (BENCHMARKS.md, the replay).
pub const DISPATCH_GATHER_MS_LOCKSTEP: f64 = 20.0;

/// Each flag and its default, as `_native.TIMING_DEFAULTS` exports them (`--dispatch-gather-ms`: its default when
/// the ranks step together).
pub const DEFAULTS: [(&str, f64); 6] = [
    ("--exit-on-rank-failure", EXIT_ON_RANK_FAILURE_S),
    ("--drain-timeout", DRAIN_TIMEOUT_S),
    ("--sse-keep-alive", SSE_KEEP_ALIVE_S),
    ("--stream-interval-ms", STREAM_INTERVAL_MS),
    ("--watchdog-timeout", WATCHDOG_TIMEOUT_S),
    ("--dispatch-gather-ms", DISPATCH_GATHER_MS_LOCKSTEP),
];

/// `TIMING_DEFAULTS`: flag -> default.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let d = PyDict::new(m.py());
    for (flag, default) in DEFAULTS {
        d.set_item(flag, default)?;
    }
    m.add("TIMING_DEFAULTS", d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tests_settings_start_from_the_table() {
        let c = crate::config::ServerConfig::for_tests();
        let got = [c.exit_on_rank_failure_s, c.drain_timeout_s, c.sse_keep_alive_s, c.stream_interval_ms];
        let want: Vec<f64> = DEFAULTS[..4].iter().map(|(_, d)| *d).collect();
        assert_eq!(got.to_vec(), want);
        assert_eq!(c.watchdog_timeout_s, WATCHDOG_TIMEOUT_S);
        assert_eq!(c.dispatch_gather_ms, 0.0, "the sim's ranks do not step together: no gather");
    }
}

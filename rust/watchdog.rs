//! The hang watchdog (`--watchdog-timeout`): a rank that holds requests but has not stamped its heartbeat for
//! that long is taken to be hung (a collective whose peer died or stopped, a kernel that never returns). Nothing
//! raises in that case and no process exits, so without it /health stays 200 and every client waits forever.
//!
//! It is a timer on the tokio runtime (a check every `period`), reading the ranks' status words: no GIL, no
//! polling of the ranks themselves. An idle rank sleeping on its doorbell stamps nothing and is never a stall:
//! only a rank with requests in flight counts, and its stall is measured from the later of its last heartbeat
//! and the moment it last went from no requests to some (a sleeping rank's heartbeat is old when work arrives).

use crate::dispatch::Dispatcher;
use crate::ring::status::{AUX_HEARTBEAT_MS, AUX_PHASE, monotonic_ms, phase_name};
use crate::supervisor::{fail_rank, kill_rank_groups};
use std::time::Duration;

/// A rank found hung.
#[derive(Debug, Clone, PartialEq)]
pub struct Stall {
    pub rank: usize,
    pub in_flight: usize,
    /// How long it has had work without a heartbeat.
    pub silent_ms: u64,
    pub phase: u64,
}

/// How often to check: often enough to act within about a quarter of the timeout, at most once a second.
pub fn period(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

/// The ranks that have work and no heartbeat for `timeout_ms` at `now_ms`.
pub fn stalled(dispatcher: &Dispatcher, timeout_ms: u64, now_ms: u64) -> Vec<Stall> {
    dispatcher
        .ranks
        .iter()
        .filter(|link| link.is_alive())
        .filter_map(|link| {
            let in_flight = link.in_flight(); // read first: the busy-since time it implies is visible after it
            if in_flight == 0 {
                return None;
            }
            let last = link.output.aux(AUX_HEARTBEAT_MS).max(link.busy_since_ms());
            let silent_ms = now_ms.saturating_sub(last);
            (silent_ms >= timeout_ms).then(|| Stall {
                rank: link.index,
                in_flight,
                silent_ms,
                phase: link.output.aux(AUX_PHASE),
            })
        })
        .collect()
}

/// Check every `period(timeout)` until a rank stalls; then fail every rank (503 on /health, errors for their
/// requests), SIGKILL every rank's process group, and return the first stalled rank.
pub async fn run(dispatcher: std::sync::Arc<Dispatcher>, timeout: Duration, pids: Vec<i32>) -> usize {
    let timeout_ms = timeout.as_millis() as u64;
    let mut tick = tokio::time::interval(period(timeout));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let stalls = stalled(&dispatcher, timeout_ms, monotonic_ms());
        if let Some(first) = stalls.first() {
            trip(&dispatcher, &stalls, &pids);
            return first.rank;
        }
    }
}

fn trip(dispatcher: &Dispatcher, stalls: &[Stall], pids: &[i32]) {
    for s in stalls {
        tracing::error!(
            rank = s.rank,
            in_flight = s.in_flight,
            phase = phase_name(s.phase),
            "watchdog: rank {} has had {} request(s) and no heartbeat for {:.1} s, in phase {}",
            s.rank,
            s.in_flight,
            s.silent_ms as f64 / 1e3,
            phase_name(s.phase)
        );
    }
    let now = monotonic_ms();
    for link in &dispatcher.ranks {
        let age_s = now.saturating_sub(link.output.aux(AUX_HEARTBEAT_MS)) as f64 / 1e3;
        tracing::error!(
            rank = link.index,
            "watchdog: rank {} phase {}, heartbeat {age_s:.1} s old",
            link.index,
            phase_name(link.output.aux(AUX_PHASE))
        );
    }
    // Mark every rank dead before failing any request, so nothing new is admitted meanwhile.
    for link in &dispatcher.ranks {
        link.mark_dead();
    }
    let why = format!("Engine rank {} stopped responding (watchdog); the server is restarting.", stalls[0].rank);
    for rank in 0..dispatcher.ranks.len() {
        fail_rank(dispatcher, rank, &why, "rank_hung");
    }
    tracing::error!("watchdog: killing every rank process and its children (SIGKILL)");
    kill_rank_groups(pids);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::Admission;
    use crate::dispatch::testing::{dispatcher, submit};
    use crate::ring::status::PHASE_STEP;

    const T: u64 = 2_000; // the timeout, ms

    #[test]
    fn only_a_rank_with_work_and_no_heartbeat_since_it_got_it_is_stalled() {
        let dir = tempfile::tempdir().unwrap();
        let d = dispatcher(dir.path(), 2);
        let admission = Admission::new(8);
        let now = monotonic_ms();
        // Idle ranks that stamped nothing for hours (asleep on the doorbell) are never stalled.
        assert!(stalled(&d, T, now + 3_600_000).is_empty());
        // Work arrives at a rank whose heartbeat is ancient: counted from its arrival, not from the heartbeat.
        let _ticket = submit(&d, &admission);
        let busy = d.ranks.iter().find(|r| r.in_flight() == 1).unwrap().index;
        assert!(stalled(&d, T, now + T / 2).is_empty());
        d.ranks[busy].output.set_aux(AUX_PHASE, PHASE_STEP);
        let s = stalled(&d, T, monotonic_ms() + T);
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].rank, s[0].in_flight, s[0].phase), (busy, 1, PHASE_STEP));
        assert!(s[0].silent_ms >= T);
        // A heartbeat after that resets the clock.
        let later = monotonic_ms() + 10 * T;
        d.ranks[busy].output.set_aux(AUX_HEARTBEAT_MS, later - T / 2);
        assert!(stalled(&d, T, later).is_empty());
        assert_eq!(stalled(&d, T, later + T / 2).len(), 1);
        // A rank already failed (its exit is being handled) is not reported again.
        d.ranks[busy].mark_dead();
        assert!(stalled(&d, T, later + T).is_empty());
    }

    #[test]
    fn period_is_bounded() {
        assert_eq!(period(Duration::from_secs(300)), Duration::from_secs(1));
        assert_eq!(period(Duration::from_secs(2)), Duration::from_millis(500));
        assert_eq!(period(Duration::from_millis(10)), Duration::from_millis(50));
    }
}

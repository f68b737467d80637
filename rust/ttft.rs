//! Where a request's time to first token goes. A request collects a stamp at each point on its way (the server's
//! own, and the rank's from the TIMING record sent with its first token); at its first token they become stages,
//! observed in `deepinfer_ttft_stage_seconds{stage}`, which add up to the TTFT the server measures. Stamps are
//! taken once per request, never per token.

use crate::ring::records::RankStamps;
use crate::ring::status::monotonic_us;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The stages, in order: arrival → body checked (`parse`) → admitted (`queue`, the wait queue) → converted and
/// encoded by the codec (`encode`) → written to the rank's ring (`dispatch`) → taken by the rank (`ring`) → the
/// engine step carrying its prefill starts (`engine_queue`) → first token published (`prefill`) → read by the
/// server (`publish`) → its event written to the client (`sse`, streams only). `engine` replaces `ring` to
/// `publish` for an engine that sends no TIMING record.
pub const STAGES: &[&str] =
    &["parse", "queue", "encode", "dispatch", "ring", "engine_queue", "prefill", "publish", "sse", "engine"];

pub struct Stamps {
    parsed: Instant,
    admitted: Instant,
    encoded: Instant,
    later: Mutex<Later>,
}

#[derive(Default)]
struct Later {
    written: Option<Instant>,
    /// Taken, scheduled, published: the rank's times on the server's clock.
    rank: Option<[Instant; 3]>,
}

impl Stamps {
    pub fn new(parsed: Instant, admitted: Instant, encoded: Instant) -> Self {
        Stamps { parsed, admitted, encoded, later: Mutex::default() }
    }

    pub fn written(&self, at: Instant) {
        self.later.lock().unwrap().written = Some(at);
    }

    pub fn rank(&self, r: &RankStamps, clock: &RankClock) {
        let at = [r.taken_us, r.scheduled_us, r.published_us].map(|us| clock.instant(us));
        self.later.lock().unwrap().rank = Some(at);
    }

    /// The stages from `arrival` to `read` (the server read the first token) as (stage, duration). A stamp that
    /// is out of order (clocks read on different cores) is clamped to its predecessor, so every stage is ≥ 0 and
    /// together they are exactly `read - arrival`.
    pub fn stages(&self, arrival: Instant, read: Instant) -> Vec<(&'static str, Duration)> {
        let later = self.later.lock().unwrap();
        let mut points = vec![("parse", self.parsed), ("queue", self.admitted), ("encode", self.encoded)];
        if let Some(w) = later.written {
            points.push(("dispatch", w));
            match later.rank {
                Some([taken, scheduled, published]) => {
                    points.extend([("ring", taken), ("engine_queue", scheduled), ("prefill", published)]);
                    points.push(("publish", read));
                }
                None => points.push(("engine", read)),
            }
        } else {
            points.push(("engine", read));
        }
        let mut prev = arrival;
        points
            .into_iter()
            .map(|(stage, at)| {
                let at = at.clamp(prev, read.max(prev));
                let d = at - prev;
                prev = at;
                (stage, d)
            })
            .collect()
    }
}

/// Turns the ranks' CLOCK_MONOTONIC microseconds into `Instant`s, from one reading of both clocks.
pub struct RankClock {
    now: Instant,
    now_us: u64,
}

impl RankClock {
    pub fn now() -> Self {
        RankClock { now: Instant::now(), now_us: monotonic_us() }
    }

    fn instant(&self, us: u64) -> Instant {
        if us <= self.now_us {
            self.now.checked_sub(Duration::from_micros(self.now_us - us)).unwrap_or(self.now)
        } else {
            self.now + Duration::from_micros(us - self.now_us)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_add_up_to_the_first_token_and_clamp_out_of_order_stamps() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let s = Stamps::new(ms(1), ms(3), ms(6));
        s.written(ms(7));
        // Both clocks read at t0 + 30 ms; the rank's reads 1 s then.
        let clock = RankClock { now: ms(30), now_us: 1_000_000 };
        let us_of = |i: Instant| 1_000_000 - (ms(30) - i).as_micros() as u64;
        // The rank "took" it before it was written (another core's clock): clamped to the write.
        let r = RankStamps {
            request_id: 1,
            taken_us: us_of(ms(6)),
            scheduled_us: us_of(ms(9)),
            published_us: us_of(ms(20)),
        };
        s.rank(&r, &clock);
        let got = s.stages(t0, ms(21));
        let names: Vec<_> = got.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["parse", "queue", "encode", "dispatch", "ring", "engine_queue", "prefill", "publish"]);
        let total: Duration = got.iter().map(|(_, d)| *d).sum();
        assert_eq!(total, Duration::from_millis(21));
        assert_eq!(got[4].1, Duration::ZERO);
        let near = |d: Duration, want: u64| (d.as_micros() as i64 - want as i64 * 1000).abs() <= 2;
        assert!(near(got[5].1, 2) && near(got[6].1, 11) && near(got[7].1, 1), "{got:?}");
    }

    #[test]
    fn without_rank_stamps_the_engine_is_one_stage() {
        let t0 = Instant::now();
        let s = Stamps::new(t0, t0, t0 + Duration::from_millis(2));
        s.written(t0 + Duration::from_millis(3));
        let got = s.stages(t0, t0 + Duration::from_millis(10));
        assert_eq!(got.last().unwrap(), &("engine", Duration::from_millis(7)));
    }
}

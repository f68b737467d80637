//! The console's last five minutes: a ring of per-second aggregates (tokens, finished requests, and TTFT and ITL
//! histograms), fed where the metrics are recorded (`crate::metrics`) and read by `GET /console/status`. The
//! Prometheus histograms count since start; a chart needs the recent past, second by second, without a scraper.
//! One short lock per token batch (never the GIL); a read copies nothing but the sums it returns.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Seconds kept: the window every chart and rate covers.
pub const SECONDS: usize = 300;
/// Log-spaced latency buckets: bucket `i` holds values up to `FIRST_S * GROWTH^i` (0.1 ms .. ~100 s, 25 % apart).
const BUCKETS: usize = 64;
const FIRST_S: f64 = 0.0001;
const GROWTH: f64 = 1.25;

#[derive(Clone, Copy)]
struct Second {
    /// Which second since `Pulse::start` this slot holds (a slot older than the window is stale).
    at: u64,
    tokens: u64,
    requests: u64,
    ttft: [u32; BUCKETS],
    itl: [u32; BUCKETS],
}

const EMPTY: Second = Second { at: u64::MAX, tokens: 0, requests: 0, ttft: [0; BUCKETS], itl: [0; BUCKETS] };

pub struct Pulse {
    start: Instant,
    ring: Mutex<Box<[Second; SECONDS]>>,
}

/// What the window holds, oldest second first, the current (partial) second left out.
#[derive(Debug, serde::Serialize)]
pub struct Window {
    pub tokens: Vec<u64>,
    pub requests: Vec<u64>,
    /// Per second, in milliseconds (None: no sample that second).
    pub ttft_p50: Vec<Option<f64>>,
    pub ttft_p95: Vec<Option<f64>>,
    pub itl_p50: Vec<Option<f64>>,
    pub itl_p95: Vec<Option<f64>>,
    /// Over the whole window.
    pub summary: Summary,
}

#[derive(Debug, serde::Serialize)]
pub struct Summary {
    pub tokens_per_s: f64,
    pub requests_per_s: f64,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p95_ms: Option<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p95_ms: Option<f64>,
    /// Seconds the window covers so far (less than `SECONDS` just after start).
    pub seconds: usize,
}

impl Default for Pulse {
    fn default() -> Self {
        Pulse { start: Instant::now(), ring: Mutex::new(Box::new([EMPTY; SECONDS])) }
    }
}

fn bucket(seconds: f64) -> usize {
    if seconds <= FIRST_S {
        return 0;
    }
    ((seconds / FIRST_S).ln() / GROWTH.ln()).ceil().clamp(0.0, (BUCKETS - 1) as f64) as usize
}

/// The upper edge of the bucket where the `q` quantile falls, in ms (None for no samples).
fn quantile(hist: &[u32; BUCKETS], q: f64) -> Option<f64> {
    let total: u64 = hist.iter().map(|&n| u64::from(n)).sum();
    if total == 0 {
        return None;
    }
    let rank = (q * total as f64).ceil().max(1.0) as u64;
    let mut seen = 0u64;
    for (i, &n) in hist.iter().enumerate() {
        seen += u64::from(n);
        if seen >= rank {
            let ms = FIRST_S * GROWTH.powi(i as i32) * 1e3;
            return Some((ms * 100.0).round() / 100.0);
        }
    }
    None
}

impl Pulse {
    fn with_second<R>(&self, f: impl FnOnce(&mut Second) -> R) -> R {
        let at = self.start.elapsed().as_secs();
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let slot = &mut ring[at as usize % SECONDS];
        if slot.at != at {
            *slot = Second { at, ..EMPTY };
        }
        f(slot)
    }

    /// `n` tokens arrived, `gap` after the stream's previous ones (None: its first), spread evenly over them.
    pub fn tokens(&self, n: usize, gap: Option<Duration>) {
        let each = gap.filter(|_| n > 0).map(|g| bucket(g.as_secs_f64() / n as f64));
        self.with_second(|s| {
            s.tokens += n as u64;
            if let Some(b) = each {
                s.itl[b] += n as u32;
            }
        });
    }

    pub fn first_token(&self, ttft: Duration) {
        let b = bucket(ttft.as_secs_f64());
        self.with_second(|s| s.ttft[b] += 1);
    }

    pub fn finished(&self) {
        self.with_second(|s| s.requests += 1);
    }

    /// The window up to the last whole second.
    pub fn window(&self) -> Window {
        let now = self.start.elapsed().as_secs();
        let seconds = (now as usize).min(SECONDS);
        // Read under the lock (tens of µs a call): copying 300 seconds of buckets out would cost as much.
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        let mut w = Window {
            tokens: Vec::with_capacity(seconds),
            requests: Vec::with_capacity(seconds),
            ttft_p50: Vec::with_capacity(seconds),
            ttft_p95: Vec::with_capacity(seconds),
            itl_p50: Vec::with_capacity(seconds),
            itl_p95: Vec::with_capacity(seconds),
            summary: Summary {
                tokens_per_s: 0.0,
                requests_per_s: 0.0,
                ttft_p50_ms: None,
                ttft_p95_ms: None,
                itl_p50_ms: None,
                itl_p95_ms: None,
                seconds,
            },
        };
        let (mut ttft, mut itl) = ([0u32; BUCKETS], [0u32; BUCKETS]);
        let (mut tokens, mut requests) = (0u64, 0u64);
        for at in now - seconds as u64..now {
            let s = &ring[at as usize % SECONDS];
            let s = if s.at == at { s } else { &EMPTY };
            w.tokens.push(s.tokens);
            w.requests.push(s.requests);
            w.ttft_p50.push(quantile(&s.ttft, 0.5));
            w.ttft_p95.push(quantile(&s.ttft, 0.95));
            w.itl_p50.push(quantile(&s.itl, 0.5));
            w.itl_p95.push(quantile(&s.itl, 0.95));
            tokens += s.tokens;
            requests += s.requests;
            for i in 0..BUCKETS {
                ttft[i] = ttft[i].saturating_add(s.ttft[i]);
                itl[i] = itl[i].saturating_add(s.itl[i]);
            }
        }
        let span = seconds.max(1) as f64;
        w.summary.tokens_per_s = (tokens as f64 / span * 10.0).round() / 10.0;
        w.summary.requests_per_s = (requests as f64 / span * 100.0).round() / 100.0;
        w.summary.ttft_p50_ms = quantile(&ttft, 0.5);
        w.summary.ttft_p95_ms = quantile(&ttft, 0.95);
        w.summary.itl_p50_ms = quantile(&itl, 0.5);
        w.summary.itl_p95_ms = quantile(&itl, 0.95);
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_the_range_in_order() {
        assert_eq!(bucket(0.0), 0);
        assert_eq!(bucket(1e-9), 0);
        assert!(bucket(0.001) < bucket(0.01) && bucket(0.01) < bucket(1.0));
        assert_eq!(bucket(1e6), BUCKETS - 1, "clamped");
        // The reported edge is never below the value and at most one step (25 %) above it.
        for v in [0.0003, 0.004, 0.05, 0.7, 9.0] {
            let mut h = [0u32; BUCKETS];
            h[bucket(v)] = 1;
            let ms = quantile(&h, 0.5).unwrap();
            assert!(ms >= v * 1e3 * 0.999 && ms <= v * 1e3 * GROWTH * 1.001, "{v}: {ms}");
        }
    }

    #[test]
    fn quantiles_split_the_samples() {
        let mut h = [0u32; BUCKETS];
        h[bucket(0.001)] = 90;
        h[bucket(0.1)] = 10;
        assert!(quantile(&h, 0.5).unwrap() < 2.0);
        assert!(quantile(&h, 0.95).unwrap() > 90.0);
        assert_eq!(quantile(&[0; BUCKETS], 0.5), None);
    }

    #[test]
    fn the_current_second_waits_for_its_end() {
        let p = Pulse::default();
        p.tokens(5, Some(Duration::from_millis(50)));
        p.first_token(Duration::from_millis(20));
        p.finished();
        let w = p.window();
        assert_eq!(w.summary.seconds, 0, "nothing whole yet");
        assert!(w.tokens.is_empty());
        // A pulse started two seconds ago sees them in its last whole second.
        let p = Pulse { start: Instant::now() - Duration::from_secs(2), ..Pulse::default() };
        let at = 2u64;
        p.ring.lock().unwrap()[at as usize % SECONDS] = Second { at: 1, tokens: 7, requests: 1, ..EMPTY };
        let w = p.window();
        assert_eq!((w.tokens.clone(), w.summary.seconds), (vec![0, 0], 2), "a stale slot counts as empty");
        p.ring.lock().unwrap()[1] = Second { at: 1, tokens: 7, requests: 1, ..EMPTY };
        let w = p.window();
        assert_eq!(w.tokens, vec![0, 7]);
        assert_eq!(w.summary.tokens_per_s, 3.5);
    }
}

//! Gather: hand a burst of long prompts to the ranks together, so that their prefills share one engine step.
//!
//! Why: ranks that step together (DeepInfer's data-parallel group) pause every rank's decode for a step that
//! prefills a prompt on any of them, and a step under way takes nothing new. When a burst of long prompts arrives
//! (a closed-loop client whose streams end together, a batch job), the first one to be encoded starts a prefill
//! step on its own, and the rest of the burst, encoded a few milliseconds later, waits for that whole step before
//! its own: every request but the first pays two prefills. The burst then ends together again, minus its first,
//! and the split repeats; which split a run falls into decides its mean TTFT.
//!
//! The gather holds a long prompt's SUBMIT for a short window after it is encoded: every long prompt encoded
//! within the window goes to its rank at the window's end, in one go. A prompt of 8k tokens costs about 200 ms of
//! prefill on the calibrated engine, so a window of a few milliseconds is small beside what a missed step costs.
//! Short prompts never wait: their prefill is cheaper than the wait. The request is registered on its rank (and
//! counted in its load) when it is held, so the rank picked for the next one already sees it.

use super::inflight::Inflight;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

/// When a prompt is held, and for how long.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GatherPolicy {
    /// How long the window stays open after its first prompt; zero turns gathering off.
    pub window: Duration,
    /// Prompts shorter than this (tokens the engine prefills) are sent at once.
    pub min_tokens: usize,
}

impl GatherPolicy {
    pub const OFF: GatherPolicy = GatherPolicy { window: Duration::ZERO, min_tokens: 0 };

    pub fn holds(&self, prompt_tokens: usize) -> bool {
        !self.window.is_zero() && prompt_tokens >= self.min_tokens
    }
}

/// A SUBMIT record waiting for its window to close.
pub struct Waiting {
    pub entry: Arc<Inflight>,
    pub record: Vec<u8>,
    /// The request's image file, removed if the request ends before it is sent (no rank would read it).
    pub images: Option<crate::ring::records::ImageSet>,
}

#[derive(Default)]
struct Window {
    held: Vec<Waiting>,
    /// When the open window closes; `None` while none is open.
    closes: Option<Instant>,
    stopped: bool,
}

pub struct Gather {
    pub policy: GatherPolicy,
    window: Mutex<Window>,
    wake: Condvar,
}

impl Gather {
    /// The gather, with the thread that closes its windows and hands each one's records to `release` (no thread
    /// when the policy is off). The thread ends when `release` says nobody takes them, or at `stop`.
    pub fn start(policy: GatherPolicy, release: impl Fn(Vec<Waiting>) -> bool + Send + 'static) -> Arc<Gather> {
        let gather = Arc::new(Gather { policy, window: Mutex::default(), wake: Condvar::new() });
        if !policy.window.is_zero() {
            let me = gather.clone();
            thread::Builder::new()
                .name("dispatch-gather".into())
                .spawn(move || me.close_windows(release))
                .expect("spawn gather thread");
        }
        gather
    }

    /// Hold a record until the window closes, opening one if none is open.
    pub fn hold(&self, waiting: Waiting) {
        let mut w = self.window.lock().unwrap();
        if w.closes.is_none() {
            w.closes = Some(Instant::now() + self.policy.window);
            self.wake.notify_one();
        }
        w.held.push(waiting);
    }

    /// Records held now.
    #[cfg(test)]
    pub fn held(&self) -> usize {
        self.window.lock().unwrap().held.len()
    }

    /// End the thread (the dispatcher is going away); what is held is dropped with it.
    pub fn stop(&self) {
        self.window.lock().unwrap().stopped = true;
        self.wake.notify_one();
    }

    /// `release` takes a closed window's records: false once nobody does (the dispatcher is gone).
    fn close_windows(&self, release: impl Fn(Vec<Waiting>) -> bool) {
        // One wake-up per window; while none is open the thread sleeps until one opens (no timer when idle).
        let mut w = self.window.lock().unwrap();
        loop {
            if w.stopped {
                return;
            }
            let Some(closes) = w.closes else {
                w = self.wake.wait(w).unwrap();
                continue;
            };
            let now = Instant::now();
            if now < closes {
                w = self.wake.wait_timeout(w, closes - now).unwrap().0;
                continue;
            }
            let batch = std::mem::take(&mut w.held);
            w.closes = None;
            drop(w);
            if !release(batch) {
                return;
            }
            w = self.window.lock().unwrap();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::Admission;
    use crate::dispatch::Dispatcher;
    use crate::dispatch::testing::{gathering, submit};
    use crate::ring::records;

    #[test]
    fn only_long_prompts_wait_and_zero_window_is_off() {
        let p = GatherPolicy { window: Duration::from_millis(10), min_tokens: 4096 };
        assert!(p.holds(4096) && p.holds(100_000));
        assert!(!p.holds(4095));
        assert!(!GatherPolicy::OFF.holds(1 << 20));
    }

    /// The kinds of the records in rank `i`'s request ring, taken out.
    fn kinds(d: &Dispatcher, i: usize) -> Vec<u32> {
        let mut out = Vec::new();
        d.ranks[i].requests.ring().drain(1 << 16, |kind, _| out.push(kind)).unwrap();
        out
    }

    #[test]
    fn a_window_sends_what_it_held_together_and_skips_what_ended() {
        let dir = tempfile::tempdir().unwrap();
        let policy = GatherPolicy { window: Duration::from_millis(150), min_tokens: 3 };
        let d = gathering(dir.path(), 2, policy);
        let admission = Admission::new(8);
        let kept = [submit(&d, &admission), submit(&d, &admission)];
        let left = submit(&d, &admission);
        // Registered (the next pick sees them) but not yet in any ring.
        assert_eq!(d.gather.held(), 3);
        assert_eq!(d.ranks.iter().map(|r| r.in_flight()).sum::<usize>(), 3);
        assert!(d.ranks.iter().all(|r| r.requests.ring().used_bytes() == 0));
        let gone = left.rank();
        drop(left); // its client left while it was held: the rank gets only the abort
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(d.gather.held(), 0);
        // The sent ones stay registered on their ranks (their tokens have somewhere to go); the one that left does not.
        assert_eq!(d.ranks.iter().map(|r| r.in_flight()).sum::<usize>(), kept.len());
        let mut submits = 0;
        for i in 0..2 {
            let k = kinds(&d, i);
            submits += k.iter().filter(|&&k| k == records::SUBMIT).count();
            if i == gone {
                assert_eq!(k.first(), Some(&records::ABORT), "the abort went first and no SUBMIT followed it: {k:?}");
            }
        }
        assert_eq!(submits, kept.len());
    }
}

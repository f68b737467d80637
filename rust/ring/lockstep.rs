//! `Lockstep`: a cross-process barrier with a reduction, for simulated DP ranks that must step together the
//! way DeepInfer's ranks do (every step is a collective, so it lasts as long as the slowest rank's).
//!
//! Each round every party calls `sync(busy, cost)`; the last to arrive publishes (any busy, max cost) and bumps
//! the generation futex, waking the others. Parties sleep on the futex; nothing spins.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::RingError;
use super::futex::{futex_wait, futex_wake};
use super::page::{PageState, SharedPage};

#[repr(C)]
struct Shared {
    magic: AtomicU64, // read and written by SharedPage (offset 0)
    parties: AtomicU32,
    closed: AtomicU32,
    arrived: AtomicU32,
    generation: AtomicU32,
    busy_acc: AtomicU32,
    result_busy: AtomicU32,
    cost_acc: AtomicU64,
    result_cost: AtomicU64,
}

// SAFETY: repr(C), a few dozen bytes, only atomics.
unsafe impl PageState for Shared {
    const MAGIC: u64 = 0x5045_5453_4b43_4f4c; // "LOCKSTEP"
    const NAME: &'static str = "lockstep";
}

pub struct Lockstep {
    page: SharedPage<Shared>,
}

impl Lockstep {
    pub fn create(path: impl AsRef<Path>, parties: u32) -> io::Result<Self> {
        if parties == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a lockstep group needs at least one party"));
        }
        Ok(Lockstep { page: SharedPage::create(path, |s: &Shared| s.parties.store(parties, Ordering::Relaxed))? })
    }

    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        Ok(Lockstep { page: SharedPage::open(path)? })
    }

    fn shared(&self) -> &Shared {
        self.page.get()
    }

    pub fn close(&self) {
        let s = self.shared();
        s.closed.store(1, Ordering::SeqCst);
        s.generation.fetch_add(1, Ordering::SeqCst);
        futex_wake(&s.generation, i32::MAX);
    }

    /// One round: returns (any party busy, max cost) once every party arrived. `Closed` if the group was
    /// closed (a party is gone), `Timeout` if the others did not arrive in time.
    pub fn sync(&self, busy: bool, cost: u64, timeout: Option<Duration>) -> Result<(bool, u64), RingError> {
        let s = self.shared();
        if s.closed.load(Ordering::SeqCst) != 0 {
            return Err(RingError::Closed);
        }
        let generation = s.generation.load(Ordering::SeqCst);
        if busy {
            s.busy_acc.fetch_or(1, Ordering::SeqCst);
        }
        s.cost_acc.fetch_max(cost, Ordering::SeqCst);
        if s.arrived.fetch_add(1, Ordering::SeqCst) + 1 == s.parties.load(Ordering::Relaxed) {
            // Last to arrive: publish this round's result, reset for the next, release everybody.
            s.result_busy.store(s.busy_acc.swap(0, Ordering::SeqCst), Ordering::SeqCst);
            s.result_cost.store(s.cost_acc.swap(0, Ordering::SeqCst), Ordering::SeqCst);
            s.arrived.store(0, Ordering::SeqCst);
            s.generation.fetch_add(1, Ordering::SeqCst);
            futex_wake(&s.generation, i32::MAX);
        } else {
            let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
            while s.generation.load(Ordering::SeqCst) == generation {
                let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
                if left.is_some_and(|l| l.is_zero()) {
                    return Err(RingError::Timeout);
                }
                futex_wait(&s.generation, generation, left);
            }
        }
        if s.closed.load(Ordering::SeqCst) != 0 {
            return Err(RingError::Closed);
        }
        // Stable until the next round completes, which needs this party to arrive again.
        Ok((s.result_busy.load(Ordering::SeqCst) != 0, s.result_cost.load(Ordering::SeqCst)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn parties_agree_on_busy_and_the_max_cost_every_round() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ls");
        let first = Arc::new(Lockstep::create(&path, 3).unwrap());
        let others: Vec<_> = (0..2).map(|_| Arc::new(Lockstep::open(&path).unwrap())).collect();
        let handles: Vec<_> = [first.clone(), others[0].clone(), others[1].clone()]
            .into_iter()
            .enumerate()
            .map(|(i, ls)| {
                std::thread::spawn(move || {
                    (0..200u64)
                        .map(|round| ls.sync(round % 3 == i as u64, round * 10 + i as u64, None).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for round in 0..200usize {
            let want = (true, round as u64 * 10 + 2);
            assert!(results.iter().all(|r| r[round] == want), "round {round}");
        }
    }

    #[test]
    fn close_wakes_a_waiter_and_timeouts_fire() {
        let dir = tempfile::tempdir().unwrap();
        let ls = Arc::new(Lockstep::create(dir.path().join("ls"), 2).unwrap());
        assert_eq!(ls.sync(false, 0, Some(Duration::from_millis(20))), Err(RingError::Timeout));
        let ls = Arc::new(Lockstep::create(dir.path().join("ls2"), 2).unwrap());
        let waiter = {
            let ls = ls.clone();
            std::thread::spawn(move || ls.sync(true, 1, None))
        };
        std::thread::sleep(Duration::from_millis(20));
        ls.close();
        assert_eq!(waiter.join().unwrap(), Err(RingError::Closed));
    }
}

//! `Doorbell`: one shared counter that wakes a whole lockstep rank group out of its idle sleep.
//!
//! Ranks that step together (DeepInfer's DP ranks, `--sim-lockstep`) can only start a step once every rank has
//! reached the group's collective, so a request for one rank must wake all of them. Each rank reads `value()` at
//! the top of its loop and, when the group's round was idle, sleeps in `wait(seen)` until the counter moves. The
//! server rings after every record it puts in a request ring; a rank rings when it finds records in its own ring
//! (a peer may have read the counter after the server's ring but before its own loop saw nothing). Nobody polls.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::futex::{futex_wait, futex_wake};
use super::page::{PageState, SharedPage};

#[repr(C)]
struct Shared {
    magic: AtomicU64, // read and written by SharedPage (offset 0)
    rings: AtomicU32,
    /// Sleepers announce themselves here, so `ring` only makes a syscall when somebody sleeps.
    waiting: AtomicU32,
}

// SAFETY: repr(C), a few bytes, only atomics.
unsafe impl PageState for Shared {
    const MAGIC: u64 = 0x4c4c_4542_524f_4f44; // "DOORBELL"
    const NAME: &'static str = "doorbell";
}

pub struct Doorbell {
    page: SharedPage<Shared>,
}

impl Doorbell {
    pub fn create(path: impl AsRef<Path>) -> io::Result<Self> {
        Ok(Doorbell { page: SharedPage::create(path, |_| {})? })
    }

    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        Ok(Doorbell { page: SharedPage::open(path)? })
    }

    fn shared(&self) -> &Shared {
        self.page.get()
    }

    /// How many times the bell has rung (wrapping): what a later `wait` compares against.
    pub fn value(&self) -> u32 {
        self.shared().rings.load(Ordering::SeqCst)
    }

    /// Wake every sleeper, and make any `wait` on an older value return at once.
    pub fn ring(&self) {
        let s = self.shared();
        s.rings.fetch_add(1, Ordering::SeqCst);
        if s.waiting.load(Ordering::SeqCst) != 0 {
            futex_wake(&s.rings, i32::MAX);
        }
    }

    /// Sleep until the bell rings after `seen` was read (true) or `timeout` passes (false).
    pub fn wait(&self, seen: u32, timeout: Duration) -> bool {
        let s = self.shared();
        let deadline = Instant::now().checked_add(timeout);
        // Announce first, then re-read: a ring either moved the counter before the read, or sees `waiting`.
        s.waiting.fetch_add(1, Ordering::SeqCst);
        while s.rings.load(Ordering::SeqCst) == seen {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                break;
            }
            futex_wait(&s.rings, seen, left);
        }
        s.waiting.fetch_sub(1, Ordering::SeqCst);
        s.rings.load(Ordering::SeqCst) != seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_ring_after_the_read_ends_the_wait_even_if_it_came_first() {
        let dir = tempfile::tempdir().unwrap();
        let bell = Doorbell::create(dir.path().join("bell")).unwrap();
        let seen = bell.value();
        bell.ring();
        let t = Instant::now();
        assert!(bell.wait(seen, Duration::from_secs(5)));
        assert!(t.elapsed() < Duration::from_secs(1));
        assert!(!bell.wait(bell.value(), Duration::from_millis(20)), "nothing rang: times out");
    }

    #[test]
    fn a_ring_from_another_mapping_wakes_every_sleeper() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bell");
        let server = Doorbell::create(&path).unwrap();
        let ranks: Vec<_> = (0..3).map(|_| Arc::new(Doorbell::open(&path).unwrap())).collect();
        let seen = server.value();
        let sleepers: Vec<_> = ranks
            .iter()
            .map(|r| {
                let r = r.clone();
                std::thread::spawn(move || {
                    let t = Instant::now();
                    (r.wait(seen, Duration::from_secs(10)), t.elapsed())
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50));
        server.ring();
        for s in sleepers {
            let (rang, waited) = s.join().unwrap();
            assert!(rang);
            assert!(waited < Duration::from_secs(5), "woken by the ring, not the timeout: {waited:?}");
        }
    }

    #[test]
    fn open_rejects_other_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        assert!(Doorbell::open(&path).is_err());
        std::fs::write(&path, b"short").unwrap();
        assert!(Doorbell::open(&path).is_err());
    }
}

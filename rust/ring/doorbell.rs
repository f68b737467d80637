//! `Doorbell`: one shared counter that wakes a whole lockstep rank group out of its idle sleep.
//!
//! Ranks that step together (DeepInfer's DP ranks, `--sim-lockstep`) can only start a step once every rank has
//! reached the group's collective, so a request for one rank must wake all of them. Each rank reads `value()` at
//! the top of its loop and, when the group's round was idle, sleeps in `wait(seen)` until the counter moves. The
//! server rings after every record it puts in a request ring; a rank rings when it finds records in its own ring
//! (a peer may have read the counter after the server's ring but before its own loop saw nothing). Nobody polls.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;

use super::futex::{futex_wait, futex_wake};

const MAGIC: u64 = 0x4c4c_4542_524f_4f44; // "DOORBELL"
const SIZE: u64 = 4096;

#[repr(C)]
struct Shared {
    magic: AtomicU64,
    rings: AtomicU32,
    /// Sleepers announce themselves here, so `ring` only makes a syscall when somebody sleeps.
    waiting: AtomicU32,
}

pub struct Doorbell {
    map: MmapRaw,
}

// SAFETY: all shared state is atomics inside a mapping that lives as long as `self`.
unsafe impl Send for Doorbell {}
// SAFETY: as above; every access goes through atomics.
unsafe impl Sync for Doorbell {}

impl Doorbell {
    pub fn create(path: impl AsRef<Path>) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path)?;
        file.set_len(SIZE)?;
        let me = Self::map(&file)?;
        me.shared().magic.store(MAGIC, Ordering::Release);
        Ok(me)
    }

    pub fn open(path: impl AsRef<Path>) -> io::Result<Self> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        if file.metadata()?.len() < SIZE {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "short doorbell file"));
        }
        let me = Self::map(&file)?;
        if me.shared().magic.load(Ordering::Acquire) != MAGIC {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a doorbell file"));
        }
        Ok(me)
    }

    fn map(file: &File) -> io::Result<Self> {
        Ok(Doorbell { map: memmap2::MmapOptions::new().populate().map_raw(file)? })
    }

    fn shared(&self) -> &Shared {
        // SAFETY: the mapping is page aligned, SIZE >= size_of::<Shared>() bytes long, lives as long as `self`,
        // and `Shared` holds only atomics (valid for any bit pattern, safe to share across processes).
        unsafe { &*(self.map.as_ptr() as *const Shared) }
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
        std::fs::write(&path, vec![0u8; SIZE as usize]).unwrap();
        assert!(Doorbell::open(&path).is_err());
        std::fs::write(&path, b"short").unwrap();
        assert!(Doorbell::open(&path).is_err());
    }
}

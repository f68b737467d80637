//! Thin wrappers over the raw `futex(2)` syscall.
//!
//! The futex words live in a `MAP_SHARED` file mapping used by two processes,
//! so the private flag (`FUTEX_PRIVATE_FLAG`) must NOT be used: private
//! futexes are keyed by virtual address within one process only.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `*word == expected`, at most `timeout` (forever if `None`).
///
/// Returns `false` only if the timeout expired; `true` for a wake-up, a value
/// mismatch (`EAGAIN`) or a signal (`EINTR`). Callers must re-check their
/// condition either way: spurious returns are allowed.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) -> bool {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: libc::time_t::try_from(d.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts.as_ref().map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a valid, aligned u32 for the duration of the call and
    // `ts_ptr` is null or points to a live timespec; FUTEX_WAIT only reads them.
    let rc = unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, ts_ptr, std::ptr::null::<u32>(), 0u32)
    };
    if rc == 0 {
        return true;
    }
    std::io::Error::last_os_error().raw_os_error() != Some(libc::ETIMEDOUT)
}

/// Wakes up to `n` waiters sleeping on `word`; returns how many were woken.
pub fn futex_wake(word: &AtomicU32, n: i32) -> usize {
    // SAFETY: `word` is a valid, aligned u32; FUTEX_WAKE does not access
    // memory through the pointer, it only uses it as the wait-queue key.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            n,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    usize::try_from(rc).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Instant;

    #[test]
    fn wait_times_out_and_mismatch_returns() {
        let w = AtomicU32::new(5);
        let t = Instant::now();
        assert!(!futex_wait(&w, 5, Some(Duration::from_millis(20))));
        assert!(t.elapsed() >= Duration::from_millis(15));
        // Value differs: returns immediately without sleeping.
        assert!(futex_wait(&w, 4, None));
    }

    #[test]
    fn wake_wakes_a_sleeper() {
        let w = Arc::new(AtomicU32::new(0));
        let w2 = w.clone();
        let h = std::thread::spawn(move || {
            while w2.load(Ordering::SeqCst) == 0 {
                futex_wait(&w2, 0, Some(Duration::from_secs(10)));
            }
            Instant::now()
        });
        std::thread::sleep(Duration::from_millis(20));
        let sent = Instant::now();
        w.store(1, Ordering::SeqCst);
        futex_wake(&w, 1);
        let woke = h.join().unwrap();
        // Not a timing assertion; just report the latency for eyeballing.
        eprintln!("futex wake latency: {:?}", woke.saturating_duration_since(sent));
    }
}

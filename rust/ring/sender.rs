//! Never-blocking, thread-safe producer for the async server.
//!
//! `send` pushes straight into the ring when nothing is queued; otherwise
//! (or when the ring is full) the record goes to an in-process backlog that
//! a dedicated thread flushes in order with `push_blocking`, sleeping on the
//! ring's space futex. Record order is always preserved: the fast path is
//! only taken when the backlog is empty AND no record is in flight.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{Ring, RingError};

/// How often the flusher, while blocked on a full ring, checks for `Drop`.
const STOP_POLL: Duration = Duration::from_millis(100);

struct State {
    backlog: VecDeque<(u32, Vec<u8>)>,
    /// The flusher popped a record and is pushing it.
    in_flight: bool,
    stopped: bool,
}

/// Called after each record lands in the ring: wakes a consumer that sleeps on something other than the ring.
pub type OnPush = Box<dyn Fn() + Send + Sync>;

struct Shared {
    ring: Arc<Ring>,
    on_push: OnPush,
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub struct Sender {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Sender {
    pub fn new(ring: Arc<Ring>, on_push: OnPush) -> Sender {
        let shared = Arc::new(Shared {
            ring,
            on_push,
            state: Mutex::new(State { backlog: VecDeque::new(), in_flight: false, stopped: false }),
            wake: Condvar::new(),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("ring-sender".into())
            .spawn(move || flush_loop(&s))
            .expect("spawn ring sender thread");
        Sender { shared, thread: Some(thread) }
    }

    pub fn ring(&self) -> &Arc<Ring> {
        &self.shared.ring
    }

    /// Queues one record; never blocks on the ring. Errors: `Closed` once
    /// the ring is closed, `TooLarge` for a record that can never fit.
    pub fn send(&self, kind: u32, payload: Vec<u8>) -> Result<(), RingError> {
        self.send_then(kind, payload, true)
    }

    /// `send`, but a record that lands in the ring at once wakes nobody unless `notify`: the caller wakes the
    /// consumer itself (`notify`) after a batch, so that a rank woken by the batch's first record finds it whole.
    pub fn send_then(&self, kind: u32, payload: Vec<u8>, notify: bool) -> Result<(), RingError> {
        let ring = &self.shared.ring;
        if payload.len() > ring.max_payload() {
            return Err(RingError::TooLarge { len: payload.len(), max: ring.max_payload() });
        }
        let mut st = self.shared.lock();
        if ring.is_closed() {
            return Err(RingError::Closed);
        }
        if st.backlog.is_empty() && !st.in_flight && ring.try_push(kind, &[&payload])? {
            drop(st);
            if notify {
                (self.shared.on_push)();
            }
            return Ok(());
        }
        st.backlog.push_back((kind, payload));
        drop(st);
        self.shared.wake.notify_one();
        Ok(())
    }

    /// Wake the consumer as a record's landing would (after `send_then(.., false)`).
    pub fn notify(&self) {
        (self.shared.on_push)();
    }

    /// Records queued in process and not yet in the ring.
    pub fn backlog_len(&self) -> usize {
        let st = self.shared.lock();
        st.backlog.len() + usize::from(st.in_flight)
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.shared.lock().stopped = true;
        self.shared.wake.notify_one();
        // Detach: dropping must not block the (async) caller. The flusher
        // notices `stopped` within STOP_POLL and exits.
        drop(self.thread.take());
    }
}

fn flush_loop(sh: &Shared) {
    loop {
        let (kind, payload) = {
            let mut st = sh.lock();
            while st.backlog.is_empty() && !st.stopped {
                st = sh.wake.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.stopped && st.backlog.is_empty() {
                return;
            }
            st.in_flight = true;
            st.backlog.pop_front().expect("backlog is non-empty")
        };
        let result = loop {
            match sh.ring.push_blocking(kind, &[&payload], Some(STOP_POLL)) {
                Err(RingError::Timeout) if !sh.lock().stopped => continue,
                r => break r,
            }
        };
        if result.is_ok() {
            (sh.on_push)();
        }
        let mut st = sh.lock();
        st.in_flight = false;
        match result {
            Ok(()) => {}
            // Closed, or dropped while the ring stayed full: nobody will
            // ever consume the rest.
            Err(_) => {
                st.backlog.clear();
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::records::{SHUTDOWN, SUBMIT};

    fn ring(cap: u64) -> (tempfile::TempDir, Arc<Ring>) {
        let dir = tempfile::tempdir().unwrap();
        let r = Ring::create(dir.path().join("r"), cap).unwrap();
        (dir, Arc::new(r))
    }

    #[test]
    fn preserves_order_through_backlog() {
        let (_d, r) = ring(4096);
        let tx = Sender::new(r.clone(), Box::new(|| {}));
        let n = 5000u32;
        let consumer = {
            let r = r.clone();
            std::thread::spawn(move || {
                let mut next = 0u32;
                while next < n {
                    // Slow consumer: lets the ring fill so the backlog is used.
                    if next.is_multiple_of(500) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    r.wait_readable(Some(Duration::from_secs(5)));
                    r.drain(256, |k, p| {
                        assert_eq!(k, SUBMIT);
                        assert_eq!(p, next.to_le_bytes().repeat(1 + next as usize % 7));
                        next += 1;
                    })
                    .unwrap();
                }
            })
        };
        let mut saw_backlog = false;
        for i in 0..n {
            tx.send(SUBMIT, i.to_le_bytes().repeat(1 + i as usize % 7)).unwrap();
            saw_backlog |= tx.backlog_len() > 0;
        }
        consumer.join().unwrap();
        assert!(saw_backlog, "test never exercised the backlog path");
        // The flusher clears `in_flight` just after its last push lands.
        for _ in 0..500 {
            if tx.backlog_len() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(tx.backlog_len(), 0);
    }

    #[test]
    fn on_push_runs_once_the_record_is_in_the_ring_on_either_path() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (_d, r) = ring(4096);
        let pushed = Arc::new(AtomicUsize::new(0));
        let counter = pushed.clone();
        let tx = Sender::new(r.clone(), Box::new(move || _ = counter.fetch_add(1, Ordering::SeqCst)));
        tx.send(SUBMIT, vec![1; 8]).unwrap(); // fast path: the record is readable when on_push runs
        assert_eq!(pushed.load(Ordering::SeqCst), 1);
        assert!(r.used_bytes() > 0);
        let mut sent = 1;
        while tx.backlog_len() == 0 {
            tx.send(SUBMIT, vec![2; 64]).unwrap(); // until the ring is full and records queue
            sent += 1;
        }
        let fast = pushed.load(Ordering::SeqCst);
        assert!(fast < sent);
        let mut drained = 0;
        while drained < sent {
            r.wait_readable(Some(Duration::from_secs(5)));
            drained += r.drain(usize::MAX, |_, _| {}).unwrap();
        }
        // The flusher pushed the queued records once there was room, and calls on_push for each just after.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while pushed.load(Ordering::SeqCst) < sent && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(pushed.load(Ordering::SeqCst), sent);
    }

    #[test]
    fn closed_ring_stops_sender() {
        let (_d, r) = ring(4096);
        let tx = Sender::new(r.clone(), Box::new(|| {}));
        for _ in 0..200 {
            tx.send(SHUTDOWN, vec![0; 64]).unwrap();
        }
        assert!(tx.backlog_len() > 0);
        r.close();
        assert_eq!(tx.send(SHUTDOWN, vec![]), Err(RingError::Closed));
        for _ in 0..100 {
            if tx.backlog_len() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(tx.backlog_len(), 0);
        let big = vec![0; 4096];
        assert!(matches!(tx.send(SUBMIT, big), Err(RingError::TooLarge { .. })));
    }
}

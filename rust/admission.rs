//! Admission control: DP × max_num_seqs requests in flight. Past that, a request waits in an optional bounded
//! queue (`--max-queued-requests`, FIFO within `priority`, lower first as in vLLM) for at most `--queue-timeout`,
//! or gets 429 at once when there is no queue or it is full.
//!
//! A slot that frees goes straight to the head of the queue (the permit is handed over, never returned to a pool
//! a newcomer could grab first), so `in_flight` stays at capacity while anyone waits. A waiter whose request is
//! dropped (its client disconnected) leaves the queue at once.
//!
//! Batch lines (`/v1/batches`) take only idle capacity: a slot that is free while nobody waits
//! (`try_admit_batch`), held preemptibly. A client's request that finds no free slot takes one from a batch line
//! instead of waiting or getting a 429: the line is told to stop (its runner aborts it and runs it again later),
//! and its slot is handed to the request the moment the abort frees it. So that this is rare, batch lines leave
//! free as many slots as clients' requests held at their recent peak, and one more; and while clients are about,
//! batch lines take at most half of the rest (each sequence in a step makes the step longer for all).
//!
//! Paused (`/pause_generation`, vLLM's `/pause`), nothing is admitted: a client's request waits at the gate, with no
//! 429 and no 503 even with no queue configured, and its queue timeout counts only from the resume (a pause is the
//! operator's, not the load's). Past the gate it joins the queue even when the queue is off or full: it already
//! waited. Batch lines take no slot while paused.

use crate::error::ApiError;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

#[derive(Clone)]
pub struct Admission {
    inner: Arc<Inner>,
}

struct Inner {
    capacity: usize,
    max_queued: usize,
    queue_timeout: Option<Duration>,
    state: Mutex<State>,
    /// Rung when a slot becomes free (nobody waited for it): the batch lane deals it at once (`slot_freed`).
    freed: tokio::sync::Notify,
    /// True while generation is paused; requests wait for it to turn false (`admit`).
    paused: tokio::sync::watch::Sender<bool>,
    /// Requests waiting at the paused gate (reported as queued).
    gated: AtomicUsize,
}

/// Waiters in admission order: (priority, arrival sequence) → where to hand the slot.
#[derive(Default)]
struct State {
    in_flight: usize,
    next_seq: u64,
    queue: BTreeMap<(i64, u64), oneshot::Sender<Result<Permit, ApiError>>>,
    /// Slots batch lines hold, by line: how to tell each to give its slot up.
    batch: BTreeMap<u64, oneshot::Sender<()>>,
    /// The most requests (not batch lines) in flight lately, and when that was seen: batch lines leave that many
    /// slots and one more free, so clients find a slot rather than take one from a line.
    recent: (usize, Option<Instant>),
}

/// How long a peak of clients' requests keeps its slots free of batch lines.
const RECENT: Duration = Duration::from_secs(5);

impl State {
    /// Note the clients' requests in flight now (one was just admitted).
    fn clients_in_flight(&mut self) {
        let now = Instant::now();
        let clients = self.in_flight - self.batch.len();
        let lapsed = self.recent.1.is_none_or(|at| now - at > RECENT);
        if lapsed || clients >= self.recent.0 {
            self.recent = (clients, Some(now));
        }
    }

    /// Slots batch lines leave free: the recent peak of clients' requests and one more; none if there was none.
    fn reserve(&self) -> usize {
        match self.recent.1 {
            Some(at) if at.elapsed() <= RECENT && self.recent.0 > 0 => self.recent.0 + 1,
            _ => 0,
        }
    }
}

/// Held for a request's whole life; dropping it frees the slot, or hands it to the head of the queue.
pub struct Permit {
    inner: Option<Arc<Inner>>,
    /// A batch line's slot: its key in `State::batch`.
    batch: Option<u64>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            inner.release(self.batch);
        }
    }
}

impl Inner {
    fn release(self: Arc<Self>, batch: Option<u64>) {
        let mut st = self.state.lock().unwrap();
        if let Some(line) = batch {
            st.batch.remove(&line);
        }
        while let Some((_, tx)) = st.queue.pop_first() {
            match tx.send(Ok(Permit { inner: Some(self.clone()), batch: None })) {
                Ok(()) => {
                    st.clients_in_flight();
                    return; // the slot stays taken, by the waiter
                }
                // The waiter is gone (its guard had not yet removed it): defuse the permit and try the next one.
                Err(Ok(mut p)) => drop(p.inner.take()),
                Err(Err(_)) => unreachable!("only slots are sent here"),
            }
        }
        st.in_flight -= 1;
        self.freed.notify_one();
    }
}

/// Counts a request at the paused gate while it waits there.
struct Gated<'a>(&'a AtomicUsize);

impl Drop for Gated<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Removes a waiter from the queue when its request ends first (timeout, client gone).
struct Waiting<'a> {
    inner: &'a Inner,
    key: (i64, u64),
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.inner.state.lock().unwrap().queue.remove(&self.key);
    }
}

impl Admission {
    /// No queue: the next request past capacity gets 429 at once (the seed's behaviour).
    pub fn new(capacity: usize) -> Self {
        Self::with_queue(capacity, 0, None)
    }

    pub fn with_queue(capacity: usize, max_queued: usize, queue_timeout: Option<Duration>) -> Self {
        let inner = Inner {
            capacity,
            max_queued,
            queue_timeout,
            state: Mutex::default(),
            freed: Default::default(),
            paused: tokio::sync::watch::Sender::new(false),
            gated: AtomicUsize::new(0),
        };
        Admission { inner: Arc::new(inner) }
    }

    /// Never waits: a slot now, or 429 (also while paused: the caller then waits in `admit`).
    pub fn try_admit(&self) -> Result<Permit, ApiError> {
        if self.is_paused() {
            return Err(ApiError::Overloaded(self.inner.capacity));
        }
        let mut st = self.inner.state.lock().unwrap();
        let permit = self.take_free(&mut st).ok_or(ApiError::Overloaded(self.inner.capacity))?;
        st.clients_in_flight();
        Ok(permit)
    }

    /// A slot now, or a place in the queue until one frees (429 when the queue is full or the wait times out; a
    /// `sibling`, a further sequence of a fan-out, `path::Origin::Sibling`, waits past the queue's bound).
    /// Dropping the future leaves the queue.
    pub async fn admit(&self, priority: i64, sibling: bool) -> Result<Permit, ApiError> {
        let waited = self.wait_resumed().await;
        let (key, rx) = {
            let mut st = self.inner.state.lock().unwrap();
            if let Some(p) = self.take_free(&mut st) {
                st.clients_in_flight();
                return Ok(p);
            }
            // A batch line gives its slot up; this request waits only for the line's abort, first in the queue.
            let preempted = st.batch.pop_last().map(|(_, stop)| stop.send(()));
            let priority = if preempted.is_some() { i64::MIN } else { priority };
            if preempted.is_none() && !waited && !sibling && st.queue.len() >= self.inner.max_queued {
                return Err(match self.inner.max_queued {
                    0 => ApiError::Overloaded(self.inner.capacity),
                    n => ApiError::QueueFull(n),
                });
            }
            let key = (priority, st.next_seq);
            st.next_seq += 1;
            let (tx, rx) = oneshot::channel();
            st.queue.insert(key, tx);
            (key, rx)
        };
        let _waiting = Waiting { inner: &self.inner, key };
        let handed = match self.inner.queue_timeout {
            Some(t) => tokio::time::timeout(t, rx).await.map_err(|_| ApiError::QueueTimeout(t.as_secs_f64()))?,
            None => rx.await,
        };
        // The sender lives in the queue until it sends: a closed channel cannot happen.
        handed.map_err(|_| ApiError::Internal)?
    }

    /// Stop admitting: new requests wait at the gate until `resume`.
    pub fn pause(&self) {
        self.inner.paused.send_replace(true);
    }

    pub fn resume(&self) {
        self.inner.paused.send_replace(false);
    }

    pub fn is_paused(&self) -> bool {
        *self.inner.paused.borrow()
    }

    /// Wait while paused; true if it had to.
    async fn wait_resumed(&self) -> bool {
        let mut rx = self.inner.paused.subscribe();
        if !*rx.borrow_and_update() {
            return false;
        }
        self.inner.gated.fetch_add(1, Ordering::Relaxed);
        let _gated = Gated(&self.inner.gated); // a request dropped at the gate (client gone) leaves the count
        let _ = rx.wait_for(|paused| !paused).await; // the sender lives in `Inner`, as long as `self`
        true
    }

    /// Refuse every waiting request with `why` (the server is shutting down: a gateway retries them elsewhere).
    pub fn refuse_waiting(&self, why: impl Fn() -> ApiError) {
        let waiters = std::mem::take(&mut self.inner.state.lock().unwrap().queue);
        for (_, tx) in waiters {
            let _ = tx.send(Err(why()));
        }
    }

    /// A batch line's slot: only one free while nobody waits; the receiver fires when a client's request takes it.
    pub fn try_admit_batch(&self) -> Option<(Permit, oneshot::Receiver<()>)> {
        if self.is_paused() {
            return None;
        }
        let mut st = self.inner.state.lock().unwrap();
        let reserve = st.reserve();
        if st.in_flight + reserve >= self.inner.capacity {
            return None;
        }
        // Beside clients, a quarter of what is left at most: every line a step carries costs the clients time (its
        // tokens pass the same codec thread and GIL as theirs). With no client about, the batch takes every slot.
        if reserve > 0 && st.batch.len() >= (self.inner.capacity - reserve).div_ceil(4) {
            return None;
        }
        let mut permit = self.take_free(&mut st)?;
        let line = st.next_seq;
        st.next_seq += 1;
        let (stop, stopped) = oneshot::channel();
        st.batch.insert(line, stop);
        permit.batch = Some(line);
        Some((permit, stopped))
    }

    /// Wait until a slot is freed that nobody waited for (or one was since the last call).
    pub async fn slot_freed(&self) {
        self.inner.freed.notified().await
    }

    /// Slots batch lines hold now.
    pub fn batch_in_flight(&self) -> usize {
        self.inner.state.lock().unwrap().batch.len()
    }

    fn take_free(&self, st: &mut State) -> Option<Permit> {
        // Nobody jumps the queue: a free slot with waiters is already theirs (`release` hands it over).
        (st.in_flight < self.inner.capacity && st.queue.is_empty()).then(|| {
            st.in_flight += 1;
            Permit { inner: Some(self.inner.clone()), batch: None }
        })
    }

    /// Requests holding a slot: running, or being converted and dispatched.
    pub fn in_flight(&self) -> usize {
        self.inner.state.lock().unwrap().in_flight
    }

    /// Requests waiting in the queue, or at the paused gate.
    pub fn queued(&self) -> usize {
        self.inner.state.lock().unwrap().queue.len() + self.inner.gated.load(Ordering::Relaxed)
    }

    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;

    #[test]
    fn capacity_plus_one_is_rejected_and_a_drop_frees_a_slot() {
        let a = Admission::new(2);
        let p1 = a.try_admit().unwrap();
        let _p2 = a.try_admit().unwrap();
        assert!(matches!(a.try_admit(), Err(ApiError::Overloaded(2))));
        assert_eq!(a.in_flight(), 2);
        drop(p1);
        assert!(a.try_admit().is_ok());
    }

    #[tokio::test]
    async fn a_request_takes_a_batch_lines_slot_instead_of_a_429() {
        let a = Admission::new(1);
        let (line, mut stopped) = a.try_admit_batch().unwrap();
        assert!(a.try_admit_batch().is_none(), "a batch line takes only a free slot");
        let a4 = Admission::new(4);
        let client = a4.try_admit().unwrap();
        let lines: Vec<_> = std::iter::from_fn(|| a4.try_admit_batch()).collect();
        assert_eq!(lines.len(), 1, "a client's peak of 1 keeps 2 slots free, and lines take half the rest");
        drop((client, lines));
        let waiter = a.clone();
        let request = tokio::spawn(async move { waiter.admit(0, false).await.map(drop) });
        while stopped.try_recv().is_err() {
            tokio::task::yield_now().await;
        }
        assert_eq!(a.queued(), 1);
        drop(line); // its runner aborts it
        request.await.unwrap().unwrap();
        assert_eq!((a.in_flight(), a.batch_in_flight()), (0, 0));
    }

    #[tokio::test]
    async fn without_a_queue_admit_refuses_at_once() {
        let a = Admission::new(1);
        let _p = a.admit(0, false).await.unwrap();
        assert!(matches!(a.admit(0, false).await, Err(ApiError::Overloaded(1))));
    }

    #[tokio::test]
    async fn a_freed_slot_goes_to_the_lowest_priority_then_the_oldest() {
        let a = Admission::with_queue(1, 8, None);
        let held = a.admit(0, false).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (name, prio) in [("late-normal", 0), ("urgent", -5), ("later-normal", 0), ("low", 3)] {
            let (waiter, order) = (a.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let p = waiter.admit(prio, false).await.unwrap();
                order.lock().unwrap().push(name);
                drop(p);
            }));
            while a.queued() < tasks.len() {
                tokio::task::yield_now().await;
            }
        }
        assert_eq!(a.in_flight(), 1);
        // A newcomer does not jump the queue while the slot is held, nor after it frees.
        assert!(a.try_admit().is_err());
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["urgent", "late-normal", "later-normal", "low"]);
        assert_eq!((a.in_flight(), a.queued()), (0, 0));
    }

    #[tokio::test]
    async fn a_full_queue_and_a_long_wait_are_refused_and_a_dropped_waiter_leaves() {
        let a = Admission::with_queue(1, 1, Some(Duration::from_millis(50)));
        let held = a.admit(0, false).await.unwrap();
        let waiter = tokio::spawn({
            let a = a.clone();
            async move { a.admit(0, false).await.map(drop) }
        });
        while a.queued() == 0 {
            tokio::task::yield_now().await;
        }
        assert!(matches!(a.admit(0, false).await, Err(ApiError::QueueFull(1))));
        assert!(matches!(waiter.await.unwrap(), Err(ApiError::QueueTimeout(_))));
        assert_eq!(a.queued(), 0);

        // A waiter whose future is dropped (client gone) leaves the queue at once, and the slot is not lost.
        let mut fut = Box::pin(a.admit(0, false));
        assert!(futures_poll_once(&mut fut).await.is_none());
        assert_eq!(a.queued(), 1);
        drop(fut);
        assert_eq!(a.queued(), 0);
        drop(held);
        assert_eq!(a.in_flight(), 0);
        assert!(a.try_admit().is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn paused_requests_wait_without_a_queue_and_their_timeout_counts_from_the_resume() {
        let a = Admission::with_queue(1, 0, Some(Duration::from_millis(50)));
        a.pause();
        assert!(a.try_admit().is_err() && a.try_admit_batch().is_none());
        let wait = |a: Admission| tokio::spawn(async move { a.admit(0, false).await.map(drop) });
        let waiters = [wait(a.clone()), wait(a.clone())];
        tokio::time::sleep(Duration::from_secs(5)).await; // far past the queue timeout
        assert_eq!((a.queued(), a.in_flight()), (2, 0));
        a.resume();
        for w in waiters {
            w.await.unwrap().unwrap(); // neither a 429 (no queue) nor a queue timeout
        }
        assert_eq!((a.queued(), a.in_flight()), (0, 0));
    }

    /// Poll a future once: `Some` if it finished.
    async fn futures_poll_once<F: Future + Unpin>(f: &mut F) -> Option<F::Output> {
        std::future::poll_fn(|cx| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut *f).poll(cx) {
                std::task::Poll::Ready(v) => Some(v),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }
}

//! The batch lane's fair share (issue 39): the slots batch lines may take (`Admission::try_admit_batch`) are dealt
//! round-robin, one at a time, to the batches this replica runs, whoever created them. A batch of one line created
//! behind a batch of thousands gets the next slot that frees (a new batch goes first in the turn), not the slots
//! left after the big one ends; two big batches advance side by side.
//!
//! One task deals (`Lane::deal_forever`): it is the only one that waits on `Admission::slot_freed`, so a freed
//! slot is never raced for by the batches themselves. Each batch holds a `Seat`: it says whether it has a line to
//! run (`want`), and takes its slots from the seat (`slot`), at most one waiting there at a time, so a batch never
//! sits on slots it has not used yet while others wait.

use crate::admission::Permit;
use crate::path::AppState;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, mpsc, oneshot};

/// A batch line's slot: the permit, and what fires when a client's request takes it back.
pub type Slot = (Permit, oneshot::Receiver<()>);

/// The dealer looks at least this often (the clients' reserve shrinks with time, not with a release).
const LOOK_EVERY: Duration = Duration::from_millis(100);

#[derive(Default)]
pub struct Lane {
    /// The seats in turn order: the next slot goes to the first that wants one and holds none unused.
    turn: Mutex<VecDeque<Arc<Place>>>,
    /// Rung when a seat starts wanting slots.
    bell: Notify,
}

/// A seat as the dealer sees it.
struct Place {
    wants: AtomicBool,
    tx: mpsc::Sender<Slot>,
}

/// A batch's place in the lane; leaving it (dropping it) gives back any slot dealt to it and not taken.
pub struct Seat {
    place: Arc<Place>,
    rx: mpsc::Receiver<Slot>,
    lane: Arc<Lane>,
}

impl Lane {
    /// A seat for a batch that starts running: first in the turn, so its first line waits for one freed slot only.
    pub fn join(self: &Arc<Self>) -> Seat {
        let (tx, rx) = mpsc::channel(1);
        let place = Arc::new(Place { wants: AtomicBool::new(false), tx });
        self.turn.lock().unwrap().push_front(place.clone());
        Seat { place, rx, lane: self.clone() }
    }

    /// Deal free slots for as long as this replica runs.
    pub async fn deal_forever(self: Arc<Self>, st: Arc<AppState>) {
        loop {
            // None while the server drains or a rank is down: the lines wait.
            if st.unavailable().is_none() {
                self.deal(&st.admission);
            }
            // With no batch wanting a slot, only a seat that starts wanting one wakes the dealer: an idle replica
            // is not woken ten times a second for nothing.
            if !self.anyone_wants() {
                self.bell.notified().await;
                continue;
            }
            tokio::select! {
                () = st.admission.slot_freed() => {}
                () = self.bell.notified() => {}
                () = tokio::time::sleep(LOOK_EVERY) => {}
            }
        }
    }

    fn anyone_wants(&self) -> bool {
        self.turn.lock().unwrap().iter().any(|p| p.wants.load(Ordering::Acquire))
    }

    /// Hand out free slots one at a time, each to the next seat in turn that wants one, until none is free or no
    /// seat wants one. A seat served goes to the back of the turn.
    fn deal(&self, admission: &crate::admission::Admission) {
        let mut turn = self.turn.lock().unwrap();
        loop {
            let Some(at) = turn.iter().position(|p| p.wants.load(Ordering::Acquire) && p.tx.capacity() > 0) else {
                return;
            };
            let Some(slot) = admission.try_admit_batch() else { return };
            let place = turn.remove(at).expect("a position found in it");
            // Only this task sends, and the seat had room: this fails only for a seat left meanwhile, and then the
            // slot is dropped, so freed again for the next.
            let _ = place.tx.try_send(slot);
            turn.push_back(place);
        }
    }
}

impl Seat {
    /// Whether the batch has a line to run now (a slot dealt to it is otherwise given back).
    pub fn want(&self, wants: bool) {
        if !self.place.wants.swap(wants, Ordering::AcqRel) && wants {
            self.lane.bell.notify_one();
        }
    }

    /// The next slot dealt to this batch.
    pub async fn slot(&mut self) -> Option<Slot> {
        self.rx.recv().await
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.lane.turn.lock().unwrap().retain(|p| !Arc::ptr_eq(p, &self.place));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::Admission;

    #[tokio::test]
    async fn slots_go_round_robin_and_a_new_batch_goes_first() {
        let lane = Arc::new(Lane::default());
        let admission = Admission::new(3);
        let (mut big, mut other) = (lane.join(), lane.join());
        big.want(true);
        other.want(true);
        lane.deal(&admission);
        // One slot waits in each seat at most: the third stays free until one is taken.
        assert_eq!(admission.in_flight(), 2);
        let (a, b) = (big.slot().await.unwrap(), other.slot().await.unwrap());
        lane.deal(&admission);
        assert_eq!(admission.in_flight(), 3);
        let newcomer = lane.join();
        newcomer.want(true);
        drop(a); // a line of one of the first two ends: its slot goes to the newcomer, first in the turn
        lane.deal(&admission);
        let mut newcomer = newcomer;
        let first = newcomer.rx.try_recv();
        assert!(first.is_ok(), "the newcomer had the freed slot");
        drop((b, big, other)); // a seat left gives back the slot it was dealt and did not take
        assert_eq!(admission.in_flight(), 1);
        drop(first);
    }
}

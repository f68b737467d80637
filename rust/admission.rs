//! Admission control: DP × max_num_seqs requests in flight, the next one gets 429 at once.

use crate::error::ApiError;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

#[derive(Clone)]
pub struct Admission {
    slots: Arc<Semaphore>,
    capacity: usize,
}

/// Held for a request's whole life; dropping it frees the slot.
pub type Permit = OwnedSemaphorePermit;

impl Admission {
    pub fn new(capacity: usize) -> Self {
        Admission { slots: Arc::new(Semaphore::new(capacity)), capacity }
    }

    /// Never waits: a full server answers 429 instead of queueing unboundedly.
    pub fn try_admit(&self) -> Result<Permit, ApiError> {
        self.slots.clone().try_acquire_owned().map_err(|_| ApiError::Overloaded(self.capacity))
    }

    pub fn in_flight(&self) -> usize {
        self.capacity - self.slots.available_permits()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}

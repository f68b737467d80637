//! A batch's status and the moves between them (OpenAI's Batch lifecycle): `validating` to `in_progress` (or
//! `failed`, a line at fault), then `finalizing` (its results files), then `completed` (or `failed`, a results file
//! that did not fit); `expired` past its window; `cancelling` when asked, then `cancelled`. Each move stamps its
//! `<status>_at` time; an ended batch moves no more.

use super::object::Batch;
pub use crate::store::batch_status::BatchStatus;

/// A move the lifecycle has not: the batch keeps its status.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("a batch cannot move from {from} to {to}")]
pub struct Unmoved {
    pub from: BatchStatus,
    pub to: BatchStatus,
}

impl Batch {
    /// Move the batch to `to`, stamping its `<status>_at` time (`in_progress_at`, `completed_at`, ...); a move the
    /// lifecycle has not (from an ended batch, or back) leaves it as it was.
    pub fn set_status(&mut self, to: BatchStatus, now: i64) -> Result<(), Unmoved> {
        if !self.status.can_move_to(to) {
            return Err(Unmoved { from: self.status, to });
        }
        self.status = to;
        if let Some(at) = self.stamp(to) {
            *at = Some(now);
        }
        Ok(())
    }

    /// When the batch reached `status` (None for `validating`: a batch starts there, at `created_at`).
    pub fn reached(&self, status: BatchStatus) -> Option<i64> {
        match status {
            BatchStatus::Validating => None,
            BatchStatus::Failed => self.failed_at,
            BatchStatus::InProgress => self.in_progress_at,
            BatchStatus::Finalizing => self.finalizing_at,
            BatchStatus::Completed => self.completed_at,
            BatchStatus::Expired => self.expired_at,
            BatchStatus::Cancelling => self.cancelling_at,
            BatchStatus::Cancelled => self.cancelled_at,
        }
    }

    fn stamp(&mut self, status: BatchStatus) -> Option<&mut Option<i64>> {
        match status {
            BatchStatus::Validating => None,
            BatchStatus::Failed => Some(&mut self.failed_at),
            BatchStatus::InProgress => Some(&mut self.in_progress_at),
            BatchStatus::Finalizing => Some(&mut self.finalizing_at),
            BatchStatus::Completed => Some(&mut self.completed_at),
            BatchStatus::Expired => Some(&mut self.expired_at),
            BatchStatus::Cancelling => Some(&mut self.cancelling_at),
            BatchStatus::Cancelled => Some(&mut self.cancelled_at),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::BatchStatus::*;
    use super::*;
    use serde_json::Map;

    /// A batch standing at `status`, reached through the lifecycle's own moves.
    fn at(status: BatchStatus) -> Batch {
        let mut b = Batch::new("batch_1", "/v1/responses", "file-1", Map::new(), 100);
        let path: &[BatchStatus] = match status {
            Validating => &[],
            InProgress | Cancelling => &[InProgress],
            Finalizing => &[InProgress, Finalizing],
            _ => &[],
        };
        for (i, s) in path.iter().enumerate() {
            b.set_status(*s, 101 + i as i64).unwrap();
        }
        b.status = status; // an ended one is set outright: no move leaves it
        b
    }

    #[test]
    fn every_move_stamps_its_time_and_only_its_own() {
        let mut moves = 0;
        for from in BatchStatus::ALL {
            for to in BatchStatus::ALL.into_iter().filter(|to| from.can_move_to(*to)) {
                let mut b = at(from);
                let before = b.clone();
                assert_eq!(b.set_status(to, 500), Ok(()), "{from} -> {to}");
                assert_eq!((b.status, b.reached(to)), (to, Some(500)), "{from} -> {to}");
                // Every other stamp is as it was.
                for other in BatchStatus::ALL.into_iter().filter(|s| *s != to) {
                    assert_eq!(b.reached(other), before.reached(other), "{from} -> {to} moved {other}'s time");
                }
                moves += 1;
            }
        }
        assert_eq!(moves, 12, "the lifecycle's moves");
        let mut b = at(Validating);
        for (to, now) in [(InProgress, 1), (Finalizing, 2), (Completed, 3)] {
            b.set_status(to, now).unwrap();
        }
        assert_eq!((b.in_progress_at, b.finalizing_at, b.completed_at), (Some(1), Some(2), Some(3)));
    }

    #[test]
    fn an_ended_batch_refuses_to_move_and_keeps_its_time() {
        for from in BatchStatus::ALL.into_iter().filter(|s| s.ended()) {
            for to in BatchStatus::ALL {
                let mut b = at(from);
                *b.stamp(from).unwrap() = Some(42);
                let before = b.clone();
                assert_eq!(b.set_status(to, 500), Err(Unmoved { from, to }));
                assert_eq!(b, before, "{from} -> {to} changed the batch");
            }
        }
        // Nor does one go back, or cancel twice.
        for (from, to) in [(InProgress, Validating), (Finalizing, InProgress), (Cancelling, Cancelling)] {
            assert!(at(from).set_status(to, 1).is_err(), "{from} -> {to}");
        }
    }
}

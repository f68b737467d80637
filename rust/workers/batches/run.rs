//! Running one batch on this replica, from wherever it stands: `validating` (check every line), `in_progress`
//! (each line not yet done through the one request path, in a batch line's slot dealt by the lane: only idle
//! capacity, shared round-robin with the other batches running here, given up to any client's request that needs
//! it, and run again later), `finalizing` (the output and error files), or `cancelling`. Results are recorded as
//! lines finish, one row per line, so a replica that dies loses only the lines in flight, and a line that runs twice
//! (a takeover) counts once. Every write names the run's claim (owner and generation): one refused, or a renewal
//! that finds the claim gone, means another replica took the batch over, and this run stops at once. A drain
//! releases the claim as it begins.

use super::input::InputLines;
use super::lane::Lane;
use super::line::{next_line, run_line};
use super::object::{Batch, BatchErrors, BatchStatus, Line, door, parse_line};
use super::traced::LineTraces;
use crate::owner::Owner;
use crate::path::AppState;
use crate::store::hand_over::Handing;
use crate::store::queries::batches::Claim;
use crate::store::{Store, StoreError, items};
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinSet;

/// How often a running batch looks whether it is time to record, when nothing else happens.
const LOOK_EVERY: Duration = Duration::from_millis(100);
/// How often it writes its counts, reads a cancel and renews its claim (results are written as lines finish).
const RECORD_EVERY: Duration = Duration::from_secs(1);
/// A claim is taken as surely held only while its last renewal is this much younger than the lease: the replicas'
/// clocks may differ by about that much. Past it (this process was paused, or the store did not answer) the run
/// starts no line before a renewal succeeds.
const LEASE_MARGIN: Duration = Duration::from_secs(1);
/// The log target of each line a batch starts (at debug): `RUST_LOG=info,batch_lines=debug` shows which replica
/// ran which line under which claim.
const LINES_LOG: &str = "batch_lines";

pub struct Runner {
    pub st: Arc<AppState>,
    pub store: Arc<Store>,
    pub owner: String,
    /// Where its batches' lines get their slots.
    pub lane: Arc<Lane>,
}

/// A line run: the line, and its outcome (succeeded, result line), or None if its slot was taken.
type Ran = (Line, Option<(bool, String)>);

enum Stop {
    Done,
    Cancel,
    Expire,
    /// Its results would pass what its owner's files (or all files) may hold: it takes no more lines.
    Full(String),
    /// Another replica took the batch over (this run's claim was refused): nothing more is written.
    Lost,
    /// The server drains: the claim is released, the guard kept until it is written.
    Release(Handing),
}

/// The error a batch ends `failed` with when its output would not fit.
pub(super) const FULL: &str = "file_storage_limit_exceeded";

/// The claim a run holds, and when it was last taken or renewed by this replica's clock.
pub(super) struct Lease<'a> {
    pub(super) claim: Claim<'a>,
    renewed: Instant,
    span: Duration,
}

impl Lease<'_> {
    /// Whether the claim surely still holds, so a line may start under it.
    fn sure(&self) -> bool {
        self.renewed.elapsed() + LEASE_MARGIN < self.span
    }
}

impl Runner {
    /// Run a batch under the claim taken as `generation` (at `taken`, by this replica's clock), until it ends, the
    /// claim is lost, or the drain releases it.
    pub async fn run(&self, id: &str, generation: i64, taken: Instant) -> Result<(), StoreError> {
        let claim = Claim { owner: &self.owner, generation };
        let span = Duration::from_secs(self.store.lease_s.max(1) as u64);
        let mut lease = Lease { claim, renewed: taken, span };
        loop {
            if self.store.hand_over.has_begun() {
                return self.release(id, claim, self.store.hand_over.handing()).await;
            }
            let Some(row) = self.store.db.get_batch(id).await? else { return Ok(()) };
            let mut batch = row.load()?;
            let now = items::now();
            let whose = Owner::from_stored(&row.owned_by);
            let was = batch.status;
            let next = match was {
                BatchStatus::Validating => self.validate(&mut batch, &whose).await?,
                BatchStatus::InProgress if now > batch.expires_at => BatchStatus::Expired,
                BatchStatus::InProgress => {
                    match self.lines(id, &mut batch, &whose, row.trace_context.as_deref(), &mut lease).await? {
                        Stop::Done => BatchStatus::Finalizing,
                        Stop::Cancel => BatchStatus::Cancelling,
                        Stop::Expire => BatchStatus::Expired,
                        Stop::Full(why) => {
                            // What ran is kept (it fits); the batch ends `failed`, saying why, once it is written.
                            batch.errors = Some(BatchErrors::of(&[(0, FULL, why)]));
                            BatchStatus::Finalizing
                        }
                        Stop::Lost => return Ok(()),
                        Stop::Release(handing) => return self.release(id, claim, handing).await,
                    }
                }
                BatchStatus::Finalizing | BatchStatus::Cancelling => {
                    let end = match was {
                        BatchStatus::Cancelling => BatchStatus::Cancelled,
                        _ if batch.errors.is_some() => BatchStatus::Failed,
                        _ => BatchStatus::Completed,
                    };
                    match self.finish(id, &mut batch, &whose, end, &mut lease).await? {
                        Some(BatchStatus::Completed) => BatchStatus::Completed,
                        // It ended otherwise and was written so, unless a cancel came first (then: again).
                        Some(_) if self.again(id, claim).await? => continue,
                        Some(_) | None => return Ok(()), // ended, or the claim was lost
                    }
                }
                _ => return Ok(()),
            };
            if next == BatchStatus::Expired {
                self.finish(id, &mut batch, &whose, BatchStatus::Expired, &mut lease).await?;
                return Ok(());
            }
            if let Err(e) = batch.set_status(next, items::now()) {
                tracing::error!(batch_id = %id, "a batch stopped: {e}");
                return Ok(());
            }
            // Only while this run holds the claim, and never over a cancel asked meanwhile (then: again).
            if !self.store.db.set_batch(id, was.as_str(), batch.status.as_str(), &batch.to_text(), Some(claim)).await? {
                if self.again(id, claim).await? {
                    continue;
                }
                return Ok(());
            }
            if next.ended() {
                return Ok(());
            }
        }
    }

    /// After a status write of this run's that may have been refused: whether to run the batch again, as a cancel
    /// asked meanwhile left it `cancelling` (and the claim still holds). Says so if the claim was lost.
    async fn again(&self, id: &str, claim: Claim<'_>) -> Result<bool, StoreError> {
        if !self.store.db.holds_batch(id, claim).await? {
            self.lost(id, claim, 0, 0);
            return Ok(false);
        }
        let current = self.store.db.get_batch(id).await?.map(|b| b.status);
        Ok(current == Some(BatchStatus::Cancelling))
    }

    /// Let the claim go as the drain begins, so another replica takes the batch at its next look; `handing` keeps
    /// the drain waiting until it is written.
    async fn release(&self, id: &str, claim: Claim<'_>, handing: Handing) -> Result<(), StoreError> {
        let released = self.store.db.release_batch(id, claim).await?;
        tracing::info!(batch_id = %id, generation = claim.generation, released, "released a batch's claim: the server drains");
        drop(handing);
        Ok(())
    }

    /// Say that this run lost its claim (another replica took the batch over) and stops: `refused` finished
    /// results not written, `aborted` lines in flight stopped.
    pub(super) fn lost(&self, id: &str, claim: Claim<'_>, refused: usize, aborted: usize) {
        tracing::warn!(
            batch_id = %id, generation = claim.generation, refused, aborted,
            "lost the claim on a batch (another replica took it over): stopped, writing nothing more"
        );
    }

    /// Renew the claim; false if it was lost.
    pub(super) async fn renew(&self, id: &str, lease: &mut Lease<'_>) -> Result<bool, StoreError> {
        let asked = Instant::now(); // the lease counts from no later than the renewal's asking
        let renewed = self.store.db.renew_batch(id, lease.claim, items::now() + self.store.lease_s).await?;
        if renewed {
            lease.renewed = asked;
        }
        Ok(renewed)
    }

    /// Check every line: `in_progress` with its count, or `failed` with the lines at fault.
    async fn validate(&self, batch: &mut Batch, whose: &Owner) -> Result<BatchStatus, StoreError> {
        let endpoint = batch.endpoint.clone();
        let mut errors = Vec::new();
        let mut ids = HashSet::new();
        let mut total = 0;
        let (lines_max, bounds) = (super::object::lines_max(&endpoint), self.st.config.json_bounds());
        match self.input(batch, whose).await {
            Ok(mut lines) => loop {
                let line = match lines.next_line().await {
                    Ok(Some(line)) => line,
                    Ok(None) => break,
                    Err(e) => {
                        errors.push((total, "line_too_long", e.to_string()));
                        break;
                    }
                };
                if total == lines_max {
                    errors.push((total, "too_many_lines", format!("a batch takes at most {lines_max} lines")));
                    break;
                }
                match parse_line(&line, &endpoint, bounds) {
                    Ok((custom_id, _)) if !ids.insert(custom_id.clone()) => {
                        errors.push((total, "duplicate_custom_id", format!("custom_id '{custom_id}' is used twice")))
                    }
                    Ok(_) => {}
                    Err((code, why)) => errors.push((total, code, why)),
                }
                total += 1;
                if errors.len() >= 100 {
                    break;
                }
            },
            Err(why) => errors.push((0, "invalid_file", why)),
        }
        if total == 0 && errors.is_empty() {
            errors.push((0, "empty_file", "the input file has no lines".into()));
        }
        if !errors.is_empty() {
            batch.errors = Some(BatchErrors::of(&errors));
            return Ok(BatchStatus::Failed);
        }
        batch.set_counts(total as i64, 0, 0);
        Ok(BatchStatus::InProgress)
    }

    /// The input file's lines, none read past `--max-batch-line-bytes`.
    async fn input(&self, batch: &Batch, whose: &Owner) -> Result<InputLines<tokio::fs::File>, String> {
        let (_, file) = self.store.file_content(&batch.input_file_id, whose).await.map_err(|e| e.to_string())?;
        Ok(InputLines::new(file, self.st.config.limits.max_batch_line_bytes))
    }

    /// What the batch's results may still grow by: the room left under the files total and under its owner's
    /// share (its output and error files will hold them). None: no cap.
    async fn room(&self, whose: &Owner) -> Result<Option<i64>, StoreError> {
        let Some(files) = &self.store.files else { return Ok(None) };
        let mut room: Option<i64> = None;
        if let Some(cap) = files.total_max {
            room = Some(cap as i64 - self.store.db.files_bytes(None).await?);
        }
        if let Some(cap) = files.owner_max {
            let left = cap as i64 - self.store.db.files_bytes(Some(whose.as_str())).await?;
            room = Some(room.map_or(left, |r| r.min(left)));
        }
        Ok(room)
    }

    /// Run every line not done yet, in the slots the lane deals it, until all are done, the batch is cancelled, it
    /// expires, or its results would not fit in the files (a line starts only while what the results hold, and
    /// the largest result so far for each line running and this one, fits); or until its claim is lost or the
    /// drain begins. Each result is written as its line finishes. `trace_context`: the span of the request that
    /// created it, which the lines' spans link to.
    async fn lines(
        &self,
        id: &str,
        batch: &mut Batch,
        whose: &Owner,
        trace_context: Option<&str>,
        lease: &mut Lease<'_>,
    ) -> Result<Stop, StoreError> {
        let endpoint = batch.endpoint.clone();
        let traces = LineTraces::new(&self.st, id, trace_context);
        let Some(door) = door(&endpoint) else { return Ok(Stop::Cancel) };
        let (expires_at, total) = (batch.expires_at, batch.request_counts.total);
        let (done, _) = self.store.db.done_lines(id).await?;
        let done: HashSet<i64> = done.into_iter().collect();
        let Ok(mut input) = self.input(batch, whose).await else { return Ok(Stop::Cancel) };
        let mut room = self.room(whose).await?;
        let mut held = self.store.db.results_bytes(id).await?;
        let mut largest = 0i64;
        let mut full: Option<String> = None;
        let bounds = self.st.config.json_bounds();
        let mut line_no = -1i64;
        let mut retry: VecDeque<Line> = VecDeque::new();
        let mut running: JoinSet<Ran> = JoinSet::new();
        let mut finished: Vec<(i64, bool, String)> = Vec::new();
        let mut exhausted = false;
        let mut recorded = Instant::now();
        let mut phase = self.store.hand_over.phase();
        let mut seat = self.lane.join();
        let generation = lease.claim.generation;
        let stop = loop {
            if self.store.hand_over.has_begun() {
                break Stop::Release(self.store.hand_over.handing());
            }
            // Paused, or the store slow to answer, past what the lease surely covers: no line starts before the
            // claim is known to hold (another replica may have taken the batch meanwhile).
            if !lease.sure() && !self.renew(id, lease).await? {
                break Stop::Lost;
            }
            // Until a result's size is known, one line at a time: a slot's worth of lines of unknown size could pass
            // the room together.
            let sizing = room.is_some() && largest == 0 && !running.is_empty();
            // A slot is dealt to this batch in its turn while it has a line to run (none while the server drains or
            // a rank is down: the lines wait, for this replica or the one that takes the batch over).
            seat.want((!exhausted || !retry.is_empty()) && full.is_none() && !sizing);
            if let Some(why) = &full
                && running.is_empty()
            {
                break Stop::Full(why.clone());
            }
            if exhausted && retry.is_empty() && running.is_empty() {
                break Stop::Done;
            }
            tokio::select! {
                Some((slot, stopped)) = seat.slot() => {
                    if !lease.sure() {
                        continue; // the slot goes back with its drop; the claim is renewed first
                    }
                    if let Some(room) = room
                        && held + (running.len() as i64 + 1) * largest > room
                    {
                        full = Some(format!(
                            "The batch's results hold {held} bytes and would pass the {room} bytes left for its files \
                             (--files-max-total-bytes, --files-max-bytes-per-owner): it took no more lines."
                        ));
                        continue; // the slot goes back with its drop
                    }
                    let next = match retry.pop_front() {
                        Some(line) => Some(line),
                        None => next_line(&mut input, &mut line_no, &done, &endpoint, bounds).await,
                    };
                    match next {
                        // The slot goes back with its drop, to the next batch in turn.
                        None => exhausted = true,
                        Some(line) => {
                            tracing::debug!(target: LINES_LOG, batch_id = %id, line = line.no, generation, "batch line started");
                            let (st, traces, whose) = (self.st.clone(), traces.clone(), whose.clone());
                            running.spawn(async move {
                                let body = line.body.clone();
                                let outcome = run_line(&st, door, &line.custom_id, body, whose, slot, stopped, traces).await;
                                (line, outcome)
                            });
                        }
                    }
                }
                Some(Ok(ran)) = running.join_next() => {
                    // This line's result, and those of the lines that finished with it, written together at once.
                    let mut ready = vec![ran];
                    while let Some(Ok(ran)) = running.try_join_next() {
                        ready.push(ran);
                    }
                    for (line, outcome) in ready {
                        match outcome {
                            Some((ok, result)) => {
                                largest = largest.max(result.len() as i64 + 1);
                                finished.push((line.no, ok, result));
                            }
                            None => retry.push_back(line), // a client's request took its slot
                        }
                    }
                    if !finished.is_empty() {
                        if !self.store.db.put_results(id, lease.claim, &finished).await? {
                            break Stop::Lost;
                        }
                        held += finished.iter().map(|(_, _, r)| r.len() as i64 + 1).sum::<i64>();
                        finished.clear();
                    }
                }
                Ok(()) = phase.changed() => {} // the drain: seen at the loop's top
                () = tokio::time::sleep(LOOK_EVERY) => {}
            }
            if recorded.elapsed() >= RECORD_EVERY {
                recorded = Instant::now();
                if !self.record(id, batch, total, lease.claim).await? || !self.renew(id, lease).await? {
                    break Stop::Lost;
                }
                room = self.room(whose).await?;
                let status = self.store.db.get_batch(id).await?.map(|b| b.status);
                if status == Some(BatchStatus::Cancelling) {
                    break Stop::Cancel;
                }
                if items::now() > expires_at {
                    break Stop::Expire;
                }
            }
        };
        drop(seat); // out of the lane's turn, and any slot dealt to it and not taken goes back
        let aborted = running.len();
        running.abort_all(); // a cancelled, expired, lost or released batch's lines in flight
        if matches!(stop, Stop::Lost) {
            self.lost(id, lease.claim, finished.len(), aborted);
            return Ok(Stop::Lost);
        }
        if !self.record(id, batch, total, lease.claim).await? {
            self.lost(id, lease.claim, 0, aborted);
            return Ok(Stop::Lost);
        }
        Ok(stop)
    }

    /// Write the counts the recorded results make, under the claim: false if it was lost (a status moved meanwhile,
    /// a cancel, is not a loss: the caller reads it).
    async fn record(&self, id: &str, batch: &mut Batch, total: i64, claim: Claim<'_>) -> Result<bool, StoreError> {
        let (done, failed) = self.store.db.done_lines(id).await?;
        batch.set_counts(total, done.len() as i64 - failed, failed);
        if self
            .store
            .db
            .set_batch(id, batch.status.as_str(), batch.status.as_str(), &batch.to_text(), Some(claim))
            .await?
        {
            return Ok(true);
        }
        self.store.db.holds_batch(id, claim).await
    }
}

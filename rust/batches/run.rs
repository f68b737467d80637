//! Running one batch on this replica, from wherever it stands: `validating` (check every line), `in_progress`
//! (each line not yet done through the one request path, in a batch line's slot dealt by the lane: only idle
//! capacity, shared round-robin with the other batches running here, given up to any client's request that needs
//! it, and run again later), `finalizing` (the output and error files), or `cancelling`. Results are recorded as lines finish, one row per line, so a replica that dies loses only the
//! lines in flight, and a line that runs twice (a takeover) counts once.

use super::input::InputLines;
use super::lane::Lane;
use super::line::{next_line, run_line};
use super::object::{self, OUTPUT_EXPIRES_AFTER, door, parse_line, set_counts, set_status};
use super::traced::LineTraces;
use crate::error::ApiError;
use crate::http::AppState;
use crate::owner::Owner;
use crate::store::{Store, StoreError, items};
use axum::body::Bytes;
use futures_util::StreamExt;
use serde_json::{Value, json};
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::task::JoinSet;

/// How often a running batch looks whether it is time to record, when nothing else happens.
const LOOK_EVERY: Duration = Duration::from_millis(100);
/// How often it records what finished, reads a cancel and renews its claim.
const RECORD_EVERY: Duration = Duration::from_secs(1);
/// Lines of the output files read from the store at a time.
const PAGE: i64 = 512;

pub struct Runner {
    pub st: Arc<AppState>,
    pub store: Arc<Store>,
    pub owner: String,
    /// Where its batches' lines get their slots.
    pub lane: Arc<Lane>,
}

/// An input line to run: (line number, custom_id, body).
pub(super) type Line = (i64, String, Value);
/// A line run: the line, and its outcome (succeeded, result line), or None if its slot was taken.
type Ran = (Line, Option<(bool, String)>);

enum Stop {
    Done,
    Cancel,
    Expire,
    /// Its results would pass what its owner's files (or all files) may hold: it takes no more lines.
    Full(String),
}

/// The error a batch ends `failed` with when its output would not fit.
const FULL: &str = "file_storage_limit_exceeded";

impl Runner {
    pub async fn run(&self, id: &str) -> Result<(), StoreError> {
        loop {
            let Some(row) = self.store.db.get_batch(id).await? else { return Ok(()) };
            let mut batch: Value = serde_json::from_str(&row.batch).unwrap_or_default();
            let now = items::now();
            let whose = Owner::from_stored(&row.owned_by);
            let next = match row.status.as_str() {
                "validating" => self.validate(&mut batch, &whose).await?,
                "in_progress" if now > batch["expires_at"].as_i64().unwrap_or(i64::MAX) => "expired",
                "in_progress" => match self.lines(id, &mut batch, &whose, row.trace_context.as_deref()).await? {
                    Stop::Done => "finalizing",
                    Stop::Cancel => "cancelling",
                    Stop::Expire => "expired",
                    Stop::Full(why) => {
                        // What ran is kept (it fits); the batch ends `failed`, saying why, once it is written.
                        batch["errors"] = object::errors(&[(0, FULL, why)]);
                        "finalizing"
                    }
                },
                "finalizing" if batch["errors"].is_object() => self.finish(id, &mut batch, &whose, "failed").await?,
                "finalizing" => self.finish(id, &mut batch, &whose, "completed").await?,
                "cancelling" => self.finish(id, &mut batch, &whose, "cancelled").await?,
                _ => return Ok(()),
            };
            if next == "expired" {
                self.finish(id, &mut batch, &whose, "expired").await?;
                return Ok(());
            }
            set_status(&mut batch, next, items::now());
            // Only while this replica holds the claim, and never over a cancel asked meanwhile (then: again).
            if !self.store.db.set_batch(id, &row.status, next, &batch.to_string(), Some(&self.owner)).await? {
                let current = self.store.db.get_batch(id).await?.map(|b| b.status);
                if current.as_deref() == Some("cancelling") {
                    continue;
                }
                return Ok(());
            }
            if matches!(next, "completed" | "failed" | "cancelled") {
                return Ok(());
            }
        }
    }

    /// Check every line: `in_progress` with its count, or `failed` with the lines at fault.
    async fn validate(&self, batch: &mut Value, whose: &Owner) -> Result<&'static str, StoreError> {
        let endpoint = batch["endpoint"].as_str().unwrap_or_default().to_string();
        let mut errors = Vec::new();
        let mut ids = HashSet::new();
        let mut total = 0;
        let (lines_max, bounds) = (object::lines_max(&endpoint), self.st.config.json_bounds());
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
            batch["errors"] = object::errors(&errors);
            return Ok("failed");
        }
        set_counts(batch, total as i64, 0, 0);
        Ok("in_progress")
    }

    /// The input file's lines, none read past `--max-batch-line-bytes`.
    async fn input(&self, batch: &Value, whose: &Owner) -> Result<InputLines<tokio::fs::File>, String> {
        let file_id = batch["input_file_id"].as_str().unwrap_or_default();
        let (_, file) = self.store.file_content(file_id, whose).await.map_err(|e| e.to_string())?;
        Ok(InputLines::new(file, self.st.config.max_batch_line_bytes))
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
    /// the largest result so far for each line running and this one, fits). `trace_context`: the span of the
    /// request that created it, which the lines' spans link to.
    async fn lines(
        &self,
        id: &str,
        batch: &mut Value,
        whose: &Owner,
        trace_context: Option<&str>,
    ) -> Result<Stop, StoreError> {
        let endpoint = batch["endpoint"].as_str().unwrap_or_default().to_string();
        let traces = LineTraces::new(&self.st, id, trace_context);
        let Some(door) = door(&endpoint) else { return Ok(Stop::Cancel) };
        let expires_at = batch["expires_at"].as_i64().unwrap_or(i64::MAX);
        let total = batch["request_counts"]["total"].as_i64().unwrap_or(0);
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
        let mut results: Vec<(i64, bool, String)> = Vec::new();
        let mut exhausted = false;
        let mut recorded = Instant::now();
        let mut seat = self.lane.join();
        let stop = loop {
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
                    let pending: i64 = results.iter().map(|(_, _, r)| r.len() as i64 + 1).sum();
                    if let Some(room) = room
                        && held + pending + (running.len() as i64 + 1) * largest > room
                    {
                        full = Some(format!(
                            "The batch's results hold {} bytes and would pass the {room} bytes left for its files \
                             (--files-max-total-bytes, --files-max-bytes-per-owner): it took no more lines.",
                            held + pending
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
                        Some((no, custom_id, body)) => {
                            let (st, traces, whose) = (self.st.clone(), traces.clone(), whose.clone());
                            running.spawn(async move {
                                let outcome =
                                    run_line(&st, door, &custom_id, body.clone(), whose, slot, stopped, traces).await;
                                ((no, custom_id, body), outcome)
                            });
                        }
                    }
                }
                Some(Ok((line, outcome))) = running.join_next() => match outcome {
                    Some((ok, result)) => {
                        largest = largest.max(result.len() as i64 + 1);
                        results.push((line.0, ok, result));
                    }
                    None => retry.push_back(line), // a client's request took its slot
                },
                () = tokio::time::sleep(LOOK_EVERY) => {}
            }
            if recorded.elapsed() >= RECORD_EVERY {
                recorded = Instant::now();
                held += results.iter().map(|(_, _, r)| r.len() as i64 + 1).sum::<i64>();
                self.record(id, batch, total, &mut results).await?;
                room = self.room(whose).await?;
                let status = self.store.db.get_batch(id).await?.map(|b| b.status);
                if status.as_deref() == Some("cancelling") {
                    break Stop::Cancel;
                }
                if items::now() > expires_at {
                    break Stop::Expire;
                }
                self.store.db.claim_batch(id, &self.owner, items::now(), items::now() + super::LEASE_S).await?;
            }
        };
        drop(seat); // out of the lane's turn, and any slot dealt to it and not taken goes back
        running.abort_all(); // a cancelled or expired batch's lines in flight
        self.record(id, batch, total, &mut results).await?;
        Ok(stop)
    }

    /// Write the results gathered since the last time, and the counts they make.
    async fn record(
        &self,
        id: &str,
        batch: &mut Value,
        total: i64,
        results: &mut Vec<(i64, bool, String)>,
    ) -> Result<(), StoreError> {
        if !results.is_empty() {
            self.store.db.put_results(id, results).await?;
            results.clear();
        }
        let (done, failed) = self.store.db.done_lines(id).await?;
        set_counts(batch, total, done.len() as i64 - failed, failed);
        let status = batch["status"].as_str().unwrap_or("in_progress").to_string();
        self.store.db.set_batch(id, &status, &status, &batch.to_string(), Some(&self.owner)).await?;
        Ok(())
    }

    /// Write the output and error files from the recorded results, then end as `status`.
    /// A results file that does not fit (the caps, or a full disk) ends the batch `failed`, saying so, with nothing
    /// half-written kept.
    async fn finish(
        &self,
        id: &str,
        batch: &mut Value,
        whose: &Owner,
        mut status: &'static str,
    ) -> Result<&'static str, StoreError> {
        let (done, failed) = self.store.db.done_lines(id).await?;
        let total = batch["request_counts"]["total"].as_i64().unwrap_or(0);
        set_counts(batch, total, done.len() as i64 - failed, failed);
        for (ok, key) in [(true, "output_file_id"), (false, "error_file_id")] {
            if batch.get(key).is_some_and(|v| !v.is_null())
                || (ok && done.len() as i64 == failed)
                || (!ok && failed == 0)
            {
                continue;
            }
            let expires_after = batch[OUTPUT_EXPIRES_AFTER].as_i64();
            match self.results_file(id, ok, whose, expires_after).await {
                Ok(file) => batch[key] = json!(file),
                Err(e @ (ApiError::FilesFull { .. } | ApiError::StoreUnavailable(_))) => {
                    tracing::warn!(batch_id = %id, "a batch's results file did not fit: {e}");
                    batch["errors"] = object::errors(&[(0, FULL, format!("Its results file was not kept: {e}"))]);
                    status = "failed";
                }
                Err(e) => tracing::error!(batch_id = %id, "could not write a batch's results file: {e}"),
            }
        }
        if status != "completed" {
            let was = batch["status"].as_str().unwrap_or_default().to_string();
            set_status(batch, status, items::now());
            self.store.db.set_batch(id, &was, status, &batch.to_string(), Some(&self.owner)).await?;
        }
        Ok(status)
    }

    /// One file of results (the succeeded or the failed lines) in line order, expiring `expires_after` seconds from
    /// now if the batch asked (`output_expires_after`); its id.
    async fn results_file(
        &self,
        id: &str,
        ok: bool,
        whose: &Owner,
        expires_after: Option<i64>,
    ) -> Result<String, ApiError> {
        let db = self.store.db.clone();
        let (id, from) = (id.to_string(), 0i64);
        let pages = futures_util::stream::unfold(Some(from), move |from| {
            let (db, id) = (db.clone(), id.clone());
            async move {
                let from = from?;
                let page = db.results(&id, ok, from, PAGE).await;
                match page {
                    Ok(rows) if rows.is_empty() => None,
                    Ok(rows) => {
                        let next = rows.last().map(|(line, _)| line + 1);
                        let text: String = rows.iter().map(|(_, r)| format!("{r}\n")).collect();
                        Some((Ok::<_, StoreError>(Bytes::from(text)), next))
                    }
                    Err(e) => Some((Err(e), None)),
                }
            }
        });
        let up = self.store.receive(pages.boxed(), whose).await?;
        let name = if ok { "batch_output.jsonl" } else { "batch_errors.jsonl" };
        let file = self.store.keep_file(up, name, "batch_output", expires_after).await?;
        Ok(file["id"].as_str().unwrap_or_default().to_string())
    }
}

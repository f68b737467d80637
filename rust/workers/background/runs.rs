//! The background runs this replica holds (`background: true`), and their registry (`Runs`): the worker's own
//! state, carried beside the store in its context (`super::Background`). While they run on this replica: their
//! stream's events, kept to be re-read (`GET /v1/responses/{id}?stream=true&starting_after=N`) while it runs and
//! for a while after, and the handle that cancels them. The Response itself is in the database from the moment it
//! is queued; this is only the live part, so a replica that restarts loses the replay, not the response.
//!
//! What a client can make it hold is bounded (issue 39):
//! - runs queued or running: at most `max_runs` on this replica, and `per_owner` of them for one owner (each API
//!   key is one; without keys everybody is the one anonymous owner, whose cap is then `max_runs`). A run counts
//!   from its `POST` until its engine request ends (`Run::release`), not while its events are kept for replay;
//! - events: each run keeps the latest `window` bytes of its stream (older events go: a replay that asks for them
//!   is a 400, and a live reader that falls that far behind ends); ended runs are kept for replay, the oldest
//!   dropped first, while together they hold at most `replay_bytes`, and for `KEEP_AFTER` at most.
//!
//! Each run knows its claim in the store (issue 40): this replica's name and the generation it holds the run
//! under (`Claim`), named by every write it makes there. Its `Stage` says who may end it: the holder's own final
//! write (`begin_end`) and a stop (a cancel, a lost claim, a drain's hand-over) exclude each other.

use super::events::{Events, sequence_number};
use crate::error::ApiError;
use crate::limits::MIN_REPLAY_WINDOW_BYTES;
use crate::owner::Owner;
use crate::store::background::Claim;
use bytes::Bytes;
use futures_util::Stream;
use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// How long an ended run's events stay to be re-read (fewer if newer runs need the room).
pub const KEEP_AFTER: Duration = Duration::from_secs(600);
/// Room kept for the bytes of an event not yet whole.
const PARTIAL_ROOM: usize = 16 << 10;

/// Where a run stands (`Run::stage`): each moves only forward, and ending and stopping exclude each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Stage {
    /// Waiting for a slot (or for the response it continues).
    Waiting,
    /// Its request runs on a rank: it writes `in_progress`.
    Generating,
    /// Its holder is writing its final state.
    Ending,
    /// Stopped from outside (cancelled, its claim lost, handed over, deleted): its holder writes nothing more.
    Stopped,
}

/// How much the runs may hold (`--max-background-runs`, `--max-background-runs-per-owner`,
/// `--background-replay-bytes`).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_runs: usize,
    pub per_owner: usize,
    pub replay_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_runs: 512, per_owner: 64, replay_bytes: 64 << 20 }
    }
}

impl Limits {
    /// Bytes of its stream one run keeps: its share of the budget when every run is running at once.
    fn window(&self) -> usize {
        (self.replay_bytes / self.max_runs.max(1)).max(MIN_REPLAY_WINDOW_BYTES)
    }
}

pub struct Runs {
    limits: Limits,
    counted: Arc<Mutex<Counted>>,
    kept: Mutex<Kept>,
}

/// Runs queued or running: in all, and by owner.
#[derive(Default)]
struct Counted {
    all: usize,
    by_owner: HashMap<Owner, usize>,
}

/// The runs this replica knows by id: running, or ended and kept for replay (in the order they ended).
#[derive(Default)]
struct Kept {
    runs: HashMap<String, Arc<Run>>,
    ended: VecDeque<(Instant, String, usize)>,
    ended_bytes: usize,
}

/// A run's place in the count; dropping it frees the place.
struct Place {
    counted: Arc<Mutex<Counted>>,
    owner: Option<Owner>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut c = self.counted.lock().unwrap();
        c.all -= 1;
        if let Some(owner) = &self.owner
            && let Some(n) = c.by_owner.get_mut(owner)
        {
            *n -= 1;
            if *n == 0 {
                c.by_owner.remove(owner);
            }
        }
    }
}

pub struct Run {
    /// The response's id.
    pub id: String,
    /// Its place in the count, until its request ends.
    place: Mutex<Option<Place>>,
    events: Mutex<Events>,
    /// Bytes of an event not yet whole.
    partial: Mutex<Vec<u8>>,
    /// (events so far, finished): what a reader waits on.
    progress: watch::Sender<(usize, bool)>,
    task: Mutex<Option<tokio::task::AbortHandle>>,
    /// The generation this replica holds its claim under.
    pub generation: i64,
    /// Whether its claim is in the store yet: a claim renewal that started before is not expected to name it.
    claimed: AtomicBool,
    stage: AtomicU8,
    /// Whether it was put with the ended runs (`Runs::ended`).
    ended: AtomicBool,
}

impl Runs {
    pub fn new(limits: Limits) -> Self {
        Runs { limits, counted: Arc::default(), kept: Mutex::default() }
    }

    /// A new run for `id` held under `generation`, counted for `owner` (None: a run taken over from another
    /// replica, whose owner is not known here: counted in all only); a 429 past either cap.
    pub fn start(&self, id: &str, owner: Option<&Owner>, generation: i64) -> Result<Arc<Run>, ApiError> {
        let place = {
            let mut c = self.counted.lock().unwrap();
            if c.all >= self.limits.max_runs {
                return Err(ApiError::BackgroundFull(self.limits.max_runs));
            }
            let owner = owner.filter(|o| !o.is_anonymous());
            if let Some(owner) = owner {
                let n = c.by_owner.entry(owner.clone()).or_default();
                if *n >= self.limits.per_owner {
                    return Err(ApiError::BackgroundOwnerFull(self.limits.per_owner));
                }
                *n += 1;
            }
            c.all += 1;
            Place { counted: self.counted.clone(), owner: owner.cloned() }
        };
        let events = Events { window: self.limits.window(), ..Default::default() };
        let run = Arc::new(Run {
            id: id.to_string(),
            place: Mutex::new(Some(place)),
            events: Mutex::new(events),
            partial: Mutex::default(),
            progress: watch::channel((0, false)).0,
            task: Mutex::default(),
            generation,
            claimed: AtomicBool::new(false),
            stage: AtomicU8::new(Stage::Waiting as u8),
            ended: AtomicBool::new(false),
        });
        let mut kept = self.kept.lock().unwrap();
        self.prune(&mut kept);
        kept.runs.insert(id.to_string(), run.clone());
        Ok(run)
    }

    pub fn get(&self, id: &str) -> Option<Arc<Run>> {
        let mut kept = self.kept.lock().unwrap();
        self.prune(&mut kept);
        kept.runs.get(id).cloned()
    }

    /// The runs known here that have not ended, with their claim in the store.
    pub fn claimed(&self) -> Vec<Arc<Run>> {
        let kept = self.kept.lock().unwrap();
        let live = kept.runs.values().filter(|r| !r.ended.load(Ordering::Acquire) && r.claimed.load(Ordering::Acquire));
        live.cloned().collect()
    }

    /// A run that never started (its row could not be written).
    pub fn forget(&self, id: &str) {
        if let Some(run) = self.kept.lock().unwrap().runs.remove(id) {
            run.release();
        }
    }

    /// A run that ended: its place freed, its events kept for replay within the budget.
    pub fn ended(&self, run: &Run) {
        run.finish();
        run.release();
        if run.ended.swap(true, Ordering::AcqRel) {
            return; // ended twice (a cancel as its request ended)
        }
        // Only its whole events are kept: what was read for the next one goes, and so does spare room.
        *run.partial.lock().unwrap() = Vec::new();
        let bytes = {
            let mut events = run.events.lock().unwrap();
            events.kept.shrink_to_fit();
            events.bytes
        };
        let mut kept = self.kept.lock().unwrap();
        kept.ended.push_back((Instant::now(), run.id.clone(), bytes));
        kept.ended_bytes += bytes;
        self.prune(&mut kept);
    }

    /// Drop the ended runs past their time, and the oldest while they hold more than the budget.
    fn prune(&self, kept: &mut Kept) {
        while let Some((at, _, bytes)) = kept.ended.front() {
            if at.elapsed() < KEEP_AFTER && kept.ended_bytes <= self.limits.replay_bytes {
                break;
            }
            let bytes = *bytes;
            let (_, id, _) = kept.ended.pop_front().expect("a front");
            kept.ended_bytes -= bytes;
            kept.runs.remove(&id);
        }
    }

    /// Runs queued or running (counted), and runs known here (running or kept for replay), with the bytes the
    /// ended ones keep.
    #[cfg(test)]
    fn held(&self) -> (usize, usize, usize) {
        let all = self.counted.lock().unwrap().all;
        let kept = self.kept.lock().unwrap();
        (all, kept.runs.len(), kept.ended_bytes)
    }
}

impl Default for Runs {
    fn default() -> Self {
        Runs::new(Limits::default())
    }
}

impl Run {
    pub fn set_task(&self, task: tokio::task::AbortHandle) {
        *self.task.lock().unwrap() = Some(task);
    }

    /// Free its place in the count: its request has ended (the Response is being recorded), whatever its events
    /// still do.
    pub fn release(&self) {
        drop(self.place.lock().unwrap().take());
    }

    /// Take a chunk of the stream: its whole events are kept (keep-alive comments are not), the oldest dropped
    /// past the window.
    pub fn push(&self, chunk: &[u8]) {
        let mut partial = self.partial.lock().unwrap();
        partial.extend_from_slice(chunk);
        let mut events = self.events.lock().unwrap();
        let mut at = 0;
        while let Some(end) = memchr::memmem::find(&partial[at..], b"\n\n") {
            let event = &partial[at..at + end + 2];
            at += end + 2;
            if event.starts_with(b":") {
                continue;
            }
            let seq = sequence_number(event).unwrap_or((events.dropped + events.kept.len()) as u64);
            events.push(seq, Bytes::copy_from_slice(event));
        }
        partial.drain(..at);
        // A chunk may be large (a reader that lagged gets what gathered at once): its room is not kept for the rest.
        if partial.capacity() > PARTIAL_ROOM {
            let room = PARTIAL_ROOM.max(partial.len());
            partial.shrink_to(room);
        }
        let n = events.dropped + events.kept.len();
        self.progress.send_modify(|p| p.0 = n);
    }

    pub fn finish(&self) {
        self.progress.send_modify(|p| p.1 = true);
    }

    pub fn finished(&self) -> bool {
        self.progress.borrow().1
    }

    /// Its claim is in the store from now on.
    pub fn set_claimed(&self) {
        self.claimed.store(true, Ordering::Release);
    }

    /// The claim its writes name: this replica's (`instance`) under its generation.
    pub fn claim<'a>(&self, instance: &'a str) -> Claim<'a> {
        Claim::Held { owner: instance, generation: self.generation }
    }

    pub fn stage(&self) -> Stage {
        match self.stage.load(Ordering::Acquire) {
            0 => Stage::Waiting,
            1 => Stage::Generating,
            2 => Stage::Ending,
            _ => Stage::Stopped,
        }
    }

    /// Move from Waiting or Generating to `to`; whether it did.
    fn advance(&self, to: Stage) -> bool {
        let mut at = self.stage.load(Ordering::Acquire);
        while at <= Stage::Generating as u8 && at < to as u8 {
            match self.stage.compare_exchange(at, to as u8, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(now) => at = now,
            }
        }
        false
    }

    /// Its request reached a rank; false if it was stopped meanwhile. A short request may have ended already (its
    /// end recorded from its rank's thread before its run read the answer): it did run, and its stream is still to
    /// be read and kept, or its readers would see it end with no event.
    pub fn generating(&self) -> bool {
        self.advance(Stage::Generating) || self.stage() == Stage::Ending
    }

    /// Its holder is about to write its final state; false if it was stopped first (then it writes nothing).
    pub fn begin_end(&self) -> bool {
        self.advance(Stage::Ending)
    }

    /// Stop it from outside: its task (and with it the request on its rank) ends, and its holder writes nothing
    /// more; true if it was still running (whoever stops it then ends it in the store, and calls `Runs::ended`).
    pub fn stop(&self) -> bool {
        if !self.give_up() {
            return false;
        }
        if let Some(task) = self.task.lock().unwrap().take() {
            task.abort();
        }
        true
    }

    /// Stop it from its own task (its claim is gone, or a drain hands it over): as `stop`, its task left to end
    /// by itself.
    pub fn give_up(&self) -> bool {
        !self.finished() && self.advance(Stage::Stopped)
    }

    pub fn is_stopped(&self) -> bool {
        self.stage() == Stage::Stopped
    }

    /// Wait (at most `within`) until its stream has ended: its final state is written by then.
    pub async fn wait_finished(&self, within: Duration) {
        let mut rx = self.progress.subscribe();
        let _ = tokio::time::timeout(within, rx.wait_for(|p| p.1)).await;
    }

    /// The Response as its latest whole-Response event has it (`in_progress`), while it runs.
    pub fn latest(&self) -> Option<Bytes> {
        const DATA: &[u8] = b"\ndata: ";
        let whole = self.events.lock().unwrap().latest.clone()?;
        let data = &whole[memchr::memmem::find(&whole, DATA)? + DATA.len()..];
        crate::store::responses::event_response(data).map(Bytes::copy_from_slice)
    }

    /// The first sequence number still kept, if older events were dropped (past the window).
    pub fn kept_from(&self) -> Option<u64> {
        let events = self.events.lock().unwrap();
        (events.dropped > 0).then(|| events.kept.front().map_or(u64::MAX, |(seq, _)| *seq))
    }

    /// The stream's events after `starting_after` (from the first kept without it), then each as it comes, to the
    /// end; a reader that falls behind what is kept ends there.
    pub fn follow(self: Arc<Self>, starting_after: Option<u64>) -> impl Stream<Item = Result<Bytes, Infallible>> {
        let rx = self.progress.subscribe();
        let next = self.events.lock().unwrap().dropped;
        futures_util::stream::unfold((self, next, rx), move |(run, mut next, mut rx)| async move {
            loop {
                let event = {
                    let events = run.events.lock().unwrap();
                    if next < events.dropped {
                        return None; // it fell behind the window
                    }
                    events.kept.get(next - events.dropped).cloned()
                };
                if let Some((seq, bytes)) = event {
                    next += 1;
                    if starting_after.is_some_and(|after| seq <= after) {
                        continue;
                    }
                    return Some((Ok(bytes), (run, next, rx)));
                }
                let (count, done) = *rx.borrow_and_update();
                if count > next {
                    continue;
                }
                if done || rx.changed().await.is_err() {
                    return None;
                }
            }
        })
    }
}

#[cfg(test)]
#[path = "runs_tests.rs"]
mod tests;

//! Background responses (`background: true`) while they run on this replica: their stream's events, kept to be
//! re-read (`GET /v1/responses/{id}?stream=true&starting_after=N`) while it runs and for a while after, and the
//! handle that cancels them. The Response itself is in the database from the moment it is queued; this is only
//! the live part, so a replica that restarts loses the replay, not the response.
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

use crate::error::ApiError;
use crate::owner::Owner;
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
/// The least of a stream a run keeps, whatever the budget (a short answer whole).
const WINDOW_MIN: usize = 64 << 10;
/// Room kept for the bytes of an event not yet whole.
const PARTIAL_ROOM: usize = 16 << 10;
/// What a kept event costs beside its text, counted with it: its slot in the queue and its allocation's own.
const EVENT_COST: usize = 64;

/// Which claim a write names: its holder's (owner, generation), or any claim whose lease ran out before `now`
/// (its replica is dead, or released it).
#[derive(Clone, Copy, Debug)]
pub enum Claim<'a> {
    Held { owner: &'a str, generation: i64 },
    Lapsed { now: i64 },
}

/// One claim renewed: its id and generation, whether a cancel was asked of it, and whether its Response is gone
/// (deleted: the run stops).
#[derive(Debug, sqlx::FromRow)]
pub struct Renewed {
    pub id: String,
    pub claim_gen: i64,
    pub cancel_asked: bool,
    pub deleted: bool,
}

/// A run taken over: its id, request, generation now, and whether a cancel was asked of the replica before.
#[derive(Debug, sqlx::FromRow)]
pub struct TakenOver {
    pub id: String,
    pub body: String,
    pub claim_gen: i64,
    pub cancel_asked: bool,
}

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
        (self.replay_bytes / self.max_runs.max(1)).max(WINDOW_MIN)
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

/// Whole SSE events in order, each with its `sequence_number`: the latest `window` bytes of them (each counted with
/// `EVENT_COST`).
#[derive(Default)]
struct Events {
    kept: VecDeque<(u64, Bytes)>,
    /// How many went before the first kept.
    dropped: usize,
    bytes: usize,
    window: usize,
    /// The latest whole-Response event (`response.created` or `.in_progress`), kept whatever the window drops.
    latest: Option<Bytes>,
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

    /// Its request reached a rank; false if it was stopped or ended meanwhile.
    pub fn generating(&self) -> bool {
        self.advance(Stage::Generating)
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
        super::responses::event_response(data).map(Bytes::copy_from_slice)
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

impl Events {
    fn push(&mut self, seq: u64, event: Bytes) {
        if event.starts_with(b"event: response.in_progress\n") || event.starts_with(b"event: response.created\n") {
            self.latest = Some(event.clone());
        }
        self.bytes += event.len() + EVENT_COST;
        self.kept.push_back((seq, event));
        while self.bytes > self.window && self.kept.len() > 1 {
            let (_, gone) = self.kept.pop_front().expect("more than one");
            self.bytes -= gone.len() + EVENT_COST;
            self.dropped += 1;
        }
    }
}

/// An event's `"sequence_number":N`.
fn sequence_number(event: &[u8]) -> Option<u64> {
    const KEY: &[u8] = br#""sequence_number":"#;
    let at = memchr::memmem::rfind(event, KEY)? + KEY.len();
    let digits = event[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&event[at..at + digits]).ok()?.parse().ok()
}

/// Whether a stored Response has yet to end (its own `status`, not a `status` its metadata may hold).
pub fn is_running(response: &str) -> bool {
    let status = serde_json::from_str::<serde_json::Value>(response).ok().and_then(|r| r.get("status").cloned());
    matches!(status.as_ref().and_then(serde_json::Value::as_str), Some("queued" | "in_progress"))
}

/// Longest a request that continues a background response still running waits for it to end.
pub const CHAIN_WAIT: Duration = Duration::from_secs(60);

impl super::Store {
    /// Run `task` on the store's runtime (from a thread that has none: the rank's, as a request finishes).
    pub fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        self.runtime.spawn(task);
    }

    /// Wait (at most `within`: `CHAIN_WAIT`) until the background response `id`, read as still running, has ended,
    /// for a request that continues it: its output is then the chain's. A 409 `response_in_progress` past the wait.
    pub async fn until_ended(&self, id: &str, within: Duration) -> Result<(), ApiError> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(run) = self.runs.get(id).filter(|r| !r.finished()) {
                // Running here: its end is seen at once (its final state is written before its stream ends).
                run.wait_finished(Duration::from_secs(1)).await;
            } else {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            match self.db.get_response(id).await.map_err(super::failed)? {
                Some(row) if is_running(&row.response) => {}
                _ => return Ok(()), // ended (or deleted: the chain's own read says so)
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ApiError::ResponseInProgress(id.to_string()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    #[tokio::test]
    async fn events_are_kept_whole_and_replayed_after_a_sequence_number() {
        let runs = Runs::default();
        let run = runs.start("resp_1", None, 0).unwrap();
        run.push(b"event: a\ndata: {\"sequence_number\":0}\n\n: keep-alive\n\nevent: b\ndata: {\"seq");
        run.push(b"uence_number\":1}\n\n");
        let late = tokio::spawn(run.clone().follow(Some(0)).collect::<Vec<_>>());
        run.push(b"event: c\ndata: {\"sequence_number\":2}\n\n");
        run.finish();
        let got: Vec<Bytes> = late.await.unwrap().into_iter().map(Result::unwrap).collect();
        assert_eq!(got.len(), 2);
        assert!(got[0].starts_with(b"event: b") && got[1].starts_with(b"event: c"));
        assert_eq!(run.clone().follow(None).count().await, 3);
        assert!(!run.stop(), "a finished run is not stopped");
    }

    #[test]
    fn runs_are_capped_per_owner_and_in_all_and_an_ended_one_frees_its_place_at_once() {
        let runs = Runs::new(Limits { max_runs: 3, per_owner: 2, replay_bytes: 1 << 20 });
        let (a, b) = (Owner::for_key("a"), Owner::for_key("b"));
        let a1 = runs.start("r1", Some(&a), 0).unwrap();
        runs.start("r2", Some(&a), 0).unwrap();
        assert!(matches!(runs.start("r3", Some(&a), 0), Err(ApiError::BackgroundOwnerFull(2))));
        runs.start("r4", Some(&b), 0).unwrap();
        assert!(matches!(runs.start("r5", Some(&b), 0), Err(ApiError::BackgroundFull(3))));
        runs.ended(&a1);
        assert!(runs.get("r1").is_some(), "kept for replay");
        runs.start("r6", Some(&a), 0).unwrap();
        assert_eq!(runs.held().0, 3);
    }

    #[test]
    fn a_stop_and_its_holders_end_exclude_each_other() {
        let runs = Runs::default();
        let ending = runs.start("r1", None, 0).unwrap();
        assert!(ending.generating() && ending.begin_end());
        assert!(!ending.stop() && !ending.give_up(), "its holder writes its end: nobody stops it");
        let stopped = runs.start("r2", None, 3).unwrap();
        assert!(stopped.stop() && stopped.is_stopped());
        assert!(!stopped.generating() && !stopped.begin_end(), "stopped: its holder writes nothing more");
        assert!(matches!(stopped.claim("me"), Claim::Held { owner: "me", generation: 3 }));
        assert!(runs.claimed().is_empty(), "no claim in the store yet");
        stopped.set_claimed();
        assert_eq!(runs.claimed().len(), 1);
        runs.ended(&stopped);
        assert!(runs.claimed().is_empty(), "ended");
    }

    #[tokio::test]
    async fn a_chain_waits_for_a_running_response_then_is_a_409_past_the_wait() {
        use crate::store::{Db, Store, StoredResponse, retention::Retention};
        let db = Db::open("memory").await.unwrap();
        let mut row = StoredResponse {
            id: "resp_1".into(),
            created_at: 1,
            model: "m".into(),
            previous_response_id: None,
            context: String::new(),
            input_items: "[]".into(),
            response: r#"{"status":"in_progress","metadata":{"status":"completed"}}"#.into(),
            owned_by: String::new(),
        };
        db.put_responses(None, &[&row]).await.unwrap();
        let retention = Retention::new(None, Default::default());
        let store = Store::new(db, None, retention, Limits::default(), 15, tokio::runtime::Handle::current());
        let err = store.until_ended("resp_1", Duration::from_millis(300)).await.unwrap_err();
        assert_eq!(err.status(), axum::http::StatusCode::CONFLICT);
        let envelope: serde_json::Value = serde_json::from_str(&err.envelope()).unwrap();
        assert_eq!(envelope["error"]["code"], "response_in_progress");
        assert_eq!(envelope["error"]["param"], "previous_response_id");
        row.response = r#"{"status":"completed"}"#.into();
        let db = store.db.clone();
        let ends = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            db.put_responses(None, &[&row]).await.unwrap();
        });
        store.until_ended("resp_1", Duration::from_secs(5)).await.unwrap();
        ends.await.unwrap();
    }

    #[test]
    fn a_run_keeps_its_window_and_ended_runs_their_budget() {
        let runs = Runs::new(Limits { max_runs: 1, per_owner: 1, replay_bytes: WINDOW_MIN });
        let run = runs.start("r1", None, 0).unwrap();
        let event =
            |i: usize| format!("event: x\ndata: {{\"sequence_number\":{i},\"pad\":\"{}\"}}\n\n", "p".repeat(1000));
        for i in 0..200 {
            run.push(event(i).as_bytes());
        }
        let kept_from = run.kept_from().expect("the oldest went");
        assert!(kept_from > 100 && kept_from < 199, "{kept_from}");
        assert!(run.events.lock().unwrap().bytes <= WINDOW_MIN);
        runs.ended(&run);
        let second = runs.start("r2", None, 0).unwrap();
        second.push(event(0).as_bytes());
        runs.ended(&second);
        assert!(runs.get("r1").is_none(), "the oldest ended run goes past the budget");
        assert!(runs.get("r2").is_some());
    }
}

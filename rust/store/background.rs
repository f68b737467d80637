//! Background responses (`background: true`) while they run on this replica: their stream's events, kept to be
//! re-read (`GET /v1/responses/{id}?stream=true&starting_after=N`) while it runs and for a while after, and the
//! handle that cancels them. The Response itself is in the database from the moment it is queued; this is only
//! the live part, so a replica that restarts loses the replay, not the response.

use bytes::Bytes;
use futures_util::Stream;
use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// Most background responses one replica holds (running, or finished and kept for replay): past it a new one is a
/// 429, so a client cannot grow the server's memory by queueing.
pub const RUNS_MAX: usize = 4096;
/// How long a finished run's events stay to be re-read.
pub const KEEP_AFTER: Duration = Duration::from_secs(600);

#[derive(Default)]
pub struct Runs {
    map: Mutex<HashMap<String, Arc<Run>>>,
}

pub struct Run {
    /// The response's id.
    pub id: String,
    /// Whole SSE events in order, each with its `sequence_number`.
    events: Mutex<Vec<(u64, Bytes)>>,
    /// Bytes of an event not yet whole.
    partial: Mutex<Vec<u8>>,
    /// (events so far, finished): what a reader waits on.
    progress: watch::Sender<(usize, bool)>,
    task: Mutex<Option<tokio::task::AbortHandle>>,
    cancelled: AtomicBool,
}

impl Runs {
    /// A new run for `id`, or None past `RUNS_MAX`.
    pub fn start(&self, id: &str) -> Option<Arc<Run>> {
        let mut map = self.map.lock().unwrap();
        if map.len() >= RUNS_MAX {
            return None;
        }
        let run = Arc::new(Run {
            id: id.to_string(),
            events: Mutex::default(),
            partial: Mutex::default(),
            progress: watch::channel((0, false)).0,
            task: Mutex::default(),
            cancelled: AtomicBool::new(false),
        });
        map.insert(id.to_string(), run.clone());
        Some(run)
    }

    pub fn get(&self, id: &str) -> Option<Arc<Run>> {
        self.map.lock().unwrap().get(id).cloned()
    }

    pub fn forget(&self, id: &str) {
        self.map.lock().unwrap().remove(id);
    }

    /// Forget a finished run once its replay time is over.
    pub fn forget_later(self: &Arc<Self>, id: String) {
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(KEEP_AFTER).await;
            me.map.lock().unwrap().remove(&id);
        });
    }
}

impl Run {
    pub fn set_task(&self, task: tokio::task::AbortHandle) {
        *self.task.lock().unwrap() = Some(task);
    }

    /// Take a chunk of the stream: its whole events are kept (keep-alive comments are not).
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
            let seq = sequence_number(event).unwrap_or(events.len() as u64);
            events.push((seq, Bytes::copy_from_slice(event)));
        }
        partial.drain(..at);
        let n = events.len();
        self.progress.send_modify(|p| p.0 = n);
    }

    pub fn finish(&self) {
        self.progress.send_modify(|p| p.1 = true);
    }

    pub fn finished(&self) -> bool {
        self.progress.borrow().1
    }

    /// Stop it: its task (and with it the request on its rank) ends; true if it was still running.
    pub fn cancel(&self) -> bool {
        if self.finished() || self.cancelled.swap(true, Ordering::AcqRel) {
            return false;
        }
        if let Some(task) = self.task.lock().unwrap().take() {
            task.abort();
        }
        true
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// The Response as its latest whole-Response event has it (`in_progress`), while it runs.
    pub fn latest(&self) -> Option<Bytes> {
        const DATA: &[u8] = b"\ndata: ";
        let events = self.events.lock().unwrap();
        let whole =
            events.iter().rev().map(|(_, e)| e).find(|e| {
                e.starts_with(b"event: response.in_progress\n") || e.starts_with(b"event: response.created\n")
            })?;
        let data = &whole[memchr::memmem::find(whole, DATA)? + DATA.len()..];
        super::responses::event_response(data).map(Bytes::copy_from_slice)
    }

    /// The stream's events after `starting_after` (from the first without it), then each as it comes, to the end.
    pub fn follow(self: Arc<Self>, starting_after: Option<u64>) -> impl Stream<Item = Result<Bytes, Infallible>> {
        let rx = self.progress.subscribe();
        futures_util::stream::unfold((self, 0usize, rx), move |(run, mut next, mut rx)| async move {
            loop {
                let event = run.events.lock().unwrap().get(next).cloned();
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

/// An event's `"sequence_number":N`.
fn sequence_number(event: &[u8]) -> Option<u64> {
    const KEY: &[u8] = br#""sequence_number":"#;
    let at = memchr::memmem::rfind(event, KEY)? + KEY.len();
    let digits = event[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    std::str::from_utf8(&event[at..at + digits]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    #[tokio::test]
    async fn events_are_kept_whole_and_replayed_after_a_sequence_number() {
        let runs = Runs::default();
        let run = runs.start("resp_1").unwrap();
        run.push(b"event: a\ndata: {\"sequence_number\":0}\n\n: keep-alive\n\nevent: b\ndata: {\"seq");
        run.push(b"uence_number\":1}\n\n");
        let late = tokio::spawn(run.clone().follow(Some(0)).collect::<Vec<_>>());
        run.push(b"event: c\ndata: {\"sequence_number\":2}\n\n");
        run.finish();
        let got: Vec<Bytes> = late.await.unwrap().into_iter().map(Result::unwrap).collect();
        assert_eq!(got.len(), 2);
        assert!(got[0].starts_with(b"event: b") && got[1].starts_with(b"event: c"));
        assert_eq!(run.clone().follow(None).count().await, 3);
        assert!(!run.cancel(), "a finished run is not cancelled");
    }
}

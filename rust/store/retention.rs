//! Retention: what clients leave in the store is bounded by time and by size, so a shared node's disk is never
//! theirs to fill.
//! - Time (`--response-store-ttl`, OpenAI's 30 days by default): responses, conversations idle that long, and
//!   finished batches with their results go; files go at their own `expires_after`.
//! - Size (`--state-store-max-bytes`): when what responses and conversations hold passes the cap, the oldest go
//!   (responses by creation, conversations by their last addition) until it is back under 90 % of it. The writer
//!   counts what it adds and rings as soon as the cap may be passed; a check every minute catches the rest (other
//!   replicas' writes, the Conversations API's own).

use super::{Store, items};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How often records past their time are removed.
const EXPIRE_EVERY: Duration = Duration::from_secs(600);
/// How often the store's size is measured (more often when the writer rings).
const MEASURE_EVERY: Duration = Duration::from_secs(60);

/// The store's bounds, and what it holds as last measured plus what was written since.
pub struct Retention {
    pub ttl: Option<Duration>,
    pub max_bytes: Option<i64>,
    held: AtomicI64,
    over: Notify,
}

impl Retention {
    pub fn new(ttl: Option<Duration>, max_bytes: Option<u64>) -> Self {
        let max_bytes = max_bytes.map(|m| m.min(i64::MAX as u64) as i64);
        Retention { ttl, max_bytes, held: AtomicI64::new(0), over: Notify::new() }
    }

    /// `bytes` were written: ring the sweeper if the cap may now be passed.
    pub fn grew(&self, bytes: usize) {
        let held = self.held.fetch_add(bytes as i64, Ordering::Relaxed) + bytes as i64;
        if self.max_bytes.is_some_and(|max| held > max) {
            self.over.notify_one();
        }
    }
}

impl Store {
    /// Keep the store within its bounds from now on: a task that expires and evicts.
    pub fn keep_within_bounds(self: &Arc<Self>) {
        let me = self.clone();
        self.runtime.spawn(async move {
            let mut tick = tokio::time::interval(MEASURE_EVERY);
            let mut expired: Option<Instant> = None;
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = me.retention.over.notified() => {}
                }
                if expired.is_none_or(|at| at.elapsed() >= EXPIRE_EVERY) {
                    expired = Some(Instant::now());
                    me.expire().await;
                }
                if let Some(max) = me.retention.max_bytes {
                    me.evict_over(max).await;
                }
            }
        });
    }

    /// Remove what is past its time.
    async fn expire(&self) {
        self.expire_files().await;
        let Some(ttl) = self.retention.ttl else { return };
        let before = items::now() - ttl.as_secs() as i64;
        let removed = [
            ("stored responses", self.db.expire_responses(before).await),
            ("idle conversations", self.db.expire_conversations(before).await),
            ("finished batches", self.db.expire_batches(before).await),
        ];
        for (what, r) in removed {
            match r {
                Ok(0) => {}
                Ok(n) => tracing::info!(removed = n, "{what} past --response-store-ttl removed"),
                Err(e) => tracing::warn!("could not remove {what} past --response-store-ttl: {e}"),
            }
        }
    }

    /// Measure what the store holds and, past `max`, remove the oldest until it is under 90 % of it.
    async fn evict_over(&self, max: i64) {
        let mut held = match self.db.stored_bytes().await {
            Ok(held) => held,
            Err(e) => return tracing::warn!("could not measure the state store: {e}"),
        };
        self.retention.held.store(held, Ordering::Relaxed);
        if held <= max {
            return;
        }
        let (target, was) = (max / 10 * 9, held);
        let (mut responses, mut conversations) = (0u64, 0u64);
        while held > target {
            match self.evict_oldest(held - target).await {
                Ok((0, 0, 0)) => break, // nothing left to remove
                Ok((freed, r, c)) => {
                    held -= freed;
                    responses += r;
                    conversations += c;
                }
                Err(e) => {
                    tracing::warn!("could not evict from the state store: {e}");
                    break;
                }
            }
        }
        self.retention.held.store(held, Ordering::Relaxed);
        tracing::info!(
            bytes_before = was,
            bytes_after = held,
            responses,
            conversations,
            "the state store passed --state-store-max-bytes: the oldest records were removed"
        );
    }

    /// Free up to `need` bytes from the oldest records: responses older than the oldest conversation's last
    /// addition, else that conversation. (bytes freed, responses removed, conversations removed).
    async fn evict_oldest(&self, need: i64) -> Result<(i64, u64, u64), super::StoreError> {
        let response = self.db.oldest_response().await?;
        let conversation = self.db.oldest_conversation().await?;
        if let Some(r) = response
            && conversation.is_none_or(|c| r <= c)
        {
            let (freed, n) = self.db.evict_oldest_responses(need, conversation).await?;
            return Ok((freed, n, 0));
        }
        Ok(self.db.evict_conversation_oldest().await?.map_or((0, 0, 0), |freed| (freed, 0, 1)))
    }
}

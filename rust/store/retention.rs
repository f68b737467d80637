//! Retention: what clients leave in the store is bounded by time and by size, so a shared node's disk is never
//! theirs to fill, and one client's never another's to empty (issue 39).
//! - Time (`--response-store-ttl`, OpenAI's 30 days by default): responses, conversations idle that long, and
//!   finished batches with their results go; files go at their own `expires_after`.
//! - Size: each owner (an API key; all clients, without keys) may keep so much in responses and conversations
//!   (`--state-store-max-bytes-per-owner`, by default `--state-store-max-bytes` split evenly between the keys),
//!   and all together so much (`--state-store-max-bytes`). A stored request past either is refused (a 429, in the
//!   door's envelope) before it runs: nothing anyone stored is removed to make room for it. What an owner holds is
//!   measured from the database at most every `MEASURE_OWNER` (other replicas write too) plus what this one wrote
//!   since; what all hold, every `MEASURE_EVERY`.
//! - Per item and per chain (`--state-store-max-item-bytes`, `--state-store-max-chain-bytes`): `store::responses`.

use super::{Store, failed, items};
use crate::error::ApiError;
use crate::owner::Owner;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often records past their time are removed.
const EXPIRE_EVERY: Duration = Duration::from_secs(600);
/// How often the store's size is measured.
const MEASURE_EVERY: Duration = Duration::from_secs(60);
/// How long an owner's measure is trusted before it is read again from the database.
const MEASURE_OWNER: Duration = Duration::from_secs(5);
/// Owners whose measures are kept; past it the oldest measures are dropped (read again when needed).
const OWNERS_KEPT: usize = 4096;

/// The size bounds, as configured (None: no cap).
#[derive(Clone, Copy, Debug, Default)]
pub struct Bounds {
    pub max_bytes: Option<u64>,
    pub per_owner: Option<u64>,
    pub item_max: u64,
    pub chain_max: u64,
}

/// The store's bounds, and what it holds as last measured plus what was written since, in all and per owner.
pub struct Retention {
    pub ttl: Option<Duration>,
    pub max_bytes: Option<i64>,
    pub per_owner: Option<i64>,
    /// Largest stored item; most a chain or a conversation a request continues may hold.
    pub item_max: u64,
    pub chain_max: u64,
    held: AtomicI64,
    /// When `held` was last read from the database.
    measured: Mutex<Instant>,
    owners: Mutex<HashMap<Owner, (i64, Instant)>>,
}

impl Retention {
    pub fn new(ttl: Option<Duration>, bounds: Bounds) -> Self {
        let cap = |m: Option<u64>| m.map(|m| m.min(i64::MAX as u64) as i64);
        Retention {
            ttl,
            max_bytes: cap(bounds.max_bytes),
            per_owner: cap(bounds.per_owner),
            item_max: if bounds.item_max == 0 { u64::MAX } else { bounds.item_max },
            chain_max: if bounds.chain_max == 0 { u64::MAX } else { bounds.chain_max },
            held: AtomicI64::new(0),
            measured: Mutex::new(Instant::now()),
            owners: Mutex::default(),
        }
    }

    /// `bytes` were written for `owner`.
    pub fn grew(&self, owner: &Owner, bytes: usize) {
        self.held.fetch_add(bytes as i64, Ordering::Relaxed);
        if let Some((held, _)) = self.owners.lock().unwrap().get_mut(owner) {
            *held += bytes as i64;
        }
    }
}

impl Store {
    /// Whether `owner` may store more: a 429 past its share or past what the whole store may hold.
    pub async fn room_for(&self, owner: &Owner) -> Result<(), ApiError> {
        let r = &self.retention;
        if let Some(share) = r.per_owner {
            let held = self.owner_holds(owner).await?;
            if held >= share {
                return Err(ApiError::StoreFull {
                    held,
                    cap: share,
                    whose: "Your stored responses and conversations",
                    they: "yours",
                });
            }
        }
        if let Some(max) = r.max_bytes {
            let mut held = r.held.load(Ordering::Relaxed);
            // Full as last measured: measured again (at most every `MEASURE_OWNER`), as deletions make room.
            if held >= max && r.measured.lock().unwrap().elapsed() >= MEASURE_OWNER {
                held = self.measure().await?;
            }
            if held >= max {
                let whose = "This server's stored responses and conversations";
                return Err(ApiError::StoreFull { held, cap: max, whose, they: "they" });
            }
        }
        Ok(())
    }

    /// What the whole store holds, read from the database.
    async fn measure(&self) -> Result<i64, ApiError> {
        *self.retention.measured.lock().unwrap() = Instant::now();
        let held = self.db.stored_bytes().await.map_err(failed)?;
        self.retention.held.store(held, Ordering::Relaxed);
        Ok(held)
    }

    /// What `owner` holds: measured at most `MEASURE_OWNER` ago, plus what was written here since.
    async fn owner_holds(&self, owner: &Owner) -> Result<i64, ApiError> {
        if let Some((held, at)) = self.retention.owners.lock().unwrap().get(owner)
            && at.elapsed() < MEASURE_OWNER
        {
            return Ok(*held);
        }
        let held = self.db.owner_bytes(owner.as_str()).await.map_err(failed)?;
        let mut owners = self.retention.owners.lock().unwrap();
        if owners.len() >= OWNERS_KEPT {
            owners.retain(|_, (_, at)| at.elapsed() < MEASURE_OWNER);
        }
        owners.insert(owner.clone(), (held, Instant::now()));
        Ok(held)
    }

    /// Keep the store within its bounds from now on: a task that expires what is past its time, and measures
    /// what the store holds.
    pub fn keep_within_bounds(self: &Arc<Self>) {
        let me = self.clone();
        self.runtime.spawn(async move {
            let mut tick = tokio::time::interval(MEASURE_EVERY);
            let mut expired: Option<Instant> = None;
            loop {
                tick.tick().await;
                if expired.is_none_or(|at| at.elapsed() >= EXPIRE_EVERY) {
                    expired = Some(Instant::now());
                    me.expire().await;
                }
                if let Err(e) = me.measure().await {
                    tracing::warn!("could not measure the state store: {e}");
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
}

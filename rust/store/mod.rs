//! The state store: what the server keeps across requests: stored responses (the Responses API's `store`,
//! `previous_response_id`, `GET`/`DELETE /v1/responses/{id}` and its input items) and conversations (the
//! Conversations API, and `conversation` on a Responses request).
//!
//! - `db`: the database, SQLite embedded by default (nothing to install or start: a file, or memory) or PostgreSQL
//!   (`--state-store postgresql://…`, shared by replicas behind a gateway), with numbered migrations
//!   (`migrations/<backend>/`) embedded and run at start. Queries are checked at run time (no database at build
//!   time).
//! - `queries`: the SQL, one module per kind of record, written once for both databases.
//! - `items`: input and output items as the store keeps them (ids given, text made parts).
//! - `background`: background responses' claims as the store keeps them, and the wait of a request that continues
//!   one still running (their runs are the worker's: `crate::workers::background`).
//! - `files`: uploaded files, their rows and their contents on disk.
//! - `responses`: what the request path needs on top: chains and conversations spliced before a request's input,
//!   and finished responses written in batches, waited for by the next request that names them.
//! - `retention`: the bounds on what the store keeps, in time and in size.
//! - `hand_over`: the drain's release of the claims this replica holds.

pub mod background;
pub mod batch_status;
pub mod conversations;
pub mod db;
pub mod files;
pub mod hand_over;
pub mod items;
pub mod queries;
pub mod responses;
pub mod retention;

pub use db::Db;

use crate::error::ApiError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// Longest a request waits for a write it depends on (the response it names, the conversation it continues).
pub(crate) const WRITE_WAIT: Duration = Duration::from_secs(10);

/// A write's outcome as those who wait for it see it: None while it is on its way; then committed, or why not
/// (`Some(why)`: the store cannot commit now, a 503; None: another failure, a 500).
pub type Written = Option<Result<(), Option<&'static str>>>;

/// The store as the request path and the routes use it: the database, and the writes still on their way to it.
pub struct Store {
    pub db: Arc<Db>,
    /// Records being written (a response's id, the conversation it adds to): their writes' outcomes.
    writing: Mutex<HashMap<String, watch::Receiver<Written>>>,
    writer: mpsc::Sender<responses::Write>,
    runtime: tokio::runtime::Handle,
    /// Rung by the background worker as a run here has written its final state: a chain waiting on it goes on.
    pub run_ended: tokio::sync::Notify,
    /// Where uploaded files' contents go; None: no files.
    pub files: Option<files::FileRoom>,
    /// Rung when a batch is created or cancelled here: the batch runner looks at once (`crate::batches`).
    pub batch_bell: tokio::sync::Notify,
    /// How long and how much it keeps.
    pub retention: retention::Retention,
    /// This replica's name in claims (background responses).
    pub instance: String,
    /// How long a claim (a batch's, a background response's) holds without renewal, in seconds (`--claim-lease`).
    pub lease_s: i64,
    /// Set as a drain begins: the claims held here are released for another replica.
    pub hand_over: hand_over::HandOver,
}

impl Store {
    pub fn new(
        db: Db,
        files: Option<files::FileRoom>,
        retention: retention::Retention,
        lease_s: i64,
        runtime: tokio::runtime::Handle,
    ) -> Arc<Self> {
        let db = Arc::new(db);
        let (writer, queue) = mpsc::channel(responses::WRITE_QUEUE);
        let me = Arc::new(Store {
            db: db.clone(),
            writing: Mutex::new(HashMap::new()),
            writer,
            runtime,
            run_ended: tokio::sync::Notify::new(),
            files,
            batch_bell: tokio::sync::Notify::new(),
            retention,
            instance: crate::ids::random_id("replica"),
            lease_s,
            hand_over: Default::default(),
        });
        me.runtime.spawn(responses::write_all(Arc::downgrade(&me), db, queue));
        me
    }

    /// Wait until the write of `key` (a response id, a conversation id) on its way, if any, is in the database.
    pub async fn settled(&self, key: &str) {
        let writing = self.writing.lock().unwrap().get(key).cloned();
        if let Some(mut done) = writing {
            let _ = tokio::time::timeout(WRITE_WAIT, done.wait_for(Option::is_some)).await;
        }
    }
}

/// A store error as the client sees it: a 503 `store_unavailable` with Retry-After when the database cannot
/// commit now (unreachable, busy, its disk full: the write's transaction rolled back, nothing was kept), else a
/// 500 `store_error`; the cause goes to the log.
pub fn failed(e: StoreError) -> ApiError {
    tracing::error!("{e}");
    match e.unavailable() {
        Some(why) => ApiError::StoreUnavailable(why),
        None => ApiError::Store,
    }
}

/// Why the store cannot commit now, as a client reads it.
pub const DISK_FULL: &str = "its disk is full";
pub(crate) const UNREACHABLE: &str = "its database cannot be reached";
pub(crate) const BUSY: &str = "its database is busy";

impl StoreError {
    /// Why the database cannot commit now, if that is what failed (a retry may succeed once it is back): its
    /// disk full (SQLite's SQLITE_FULL, PostgreSQL's 53100, ENOSPC), the connection lost or not to be had in time,
    /// the database locked or shutting down. None for a failure a retry would not mend.
    pub fn unavailable(&self) -> Option<&'static str> {
        if let StoreError::Unavailable(why) = self {
            return Some(why);
        }
        let StoreError::Db(e) = self else { return None };
        match e {
            sqlx::Error::Io(io) if io.raw_os_error() == Some(28) => Some(DISK_FULL),
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::WorkerCrashed
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_) => Some(UNREACHABLE),
            sqlx::Error::Database(d) if d.message().contains("database or disk is full") => Some(DISK_FULL),
            sqlx::Error::Database(d) => database_unavailable(d.code().as_deref().unwrap_or_default()),
            _ => None,
        }
    }
}

/// A database error code's meaning for availability: SQLite's are numbers of at most four digits (extended
/// codes: the primary code is the low byte), PostgreSQL's five characters (SQLSTATE, some all digits).
fn database_unavailable(code: &str) -> Option<&'static str> {
    if let Ok(n) = code.parse::<i32>()
        && code.len() < 5
    {
        return match n & 0xff {
            13 => Some(DISK_FULL),             // SQLITE_FULL
            5 | 6 => Some(BUSY),               // SQLITE_BUSY, SQLITE_LOCKED
            10 | 14 | 15 => Some(UNREACHABLE), // SQLITE_IOERR, SQLITE_CANTOPEN, SQLITE_PROTOCOL
            _ => None,
        };
    }
    match code {
        "53100" => Some(DISK_FULL),
        "40001" | "40P01" | "55P03" => Some(BUSY), // serialization failure, deadlock, lock not available
        c if c.starts_with("53") => Some(BUSY),    // out of memory, too many connections
        c if c.starts_with("08") || c.starts_with("57P") => Some(UNREACHABLE), // connection lost, shutting down
        _ => None,
    }
}

/// A response as stored: its JSON as the client got it, and the items it was generated from.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredResponse {
    pub id: String,
    pub created_at: i64,
    pub model: String,
    pub previous_response_id: Option<String>,
    /// JSON array: the items of the chain before this response's own input, for rows written before chains were
    /// walked; `CHAINED` (empty) for the others, whose chain is their previous responses' (`queries::responses`).
    pub context: String,
    /// JSON array: this request's own input items, each with an id.
    pub input_items: String,
    /// JSON object: the Response.
    pub response: String,
    /// Whose it is (`crate::owner`): '' for the anonymous owner.
    pub owned_by: String,
}

/// A response's `context` when it keeps only its own items: its chain is read through `previous_response_id`.
pub const CHAINED: &str = "";

/// A conversation as stored: its metadata (a JSON object) and times; its items are rows of their own.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredConversation {
    pub id: String,
    pub created_at: i64,
    pub updated_at: i64,
    pub metadata: String,
    pub owned_by: String,
}

/// An uploaded file's metadata; its content is a file named by its id in the files directory.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredFile {
    pub id: String,
    pub created_at: i64,
    pub expires_at: Option<i64>,
    pub bytes: i64,
    pub filename: String,
    pub purpose: String,
    pub owned_by: String,
}

/// A batch: its Batch object as clients read it, and its status for the runner's queries.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredBatch {
    pub id: String,
    pub created_at: i64,
    /// The status column: the same text as the Batch object's `status` (the two are always written together).
    #[sqlx(try_from = "String")]
    pub status: batch_status::BatchStatus,
    pub batch: String,
    /// The span of the request that created it (`crate::trace::stored`), which its lines' spans link to; None
    /// when traces were off.
    pub trace_context: Option<String>,
    pub owned_by: String,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state store: {0}")]
    Db(#[from] sqlx::Error),
    #[error("state store migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("state store: {0}")]
    Config(String),
    /// A write the store could not commit now (`StoreError::unavailable` of the error underneath, met through a
    /// path that reports it as an `ApiError`).
    #[error("state store: {0}")]
    Unavailable(&'static str),
}

/// A connection string without its password, for logs.
pub fn redacted(spec: &str) -> String {
    match url::Url::parse(spec) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        _ => spec.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_retry_may_mend_is_unavailable() {
        assert_eq!(database_unavailable("13"), Some(DISK_FULL)); // SQLITE_FULL
        assert_eq!(database_unavailable("517"), Some(BUSY)); // SQLITE_BUSY_SNAPSHOT: its primary code is BUSY
        assert_eq!(database_unavailable("1034"), Some(UNREACHABLE)); // SQLITE_IOERR_FSYNC
        assert_eq!(database_unavailable("53100"), Some(DISK_FULL));
        assert_eq!(database_unavailable("57P01"), Some(UNREACHABLE)); // admin_shutdown
        assert_eq!(database_unavailable("08006"), Some(UNREACHABLE)); // connection_failure
        assert_eq!(database_unavailable("2067"), None); // SQLITE_CONSTRAINT_UNIQUE: a retry would not mend it
        assert_eq!(database_unavailable("23505"), None);
        assert_eq!(StoreError::Db(sqlx::Error::PoolTimedOut).unavailable(), Some(UNREACHABLE));
        assert_eq!(StoreError::Config("x".into()).unavailable(), None);
    }
}

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
//! - `background`: background responses' live streams, while they run here.
//! - `files`: uploaded files, their rows and their contents on disk.
//! - `responses`: what the request path needs on top: chains and conversations spliced before a request's input,
//!   and finished responses written in batches, waited for by the next request that names them.
//! - `retention`: the bounds on what the store keeps, in time and in size.
//! - `hand_over`: the drain's release of the claims this replica holds.

pub mod background;
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

/// The store as the request path and the routes use it: the database, and the writes still on their way to it.
pub struct Store {
    pub db: Arc<Db>,
    /// Records being written (a response's id, the conversation it adds to): their writes' "done" flags.
    writing: Mutex<HashMap<String, watch::Receiver<bool>>>,
    writer: mpsc::Sender<responses::Write>,
    runtime: tokio::runtime::Handle,
    /// Background responses running here (or finished, kept for replay).
    pub runs: Arc<background::Runs>,
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
        runs: background::Limits,
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
            runs: Arc::new(background::Runs::new(runs)),
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
            let _ = tokio::time::timeout(WRITE_WAIT, done.wait_for(|d| *d)).await;
        }
    }
}

/// A store error as the client sees it: a 507 if the database's disk is full (nothing was kept: the write's
/// transaction rolled back), else a 500 with the store's code; the cause goes to the log.
pub fn failed(e: StoreError) -> ApiError {
    tracing::error!("{e}");
    if e.disk_full() { ApiError::DiskFull("the record") } else { ApiError::Store }
}

impl StoreError {
    /// Whether the database ran out of room: SQLite's SQLITE_FULL (13), PostgreSQL's disk_full (53100) or
    /// ENOSPC underneath.
    pub fn disk_full(&self) -> bool {
        match self {
            StoreError::Db(sqlx::Error::Database(e)) => {
                matches!(e.code().as_deref(), Some("13" | "53100")) || e.message().contains("database or disk is full")
            }
            StoreError::Db(sqlx::Error::Io(e)) => e.raw_os_error() == Some(28),
            _ => false,
        }
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
    pub status: String,
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

//! The state store: what the server keeps across requests. Today that is stored responses (the Responses API's
//! `store`, `previous_response_id`, `GET`/`DELETE /v1/responses/{id}` and its input items).
//!
//! One trait, `Store`, with two implementations, so handlers never know which one runs:
//! - `sqlite`: embedded, the default; nothing to install or start (a file, or memory);
//! - `postgres`: `--state-store postgresql://…`, shared by replicas behind a gateway.
//!
//! Each has its numbered migrations (`migrations/<backend>/`, here), embedded and run at start. Queries are checked at
//! run time (no database at build time). `responses` keeps what the request path needs on top: a response being
//! written is waited for by the next request that names it.

mod postgres;
pub mod responses;
mod sqlite;

use futures_util::future::BoxFuture;

/// A response as stored: its JSON as the client got it, and the items it was generated from.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct StoredResponse {
    pub id: String,
    pub created_at: i64,
    pub model: String,
    pub previous_response_id: Option<String>,
    /// JSON array: the items of the chain before this response's own input.
    pub context: String,
    /// JSON array: this request's own input items, each with an id.
    pub input_items: String,
    /// JSON object: the Response.
    pub response: String,
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

/// What the server keeps, whichever database holds it.
pub trait Store: Send + Sync {
    /// Insert responses, in one transaction (an id already there is replaced: a retried write is harmless).
    fn put_responses<'a>(&'a self, rs: &'a [StoredResponse]) -> BoxFuture<'a, Result<(), StoreError>>;
    fn get_response<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<StoredResponse>, StoreError>>;
    /// Whether it was there.
    fn delete_response<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, StoreError>>;
    /// Remove the responses created before `created_before` (Unix seconds); how many went.
    fn expire_responses(&self, created_before: i64) -> BoxFuture<'_, Result<u64, StoreError>>;
}

/// Open the store `spec` names, running its migrations: `postgres://…` / `postgresql://…`, `sqlite://PATH`,
/// `sqlite::memory:` / `memory` (gone with the process), or a bare file path (SQLite).
pub async fn open(spec: &str) -> Result<Box<dyn Store>, StoreError> {
    if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
        return Ok(Box::new(postgres::PgStore::open(spec).await?));
    }
    let spec = if spec == "memory" { "sqlite::memory:" } else { spec };
    Ok(Box::new(sqlite::SqliteStore::open(spec).await?))
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

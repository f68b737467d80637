//! The database behind the store: SQLite (bundled, one file per server, or memory) or PostgreSQL (shared by
//! replicas behind a gateway). Both take the same SQL: numbered parameters (`$1`, which sqlx's SQLite driver reads
//! as PostgreSQL does) and `ON CONFLICT` upserts, so each query is written once (`queries/`) and `on_pool!` runs
//! it on whichever pool is open. Only the migrations (`migrations/<backend>/`) and the pools' settings differ.

use super::StoreError;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use std::str::FromStr;
use std::time::Duration;

pub enum Pool {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

/// The state store's database, migrated.
pub struct Db {
    pub(super) pool: Pool,
}

/// Run `$body` with `$p` bound to the open pool, whichever it is: the body is compiled once per backend from the
/// same source.
macro_rules! on_pool {
    ($db:expr, |$p:ident| $body:expr) => {
        match &$db.pool {
            $crate::store::db::Pool::Sqlite($p) => $body,
            $crate::store::db::Pool::Postgres($p) => $body,
        }
    };
}
pub(super) use on_pool;

impl Db {
    /// Open the store `spec` names, running its migrations: `postgres://…` / `postgresql://…`, `sqlite://PATH`,
    /// `sqlite::memory:` / `memory` (gone with the process), or a bare file path (SQLite).
    pub async fn open(spec: &str) -> Result<Self, StoreError> {
        if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
            let pool =
                PgPoolOptions::new().max_connections(8).acquire_timeout(Duration::from_secs(10)).connect(spec).await?;
            sqlx::migrate!("./rust/store/migrations/postgres").run(&pool).await?;
            return Ok(Db { pool: Pool::Postgres(pool) });
        }
        let spec = if spec == "memory" { "sqlite::memory:" } else { spec };
        let memory = spec.contains(":memory:");
        let url = if spec.starts_with("sqlite:") { spec.to_string() } else { format!("sqlite://{spec}") };
        let options = SqliteConnectOptions::from_str(&url)?
            .create_if_missing(true)
            // WAL: readers never wait for the writer; NORMAL: a commit is durable against a crash of the process
            // (not of the host), at a fraction of FULL's fsyncs.
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(Duration::from_secs(5));
        // An in-memory database lives as long as its connection: one connection, never closed.
        let pool = SqlitePoolOptions::new()
            .max_connections(if memory { 1 } else { 4 })
            .min_connections(if memory { 1 } else { 0 })
            .idle_timeout(if memory { None } else { Some(Duration::from_secs(600)) })
            .max_lifetime(if memory { None } else { Some(Duration::from_secs(3600)) })
            .connect_with(options)
            .await?;
        sqlx::migrate!("./rust/store/migrations/sqlite").run(&pool).await?;
        Ok(Db { pool: Pool::Sqlite(pool) })
    }
}

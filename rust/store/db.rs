//! The database behind the store: SQLite (bundled, one file per server, or memory) or PostgreSQL (shared by
//! replicas behind a gateway). Both take the same SQL: numbered parameters (`$1`, which sqlx's SQLite driver reads
//! as PostgreSQL does) and `ON CONFLICT` upserts, so each query is written once (`queries/`) and `on_pool!` runs
//! it on whichever pool is open. Only the migrations (`migrations/<backend>/`) and the pools' settings differ.

use super::StoreError;
use sqlx::Connection;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgPool, PgPoolOptions, Postgres};
use sqlx::sqlite::{Sqlite, SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
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

/// A connection the store's writer keeps across its writes. Each use of the pool costs two round trips more than
/// the query (sqlx checks a connection as it is taken and again as it is given back), and for SQLite each round
/// trip is two thread switches to its connection's worker thread: on a short stored response, more than the
/// write itself.
pub enum Held {
    Sqlite(PoolConnection<Sqlite>),
    Postgres(PoolConnection<Postgres>),
}

impl Held {
    /// Close it as it is dropped, instead of giving it back: a write failed on it, and whatever state that left
    /// (a transaction whose rollback failed, a broken socket) goes with it.
    pub fn discard(mut self) {
        match &mut self {
            Held::Sqlite(c) => c.close_on_drop(),
            Held::Postgres(c) => c.close_on_drop(),
        }
    }
}

/// Run `$body` with `$e` bound to an executor: the held connection if there is one, else the pool.
macro_rules! on_held {
    ($db:expr, $held:expr, |$e:ident| $body:expr) => {
        match ($held, &$db.pool) {
            (Some($crate::store::db::Held::Sqlite(c)), _) => {
                let $e = &mut **c;
                $body
            }
            (Some($crate::store::db::Held::Postgres(c)), _) => {
                let $e = &mut **c;
                $body
            }
            (None, $crate::store::db::Pool::Sqlite(p)) => {
                let $e = p;
                $body
            }
            (None, $crate::store::db::Pool::Postgres(p)) => {
                let $e = p;
                $body
            }
        }
    };
}
pub(super) use on_held;

impl Db {
    /// Open the store `spec` names, running its migrations: `postgres://…` / `postgresql://…`, `sqlite://PATH`,
    /// `sqlite::memory:` / `memory` (gone with the process), or a bare file path (SQLite).
    pub async fn open(spec: &str) -> Result<Self, StoreError> {
        if spec.starts_with("postgres://") || spec.starts_with("postgresql://") {
            let pool = PgPoolOptions::new()
                .max_connections(8)
                .acquire_timeout(Duration::from_secs(10))
                .after_release(|conn, _| Box::pin(async move { Ok(!conn.is_in_transaction()) }))
                .connect(spec)
                .await?;
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
            // A local file's connection does not go stale: no ping (a round trip to its worker thread) to check
            // each one out.
            .test_before_acquire(false)
            // A connection given back still inside a transaction is closed (which rolls it back), never reused: a
            // write that fails on a full disk can leave SQLite's ROLLBACK refused too, and the connection would
            // then keep the database's write lock ("database is locked" for every other) and take later writes
            // into savepoints of a transaction never committed (acknowledged, then lost). The one connection of an
            // in-memory database is the database: it is kept.
            .after_release(move |conn, _| Box::pin(async move { Ok(memory || !conn.is_in_transaction()) }))
            .connect_with(options)
            .await?;
        sqlx::migrate!("./rust/store/migrations/sqlite").run(&pool).await?;
        Ok(Db { pool: Pool::Sqlite(pool) })
    }

    /// A connection for the writer to keep; None for an in-memory SQLite, whose one connection every query shares.
    /// One whose write failed is dropped with `Held::discard`.
    pub async fn hold(&self) -> Result<Option<Held>, StoreError> {
        Ok(match &self.pool {
            Pool::Sqlite(p) if p.options().get_max_connections() == 1 => None,
            Pool::Sqlite(p) => Some(Held::Sqlite(p.acquire().await?)),
            Pool::Postgres(p) => Some(Held::Postgres(p.acquire().await?)),
        })
    }
}

//! The embedded store: SQLite (bundled), one file per server, or memory.

use super::{Store, StoreError, StoredResponse};
use futures_util::future::BoxFuture;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use std::str::FromStr;
use std::time::Duration;

pub struct SqliteStore {
    pool: SqlitePool,
}

impl SqliteStore {
    pub async fn open(spec: &str) -> Result<Self, StoreError> {
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
        Ok(SqliteStore { pool })
    }
}

impl Store for SqliteStore {
    fn put_responses<'a>(&'a self, rs: &'a [StoredResponse]) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut tx = self.pool.begin().await?;
            for r in rs {
                sqlx::query(
                    "INSERT OR REPLACE INTO responses \
                 (id, created_at, model, previous_response_id, context, input_items, response) \
                 VALUES (?, ?, ?, ?, ?, ?, ?)",
                )
                .bind(&r.id)
                .bind(r.created_at)
                .bind(&r.model)
                .bind(&r.previous_response_id)
                .bind(&r.context)
                .bind(&r.input_items)
                .bind(&r.response)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
            Ok(())
        })
    }

    fn get_response<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Option<StoredResponse>, StoreError>> {
        Box::pin(async move {
            let q = sqlx::query_as::<_, StoredResponse>("SELECT * FROM responses WHERE id = ?");
            Ok(q.bind(id).fetch_optional(&self.pool).await?)
        })
    }

    fn delete_response<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let done = sqlx::query("DELETE FROM responses WHERE id = ?").bind(id).execute(&self.pool).await?;
            Ok(done.rows_affected() > 0)
        })
    }

    fn expire_responses(&self, created_before: i64) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let q = sqlx::query("DELETE FROM responses WHERE created_at < ?").bind(created_before);
            Ok(q.execute(&self.pool).await?.rows_affected())
        })
    }
}

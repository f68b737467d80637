//! The shared store: PostgreSQL, for replicas behind a gateway that must see each other's responses.

use super::{Store, StoreError, StoredResponse};
use futures_util::future::BoxFuture;
use sqlx::postgres::{PgPool, PgPoolOptions};
use std::time::Duration;

pub struct PgStore {
    pool: PgPool,
}

impl PgStore {
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        let pool =
            PgPoolOptions::new().max_connections(8).acquire_timeout(Duration::from_secs(10)).connect(url).await?;
        sqlx::migrate!("./rust/store/migrations/postgres").run(&pool).await?;
        Ok(PgStore { pool })
    }
}

impl Store for PgStore {
    fn put_responses<'a>(&'a self, rs: &'a [StoredResponse]) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut tx = self.pool.begin().await?;
            for r in rs {
                sqlx::query(
                    "INSERT INTO responses (id, created_at, model, previous_response_id, context, input_items, response) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) \
                 ON CONFLICT (id) DO UPDATE SET response = EXCLUDED.response",
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
            let q = sqlx::query_as::<_, StoredResponse>("SELECT * FROM responses WHERE id = $1");
            Ok(q.bind(id).fetch_optional(&self.pool).await?)
        })
    }

    fn delete_response<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let done = sqlx::query("DELETE FROM responses WHERE id = $1").bind(id).execute(&self.pool).await?;
            Ok(done.rows_affected() > 0)
        })
    }

    fn expire_responses(&self, created_before: i64) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let q = sqlx::query("DELETE FROM responses WHERE created_at < $1").bind(created_before);
            Ok(q.execute(&self.pool).await?.rows_affected())
        })
    }
}

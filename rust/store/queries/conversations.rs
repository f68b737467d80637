//! Conversations' rows: the conversation, and its items in the order they were added (`seq`, one sequence for
//! every conversation, so two replicas appending at once never collide).

use crate::store::db::{Db, on_pool};
use crate::store::{StoreError, StoredConversation};

/// One page of a conversation's items (their JSON), and whether more follow.
pub struct ItemPage {
    pub items: Vec<String>,
    pub has_more: bool,
}

/// An item at the end of a conversation, with its size (for the store's size cap).
const INSERT_ITEM: &str =
    "INSERT INTO conversation_items (conversation_id, id, item, bytes, owned_by) VALUES ($1, $2, $3, $4, $5)";

impl Db {
    /// A new conversation with its first items, in one transaction.
    pub async fn put_conversation(&self, c: &StoredConversation, items: &[(String, String)]) -> Result<(), StoreError> {
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            sqlx::query(
                "INSERT INTO conversations (id, created_at, updated_at, metadata, owned_by) VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(&c.id)
            .bind(c.created_at)
            .bind(c.updated_at)
            .bind(&c.metadata)
            .bind(&c.owned_by)
            .execute(&mut *tx)
            .await?;
            for (id, item) in items {
                let q = sqlx::query(INSERT_ITEM).bind(&c.id).bind(id).bind(item).bind(item.len() as i64);
                let q = q.bind(&c.owned_by);
                q.execute(&mut *tx).await?;
            }
            tx.commit().await?;
        });
        Ok(())
    }

    pub async fn get_conversation(&self, id: &str) -> Result<Option<StoredConversation>, StoreError> {
        let q = "SELECT * FROM conversations WHERE id = $1";
        Ok(on_pool!(self, |pool| sqlx::query_as(q).bind(id).fetch_optional(pool).await?))
    }

    /// Replace its metadata; whether it was there.
    pub async fn set_conversation_metadata(&self, id: &str, metadata: &str, now: i64) -> Result<bool, StoreError> {
        let q = "UPDATE conversations SET metadata = $2, updated_at = $3 WHERE id = $1";
        let n = on_pool!(self, |pool| sqlx::query(q)
            .bind(id)
            .bind(metadata)
            .bind(now)
            .execute(pool)
            .await?
            .rows_affected());
        Ok(n > 0)
    }

    /// The conversation and its items; whether it was there.
    pub async fn delete_conversation(&self, id: &str) -> Result<bool, StoreError> {
        let n = on_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            sqlx::query("DELETE FROM conversation_items WHERE conversation_id = $1").bind(id).execute(&mut *tx).await?;
            let n = sqlx::query("DELETE FROM conversations WHERE id = $1").bind(id).execute(&mut *tx).await?;
            tx.commit().await?;
            n.rows_affected()
        });
        Ok(n > 0)
    }

    /// Add items at the end, in one transaction; false (and nothing added) if the conversation is not there.
    pub async fn append_items(&self, id: &str, items: &[(String, String)], now: i64) -> Result<bool, StoreError> {
        on_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            // Its items are its owner's, whoever adds them (a response's writer adds them too).
            let owner: Option<String> =
                sqlx::query_scalar("UPDATE conversations SET updated_at = $2 WHERE id = $1 RETURNING owned_by")
                    .bind(id)
                    .bind(now)
                    .fetch_optional(&mut *tx)
                    .await?;
            let Some(owner) = owner else { return Ok(false) };
            for (item_id, item) in items {
                let q = sqlx::query(INSERT_ITEM).bind(id).bind(item_id).bind(item).bind(item.len() as i64);
                let q = q.bind(&owner);
                q.execute(&mut *tx).await?;
            }
            tx.commit().await?;
        });
        Ok(true)
    }

    pub async fn count_items(&self, id: &str) -> Result<i64, StoreError> {
        Ok(self.conversation_size(id).await?.0)
    }

    /// How many items it holds, and their bytes.
    pub async fn conversation_size(&self, id: &str) -> Result<(i64, i64), StoreError> {
        let q = "SELECT COUNT(*), CAST(COALESCE(SUM(bytes), 0) AS BIGINT) FROM conversation_items \
                 WHERE conversation_id = $1";
        Ok(on_pool!(self, |pool| sqlx::query_as(q).bind(id).fetch_one(pool).await?))
    }

    /// Up to `limit` items after the item `after` (from either end without it), in order or newest first; None
    /// when `after` is not one of its items.
    pub async fn list_items(
        &self,
        id: &str,
        after: Option<&str>,
        limit: i64,
        ascending: bool,
    ) -> Result<Option<ItemPage>, StoreError> {
        let from = match after {
            Some(after) => {
                let q = "SELECT MIN(seq) FROM conversation_items WHERE conversation_id = $1 AND id = $2";
                let seq: Option<i64> =
                    on_pool!(self, |pool| sqlx::query_scalar(q).bind(id).bind(after).fetch_one(pool).await?);
                match seq {
                    Some(seq) => seq,
                    None => return Ok(None),
                }
            }
            None if ascending => 0,
            None => i64::MAX,
        };
        let q = if ascending {
            "SELECT item FROM conversation_items WHERE conversation_id = $1 AND seq > $2 ORDER BY seq ASC LIMIT $3"
        } else {
            "SELECT item FROM conversation_items WHERE conversation_id = $1 AND seq < $2 ORDER BY seq DESC LIMIT $3"
        };
        let mut items: Vec<String> =
            on_pool!(self, |pool| sqlx::query_scalar(q).bind(id).bind(from).bind(limit + 1).fetch_all(pool).await?);
        let has_more = items.len() as i64 > limit;
        items.truncate(limit.max(0) as usize);
        Ok(Some(ItemPage { items, has_more }))
    }

    pub async fn get_item(&self, id: &str, item_id: &str) -> Result<Option<String>, StoreError> {
        let q = "SELECT item FROM conversation_items WHERE conversation_id = $1 AND id = $2 ORDER BY seq LIMIT 1";
        Ok(on_pool!(self, |pool| sqlx::query_scalar(q).bind(id).bind(item_id).fetch_optional(pool).await?))
    }

    /// Whether it was there.
    pub async fn delete_item(&self, id: &str, item_id: &str) -> Result<bool, StoreError> {
        let q = "DELETE FROM conversation_items WHERE conversation_id = $1 AND id = $2";
        Ok(on_pool!(self, |pool| sqlx::query(q).bind(id).bind(item_id).execute(pool).await?.rows_affected()) > 0)
    }

    /// Remove the conversations not touched since `updated_before` (Unix seconds), with their items; how many went.
    pub async fn expire_conversations(&self, updated_before: i64) -> Result<u64, StoreError> {
        let n = on_pool!(self, |pool| {
            let mut tx = pool.begin().await?;
            sqlx::query(
                "DELETE FROM conversation_items WHERE conversation_id IN \
                 (SELECT id FROM conversations WHERE updated_at < $1)",
            )
            .bind(updated_before)
            .execute(&mut *tx)
            .await?;
            let n = sqlx::query("DELETE FROM conversations WHERE updated_at < $1")
                .bind(updated_before)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            n.rows_affected()
        });
        Ok(n)
    }
}

//! Conversations (OpenAI's Conversations API) on top of the database: what the routes and the request path ask
//! of them, each waiting first for a response's items still on their way to the conversation.

use super::items::{client_items, row};
use super::queries::conversations::ItemPage;
use super::{Store, StoredConversation, failed, items};
use crate::error::ApiError;
use crate::limits::{MAX_CONVERSATION_ADD_ITEMS, MAX_CONVERSATION_ITEMS};
use crate::owner::Owner;
use serde_json::{Map, Value, json};

/// Metadata: at most 16 pairs, keys of at most 64 characters, string values of at most 512 (OpenAI's limits).
const METADATA_PAIRS: usize = 16;
const METADATA_KEY: usize = 64;
const METADATA_VALUE: usize = 512;

impl Store {
    /// A new conversation of `owner`'s with its first items (checked: at most `MAX_CONVERSATION_ADD_ITEMS`, each within the item
    /// cap, and the owner within its share).
    pub async fn create_conversation(
        &self,
        owner: &Owner,
        items: &[Value],
        metadata: Option<&Value>,
    ) -> Result<Value, ApiError> {
        let metadata = checked_metadata(metadata)?;
        let rows = self.checked_items(items)?;
        self.room_for(owner).await?;
        let now = items::now();
        let c = StoredConversation {
            id: crate::ids::random_id("conv"),
            created_at: now,
            updated_at: now,
            metadata: metadata.to_string(),
            owned_by: owner.as_str().to_string(),
        };
        self.db.put_conversation(&c, &rows).await.map_err(failed)?;
        self.retention.grew(owner, rows.iter().map(|(_, item)| item.len()).sum());
        Ok(object(&c))
    }

    pub async fn conversation(&self, id: &str, owner: &Owner) -> Result<Value, ApiError> {
        Ok(object(&self.find(id, owner).await?))
    }

    pub async fn set_metadata(&self, id: &str, owner: &Owner, metadata: Option<&Value>) -> Result<Value, ApiError> {
        let metadata = checked_metadata(metadata)?;
        self.find(id, owner).await?;
        if !self.db.set_conversation_metadata(id, &metadata.to_string(), items::now()).await.map_err(failed)? {
            return Err(not_found(id));
        }
        self.conversation(id, owner).await
    }

    pub async fn delete_conversation(&self, id: &str, owner: &Owner) -> Result<Value, ApiError> {
        self.find(id, owner).await?;
        if !self.db.delete_conversation(id).await.map_err(failed)? {
            return Err(not_found(id));
        }
        Ok(json!({"id": id, "object": "conversation.deleted", "deleted": true}))
    }

    /// Add items at its end; the items as added (with their ids).
    pub async fn add_items(&self, id: &str, owner: &Owner, items: &[Value]) -> Result<Vec<Value>, ApiError> {
        let rows = self.checked_items(items)?;
        self.find(id, owner).await?;
        self.room_for(owner).await?;
        let held = self.db.count_items(id).await.map_err(failed)?;
        if held + rows.len() as i64 > MAX_CONVERSATION_ITEMS {
            return Err(full(id));
        }
        if !self.db.append_items(id, &rows, items::now()).await.map_err(failed)? {
            return Err(not_found(id));
        }
        self.retention.grew(owner, rows.iter().map(|(_, item)| item.len()).sum());
        rows.iter().map(|(_, item)| serde_json::from_str(item).map_err(|_| ApiError::Internal)).collect()
    }

    pub async fn list_items(
        &self,
        id: &str,
        owner: &Owner,
        after: Option<&str>,
        limit: i64,
        asc: bool,
    ) -> Result<ItemPage, ApiError> {
        self.find(id, owner).await?;
        let page = self.db.list_items(id, after, limit, asc).await.map_err(failed)?;
        page.ok_or_else(|| ApiError::bad_param("after", format!("No item with id '{}'.", after.unwrap_or_default())))
    }

    pub async fn item(&self, id: &str, owner: &Owner, item_id: &str) -> Result<String, ApiError> {
        self.find(id, owner).await?;
        let item = self.db.get_item(id, item_id).await.map_err(failed)?;
        item.ok_or_else(|| ApiError::NotFound { what: "Item", id: item_id.to_string(), param: None })
    }

    /// Delete one item; the conversation, as OpenAI answers.
    pub async fn delete_item(&self, id: &str, owner: &Owner, item_id: &str) -> Result<Value, ApiError> {
        let c = self.find(id, owner).await?;
        if !self.db.delete_item(id, item_id).await.map_err(failed)? {
            return Err(ApiError::NotFound { what: "Item", id: item_id.to_string(), param: None });
        }
        Ok(object(&c))
    }

    /// The items a Responses request that names the conversation starts from, in order: a 400 naming
    /// `conversation` at once, before its items are read, if they hold more than `--state-store-max-chain-bytes`.
    pub(super) async fn conversation_context(&self, id: &str, owner: &Owner) -> Result<Vec<Value>, ApiError> {
        let param = Some("conversation");
        self.settled(id).await;
        let found = self.db.get_conversation(id).await.map_err(failed)?;
        if found.is_none_or(|c| c.owned_by != owner.as_str()) {
            return Err(ApiError::NotFound { what: "Conversation", id: id.to_string(), param });
        }
        let (held, bytes) = self.db.conversation_size(id).await.map_err(failed)?;
        if held >= MAX_CONVERSATION_ITEMS {
            return Err(full(id));
        }
        if bytes as u64 > self.retention.chain_max {
            return Err(super::responses::too_long("conversation", id, bytes, self.retention.chain_max));
        }
        let page = self
            .db
            .list_items(id, None, held, true)
            .await
            .map_err(failed)?
            .unwrap_or(ItemPage { items: Vec::new(), has_more: false });
        page.items.iter().map(|i| serde_json::from_str(i).map_err(|_| ApiError::Internal)).collect()
    }

    /// `owner`'s conversation `id`: another owner's is not found.
    async fn find(&self, id: &str, owner: &Owner) -> Result<StoredConversation, ApiError> {
        self.settled(id).await;
        let c = self.db.get_conversation(id).await.map_err(failed)?;
        c.filter(|c| c.owned_by == owner.as_str()).ok_or_else(|| not_found(id))
    }

    /// Items a client adds, checked: at most `MAX_CONVERSATION_ADD_ITEMS`, each an item no larger than `--state-store-max-item-bytes`.
    fn checked_items(&self, items: &[Value]) -> Result<Vec<(String, String)>, ApiError> {
        if items.len() > MAX_CONVERSATION_ADD_ITEMS {
            return Err(ApiError::bad_param(
                "items",
                format!("At most {MAX_CONVERSATION_ADD_ITEMS} items may be added at once."),
            ));
        }
        let items = client_items(items).map_err(|(i, why)| ApiError::bad_param(&format!("items[{i}]"), why))?;
        let max = self.retention.item_max;
        if let Some((i, n)) = super::items::too_large(&items, max) {
            let msg = format!("This item holds {n} bytes; the most an item stored here may hold is {max}.");
            return Err(ApiError::bad_param(&format!("items[{i}]"), msg));
        }
        Ok(items.iter().map(row).collect())
    }
}

/// The Conversation object.
fn object(c: &StoredConversation) -> Value {
    let metadata: Value = serde_json::from_str(&c.metadata).unwrap_or_else(|_| json!({}));
    json!({"id": c.id, "object": "conversation", "created_at": c.created_at, "metadata": metadata})
}

pub fn checked_metadata(metadata: Option<&Value>) -> Result<Value, ApiError> {
    let bad = |why: String| ApiError::bad_param("metadata", why);
    let pairs = match metadata {
        None | Some(Value::Null) => return Ok(Value::Object(Map::new())),
        Some(Value::Object(pairs)) => pairs,
        Some(_) => return Err(bad("'metadata' must be an object of strings.".into())),
    };
    if pairs.len() > METADATA_PAIRS {
        return Err(bad(format!("'metadata' may hold at most {METADATA_PAIRS} pairs.")));
    }
    for (k, v) in pairs {
        if k.chars().count() > METADATA_KEY {
            return Err(bad(format!("metadata keys may be at most {METADATA_KEY} characters.")));
        }
        match v {
            Value::String(v) if v.chars().count() <= METADATA_VALUE => {}
            Value::String(_) => {
                return Err(bad(format!("metadata values may be at most {METADATA_VALUE} characters.")));
            }
            _ => return Err(bad("metadata values must be strings.".into())),
        }
    }
    Ok(Value::Object(pairs.clone()))
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound { what: "Conversation", id: id.to_string(), param: None }
}

fn full(id: &str) -> ApiError {
    ApiError::bad_param(
        "conversation",
        format!("Conversation '{id}' holds {MAX_CONVERSATION_ITEMS} items, the most it may."),
    )
}

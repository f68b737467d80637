-- Conversations (OpenAI Conversations API, and `conversation` on a Responses request). `updated_at` moves when
-- items are added: a conversation in use is not expired. Items keep the order they were added in (`seq`, one
-- sequence for all conversations); an item's `id` is its id in the API, `item` its JSON.
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL,
    metadata TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS conversations_updated_at ON conversations (updated_at);
CREATE TABLE IF NOT EXISTS conversation_items (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL,
    id TEXT NOT NULL,
    item TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS conversation_items_order ON conversation_items (conversation_id, seq);
CREATE INDEX IF NOT EXISTS conversation_items_id ON conversation_items (conversation_id, id);

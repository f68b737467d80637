-- What each stored response and conversation item holds, in bytes, kept in its row: the size cap
-- (--state-store-max-bytes) sums it from an index instead of reading every row's text, and evicts oldest first.
ALTER TABLE responses ADD COLUMN bytes BIGINT NOT NULL DEFAULT 0;
UPDATE responses SET bytes = length(CAST(context AS BLOB)) + length(CAST(input_items AS BLOB))
    + length(CAST(response AS BLOB));
CREATE INDEX IF NOT EXISTS responses_age_bytes ON responses (created_at, id, bytes);
-- It leads with created_at: the first index on it (TTL expiry) would only cost every write a second update.
DROP INDEX IF EXISTS responses_created_at;
ALTER TABLE conversation_items ADD COLUMN bytes BIGINT NOT NULL DEFAULT 0;
UPDATE conversation_items SET bytes = length(CAST(item AS BLOB));
CREATE INDEX IF NOT EXISTS conversation_items_bytes ON conversation_items (conversation_id, bytes);
-- Finished batches past the TTL go, oldest first.
CREATE INDEX IF NOT EXISTS batches_created_at ON batches (created_at);

-- Whose each stored record is (issue 39): an API key's owner name (`crate::owner`, a digest of the key), '' for
-- the anonymous owner of a server without keys, which every row stored before this migration is. An owner reads
-- only its own records, and its share of the size caps is summed from the (owned_by, bytes) indexes.
-- (batches.owner is the replica running a batch, hence another name.)
ALTER TABLE responses ADD COLUMN IF NOT EXISTS owned_by TEXT NOT NULL DEFAULT '';
CREATE INDEX IF NOT EXISTS responses_owner_bytes ON responses (owned_by, bytes);
ALTER TABLE conversations ADD COLUMN IF NOT EXISTS owned_by TEXT NOT NULL DEFAULT '';
ALTER TABLE conversation_items ADD COLUMN IF NOT EXISTS owned_by TEXT NOT NULL DEFAULT '';
CREATE INDEX IF NOT EXISTS conversation_items_owner_bytes ON conversation_items (owned_by, bytes);
ALTER TABLE files ADD COLUMN IF NOT EXISTS owned_by TEXT NOT NULL DEFAULT '';
CREATE INDEX IF NOT EXISTS files_owner_bytes ON files (owned_by, bytes);
ALTER TABLE batches ADD COLUMN IF NOT EXISTS owned_by TEXT NOT NULL DEFAULT '';

-- Uploaded files (OpenAI Files API). The content is a file named by the id in the server's files directory (a
-- volume the replicas share); this row is its metadata. `expires_at`: null when it is kept until deleted.
-- `seq`: the order files were made in (lists page by it; `created_at` has whole seconds only).
CREATE TABLE IF NOT EXISTS files (
    seq BIGSERIAL PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    created_at BIGINT NOT NULL,
    expires_at BIGINT,
    bytes BIGINT NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS files_expires_at ON files (expires_at);

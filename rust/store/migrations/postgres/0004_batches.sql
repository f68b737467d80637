-- Batches (OpenAI Batch API). `batch`: the Batch object as clients read it (status, times, counts, file ids);
-- `status` again for the runner's queries. `owner` / `lease_until`: the replica running it, and until when its
-- claim holds (a replica that dies lets another take the batch over once the lease runs out).
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    created_at BIGINT NOT NULL,
    status TEXT NOT NULL,
    batch TEXT NOT NULL,
    owner TEXT,
    lease_until BIGINT
);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
-- Each input line's result, once: the key makes a line run twice (a takeover, a retry) count once.
CREATE TABLE IF NOT EXISTS batch_results (
    batch_id TEXT NOT NULL,
    line BIGINT NOT NULL,
    ok BOOLEAN NOT NULL,
    result TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)
);

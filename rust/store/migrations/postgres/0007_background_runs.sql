-- Background responses while they run: the request, to be run again by another replica (or this one after a
-- restart) if the replica running it dies and its claim, renewed every few seconds, runs out; and a cancel asked
-- through a replica that does not run it, which the one that does reads as it renews.
CREATE TABLE IF NOT EXISTS background_runs (
    id TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    owner TEXT NOT NULL,
    lease_until BIGINT NOT NULL,
    cancel_asked BOOLEAN NOT NULL DEFAULT FALSE
);
CREATE INDEX IF NOT EXISTS background_runs_owner ON background_runs (owner);
CREATE INDEX IF NOT EXISTS background_runs_lease ON background_runs (lease_until);

-- Fencing tokens on the claims (issue 40). A claim is an owner (the replica's runner) and a generation: taking a
-- claim over (its lease ran out, or it was released) adds one to the generation, renewing it does not. Every
-- write the claim's holder makes names both, in the same statement as the write, so a replica that lost its
-- claim (paused past its lease, cut off from the store) has its writes refused and stops at its next step.
ALTER TABLE batches ADD COLUMN claim_gen BIGINT NOT NULL DEFAULT 0;
ALTER TABLE background_runs ADD COLUMN claim_gen BIGINT NOT NULL DEFAULT 0;

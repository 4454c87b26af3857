-- rejected: the reconciler found that the destination refused the message
-- for good (it stored a final 3xx or 4xx answer that a resend would only
-- replay). Like sent and applied, a rejected message is settled: Prune
-- deletes it once Options.Retention has passed since settled_at.
ALTER TABLE dedup_outbox DROP CONSTRAINT IF EXISTS dedup_outbox_state_check;
ALTER TABLE dedup_outbox ADD CONSTRAINT dedup_outbox_state_check
    CHECK (state IN ('pending', 'sending', 'sent', 'applied', 'dead', 'rejected'));

DROP INDEX IF EXISTS dedup_outbox_settled_idx;
CREATE INDEX dedup_outbox_settled_idx ON dedup_outbox (settled_at) WHERE state IN ('sent', 'applied', 'rejected');

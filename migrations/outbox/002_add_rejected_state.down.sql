-- Before the rejected state, the reconciler made such messages dead.
UPDATE dedup_outbox SET state = 'dead' WHERE state = 'rejected';
ALTER TABLE dedup_outbox DROP CONSTRAINT IF EXISTS dedup_outbox_state_check;
ALTER TABLE dedup_outbox ADD CONSTRAINT dedup_outbox_state_check
    CHECK (state IN ('pending', 'sending', 'sent', 'applied', 'dead'));

DROP INDEX IF EXISTS dedup_outbox_settled_idx;
CREATE INDEX dedup_outbox_settled_idx ON dedup_outbox (settled_at) WHERE state IN ('sent', 'applied');

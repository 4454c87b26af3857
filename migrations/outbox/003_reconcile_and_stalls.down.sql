ALTER TABLE dedup_outbox DROP COLUMN IF EXISTS stalls;
ALTER TABLE dedup_outbox DROP COLUMN IF EXISTS in_send;
ALTER TABLE dedup_outbox DROP COLUMN IF EXISTS checked_at;

ALTER TABLE dedup_outbox DROP COLUMN IF EXISTS checked_at;

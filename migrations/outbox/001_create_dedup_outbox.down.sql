DROP TABLE IF EXISTS "dedup_outbox";
-- Outbox.Migrate's record of applied versions, if it made one: left behind,
-- it would take the dropped table for migrated.
DROP TABLE IF EXISTS "dedup_outbox_migration";

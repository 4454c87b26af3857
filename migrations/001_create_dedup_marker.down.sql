DROP FUNCTION IF EXISTS "dedup_marker_moved"();
DROP FUNCTION IF EXISTS "dedup_marker_ended"();
DROP TABLE IF EXISTS "dedup_marker";
-- Deduper.Migrate's record of applied versions, if it made one.
DROP TABLE IF EXISTS "dedup_marker_migration";

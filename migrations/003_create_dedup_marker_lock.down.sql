ALTER TABLE dedup_marker SET (fillfactor = 80);
DROP FUNCTION IF EXISTS dedup_marker_lock(bytea, bigint, text);

ALTER TABLE dedup_marker_default SET (fillfactor = 80);
DROP FUNCTION IF EXISTS dedup_marker_lock(bytea, timestamptz, bigint, text);

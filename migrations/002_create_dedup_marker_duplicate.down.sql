DROP FUNCTION IF EXISTS dedup_marker_duplicate();

DROP TABLE IF EXISTS dedup_marker;

DROP FUNCTION IF EXISTS dedup_marker_claim(bytea, timestamptz, bytea, text, bytea, smallint, integer, double precision, timestamptz, text);

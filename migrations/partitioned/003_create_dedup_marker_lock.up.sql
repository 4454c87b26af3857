-- The claim for the partitioned layout (see ../003_create_dedup_marker_lock.up.sql);
-- the look for the marker names the partition key.
CREATE OR REPLACE FUNCTION dedup_marker_lock(
    p_id_hash      bytea,
    p_scheduled_at timestamptz,
    p_lock_key     bigint,
    p_lock_timeout text
) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    saved_lock_timeout text := current_setting('lock_timeout');
BEGIN
    PERFORM set_config('lock_timeout', p_lock_timeout, true);
    PERFORM pg_advisory_xact_lock(p_lock_key);
    PERFORM set_config('lock_timeout', saved_lock_timeout, true);
    IF EXISTS (SELECT 1 FROM dedup_marker WHERE id_hash = p_id_hash AND scheduled_at = p_scheduled_at) THEN
        RAISE EXCEPTION USING ERRCODE = 'DDUP1', MESSAGE = 'dedupactivity: event already applied';
    END IF;
END
$$;

-- Markers are no longer updated after their insert (the result comes with
-- it), so pages need no room for HOT updates; partitions made from now on
-- are created without fillfactor 80 (dedupactivity/partition.go).
ALTER TABLE dedup_marker_default SET (fillfactor = 100);

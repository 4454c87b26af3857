-- The claim for the partitioned layout (see ../002_create_dedup_marker_claim.up.sql).
CREATE OR REPLACE FUNCTION dedup_marker_claim(
    p_id_hash         bytea,
    p_scheduled_at    timestamptz,
    p_identity        bytea,
    p_activity_type   text,
    p_fingerprint     bytea,
    p_fingerprint_alg smallint,
    p_attempt         integer,
    p_retention_secs  double precision,
    p_min_expiry      timestamptz,
    p_lock_timeout    text
) RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
DECLARE
    saved_lock_timeout text := current_setting('lock_timeout');
    claimed            boolean;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_timeout, true);
    INSERT INTO dedup_marker (id_hash, scheduled_at, identity, activity_type, fingerprint, fingerprint_alg, attempt, expires_at)
    VALUES (p_id_hash, p_scheduled_at, p_identity, p_activity_type, p_fingerprint, p_fingerprint_alg, p_attempt,
            GREATEST(now() + make_interval(secs => p_retention_secs), p_min_expiry))
    ON CONFLICT (id_hash, scheduled_at) DO NOTHING
    RETURNING true INTO claimed;
    IF claimed IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'DDUP1', MESSAGE = 'dedupactivity: event already claimed';
    END IF;
    PERFORM set_config('lock_timeout', saved_lock_timeout, true);
END
$$;

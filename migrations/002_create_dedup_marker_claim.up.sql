-- The claim, as a function so that it rides in the same round trip as BEGIN
-- (see dedupactivity/claim.go) with its INSERT plan cached per session.
--
-- Inserts the marker with INSERT ... ON CONFLICT DO NOTHING RETURNING. If a
-- concurrent transaction holds the same id_hash, the INSERT waits for it, at
-- most p_lock_timeout: if it commits, the conflict raises SQLSTATE DDUP1
-- (event already claimed); if it rolls back, this call claims the event.
-- lock_timeout is restored for the rest of the transaction (the effect).
CREATE OR REPLACE FUNCTION dedup_marker_claim(
    p_id_hash         bytea,
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
    INSERT INTO dedup_marker (id_hash, identity, activity_type, fingerprint, fingerprint_alg, attempt, expires_at)
    VALUES (p_id_hash, p_identity, p_activity_type, p_fingerprint, p_fingerprint_alg, p_attempt,
            GREATEST(now() + make_interval(secs => p_retention_secs), p_min_expiry))
    ON CONFLICT (id_hash) DO NOTHING
    RETURNING true INTO claimed;
    IF claimed IS NULL THEN
        RAISE EXCEPTION USING ERRCODE = 'DDUP1', MESSAGE = 'dedupactivity: event already claimed';
    END IF;
    PERFORM set_config('lock_timeout', saved_lock_timeout, true);
END
$$;

-- The claim since version 003 (see dedupactivity/claim.go). It runs in the
-- same round trip as BEGIN:
--
--  1. a transaction-scoped advisory lock on the event, so a concurrent
--     attempt of the same event waits here (at most p_lock_timeout) until
--     the holder commits or rolls back;
--  2. a look for the event's marker, in a new statement and so with a new
--     READ COMMITTED snapshot, which sees a marker the holder committed
--     while this call waited: if there is one, SQLSTATE DDUP1 (already
--     applied).
--
-- The marker itself, with the effect's result, is inserted by
-- INSERT ... ON CONFLICT DO NOTHING RETURNING in the round trip that
-- commits. The primary key, not the lock, is what makes a second commit of
-- one event impossible: the lock only makes concurrent attempts wait for
-- the first instead of running the effect and then failing on the key.
-- lock_timeout is restored for the rest of the transaction (the effect).
--
-- dedup_marker_claim (002), the claim of earlier versions, stays so that
-- workers of both versions can run side by side during an upgrade: the
-- primary key keeps their markers exclusive.
CREATE OR REPLACE FUNCTION dedup_marker_lock(
    p_id_hash      bytea,
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
    IF EXISTS (SELECT 1 FROM dedup_marker WHERE id_hash = p_id_hash) THEN
        RAISE EXCEPTION USING ERRCODE = 'DDUP1', MESSAGE = 'dedupactivity: event already applied';
    END IF;
END
$$;

-- Markers are no longer updated after their insert (the result comes with
-- it), so pages need no room for HOT updates.
ALTER TABLE dedup_marker SET (fillfactor = 100);

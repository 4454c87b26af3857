-- Raised by the claim statement when the event was already claimed, so the
-- claim can ride in the same round trip as BEGIN (see dedupactivity/claim.go):
-- the driver reports an error with this SQLSTATE instead of a row count.
CREATE OR REPLACE FUNCTION dedup_marker_duplicate() RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'DDUP1', MESSAGE = 'dedupactivity: event already claimed';
END
$$;

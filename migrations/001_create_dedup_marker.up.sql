-- One row per claimed event. The row is inserted in the same transaction as
-- the user's effect, so it exists if and only if the effect committed.
CREATE TABLE dedup_marker (
    -- SHA-256 of the canonical identity encoding (see identity.go): fixed
    -- size, so any identity (NUL bytes, invalid UTF-8, long IDs) fits a
    -- btree entry.
    id_hash          bytea       NOT NULL PRIMARY KEY,
    -- The canonical identity encoding itself, for operators and audits.
    identity         bytea       NOT NULL,
    activity_type    text        NOT NULL,
    -- Fingerprint of the activity input, and the algorithm that made it, so
    -- a later change of encoding cannot cause false mismatches.
    fingerprint      bytea       NOT NULL,
    fingerprint_alg  smallint    NOT NULL,
    -- The first attempt's result as a serialized Temporal Payload (encoded by
    -- the Deduper's DataConverter, codec included). NULL when results are not
    -- stored.
    result           bytea,
    attempt          integer     NOT NULL,
    claimed_at       timestamptz NOT NULL DEFAULT now(),
    -- When the marker may be forgotten (see Options.Retention).
    expires_at       timestamptz NOT NULL,
    CONSTRAINT dedup_marker_id_hash_len CHECK (octet_length(id_hash) = 32)
) WITH (fillfactor = 80); -- room for the result UPDATE to stay a HOT update

CREATE INDEX dedup_marker_expires_at_idx ON dedup_marker (expires_at);

-- Partitioned layout (Options.PartitionInterval > 0): the marker table is
-- range-partitioned by the activity's ScheduledTime, which every attempt of
-- one scheduled activity shares, so the primary key (id_hash, scheduled_at)
-- keeps one marker per event across partition boundaries. Expired partitions
-- are detached and dropped instead of deleted row by row.
CREATE TABLE dedup_marker (
    id_hash          bytea       NOT NULL,
    scheduled_at     timestamptz NOT NULL,
    identity         bytea       NOT NULL,
    activity_type    text        NOT NULL,
    fingerprint      bytea       NOT NULL,
    fingerprint_alg  smallint    NOT NULL,
    result           bytea,
    attempt          integer     NOT NULL,
    claimed_at       timestamptz NOT NULL DEFAULT now(),
    expires_at       timestamptz NOT NULL,
    CONSTRAINT dedup_marker_id_hash_len CHECK (octet_length(id_hash) = 32),
    PRIMARY KEY (id_hash, scheduled_at)
) PARTITION BY RANGE (scheduled_at);

CREATE INDEX dedup_marker_expires_at_idx ON dedup_marker (expires_at);

-- Catches scheduled times outside the partitions made ahead of time; pruned
-- row by row.
CREATE TABLE dedup_marker_default PARTITION OF dedup_marker DEFAULT WITH (fillfactor = 80);

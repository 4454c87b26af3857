-- The dedupactivity marker table, partitioned layout
-- (Options.PartitionInterval > 0): range-partitioned by the activity's
-- ScheduledTime, which every attempt of one scheduled activity shares, so
-- the primary key (id_hash, scheduled_at) keeps one marker per event across
-- partition boundaries. Expired partitions are dropped whole, so only the
-- default partition needs an index on expires_at. Columns are as in the
-- default layout (../001_create_dedup_marker.up.sql). Idempotent, every name
-- quoted.
CREATE TABLE IF NOT EXISTS "dedup_marker" (
    "id_hash"       bytea       NOT NULL,
    "scheduled_at"  timestamptz NOT NULL,
    "attempt"       integer     NOT NULL,
    "claimed_at"    timestamptz NOT NULL DEFAULT now(),
    "expires_at"    timestamptz NOT NULL,
    "activity_type" text        NOT NULL,
    "fingerprint"   bytea,
    "result"        bytea,
    CONSTRAINT "dedup_marker_pkey" PRIMARY KEY ("id_hash", "scheduled_at")
) PARTITION BY RANGE ("scheduled_at");

-- Catches scheduled times outside the partitions made ahead of time; pruned
-- row by row.
CREATE TABLE IF NOT EXISTS "dedup_marker_default" PARTITION OF "dedup_marker" DEFAULT WITH (fillfactor = 80);
CREATE INDEX IF NOT EXISTS "dedup_marker_default_expires_at_idx" ON "dedup_marker_default" ("expires_at");

-- Called by the claim only when an effect ended the claim's transaction
-- with SQL (COMMIT or ROLLBACK) and began another: it fails that
-- transaction, so the claim's pipelined COMMIT commits nothing of it (see
-- dedupactivity/store.go).
CREATE OR REPLACE FUNCTION "dedup_marker_ended"() RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'DDUP2',
        MESSAGE = 'dedupactivity: the effect ended the claim''s transaction and began another';
END
$$;

-- Called by the claim only when the marker table's name, after the effect
-- ran, resolves to another table than at the claim's start: the effect
-- changed search_path (SET LOCAL search_path, a schema per tenant) while
-- the Deduper names the table without its schema. It fails the
-- transaction, so the marker cannot go to another schema's table (see
-- dedupactivity/store.go).
CREATE OR REPLACE FUNCTION "dedup_marker_moved"() RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING ERRCODE = 'DDUP3',
        MESSAGE = 'dedupactivity: the marker table''s name now resolves to another table than at the claim: the effect changed search_path (set Options.Schema)';
END
$$;

-- The dedupactivity marker table (default layout): one row per applied event.
-- The claim inserts the row before the effect runs and stores the effect's
-- result in it just before the commit, in the same transaction, so the row
-- exists if and only if the effect committed.
--
-- Every name is quoted: a migrator that renames the table replaces the token
-- dedup_marker (also the prefix of the index and constraint names), and any
-- lower-case identifier, reserved words included, stays valid. The file is
-- idempotent, so a migration tool and Deduper.Migrate can both apply it.
CREATE TABLE IF NOT EXISTS "dedup_marker" (
    -- SHA-256 of the canonical identity encoding (dedupactivity.Identity):
    -- 32 bytes, so any identity fits a btree entry. The identity itself is
    -- not stored: spans carry this hash beside the Temporal IDs. Its length
    -- has no CHECK: PostgreSQL builds a CHECK's expression again for every
    -- INSERT and UPDATE statement, which cost the claim 5% to 9% of its
    -- server instructions (docs/design.md, "What it costs").
    "id_hash"       bytea       NOT NULL,
    "attempt"       integer     NOT NULL,
    "claimed_at"    timestamptz NOT NULL DEFAULT now(),
    -- When the marker may be pruned (Options.Retention, and never before
    -- the activity's ScheduleToClose bound).
    "expires_at"    timestamptz NOT NULL,
    "activity_type" text        NOT NULL,
    -- Fingerprint of a business-keyed input (NULL for run-scoped
    -- identities, whose input Temporal's history fixes).
    "fingerprint"   bytea,
    -- The first attempt's result as a serialized Temporal Payload; empty
    -- when results are discarded (Options.DiscardResults); NULL until the
    -- claim records it, so NULL in a committed marker means the effect ended
    -- the transaction itself.
    "result"        bytea,
    CONSTRAINT "dedup_marker_pkey" PRIMARY KEY ("id_hash")
) WITH (fillfactor = 80); -- room on the page for the result update to be HOT

CREATE INDEX IF NOT EXISTS "dedup_marker_expires_at_idx" ON "dedup_marker" ("expires_at");

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

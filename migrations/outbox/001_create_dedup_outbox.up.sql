-- One row per message enqueued inside an effect's transaction. It commits
-- with the effect and its marker, or not at all.
--
-- The table, index and constraint names are quoted: a migrator that renames
-- the table replaces the token dedup_outbox (also their prefix), and any
-- lower-case identifier, reserved words included, stays valid.
CREATE TABLE IF NOT EXISTS "dedup_outbox" (
    id              bigserial   PRIMARY KEY,
    -- Sent with every delivery; the destination deduplicates on it.
    idempotency_key text        NOT NULL,
    -- The event's key (dedupactivity.IdempotencyKey) or '' for explicit keys.
    event_key       text        NOT NULL,
    destination     text        NOT NULL,
    name            text        NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}',
    payload         bytea       NOT NULL,
    -- pending: to send at next_attempt_at; sending: leased by a relay until
    -- lease_until; sent: the destination acknowledged; applied: the
    -- reconciler (or a person) found it applied at the destination; dead:
    -- gave up; rejected: the destination refused it for good (it stored a
    -- final 3xx or 4xx answer that a resend would only replay). Sent,
    -- applied and rejected are settled: Prune deletes them once
    -- Options.Retention has passed since settled_at.
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'sending', 'sent', 'applied', 'dead', 'rejected')),
    -- Sends so far, and the lease's fencing token: each lease adds one; a
    -- relay that gives a message back unsent (stopping) takes its one back.
    attempts        integer     NOT NULL DEFAULT 0,
    -- Sends since the message was enqueued or last re-queued by the reconciler.
    tries           integer     NOT NULL DEFAULT 0,
    requeues        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    lease_until     timestamptz,
    -- When the first send not acknowledged since began, by the database's
    -- clock, or the last re-queue (the reconciler's question; a person's
    -- Requeue of a message sent before): a send the destination had not
    -- finished then may be applied after. NULL for a message never sent.
    -- The reconciler asks the destination past UnackedAfter; the relay sends
    -- nothing past KeyRetention, when the destination may have forgotten the key.
    unacked_since   timestamptz,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    settled_at      timestamptz,
    -- When the reconciler last asked the destination about the message and
    -- got no answer it could act on (the check failed, or a dead letter out
    -- of re-queues was still not applied). A run asks about the messages
    -- never asked, or asked longest ago, first: those it cannot settle do
    -- not crowd out the others, run after run.
    checked_at      timestamptz,
    -- A relay began sending the message under its current lease and has not
    -- recorded the outcome yet. A claim that finds it set (the relay's
    -- process stopped during the send: a crash, an out-of-memory kill)
    -- counts a stall.
    in_send         boolean     NOT NULL DEFAULT false,
    -- Sends in a row that began and never recorded an outcome. At the
    -- relay's MaxAttempts the message is made dead without another send, so
    -- a message whose send stops the process does not stop every relay in
    -- turn. A recorded failure resets them; a re-queue by the reconciler
    -- keeps them.
    stalls          integer     NOT NULL DEFAULT 0,
    CONSTRAINT "dedup_outbox_idempotency_key_key" UNIQUE (idempotency_key)
);

CREATE INDEX IF NOT EXISTS "dedup_outbox_due_idx" ON "dedup_outbox" (next_attempt_at) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS "dedup_outbox_lease_idx" ON "dedup_outbox" (lease_until) WHERE state = 'sending';
CREATE INDEX IF NOT EXISTS "dedup_outbox_event_idx" ON "dedup_outbox" (event_key, name);
CREATE INDEX IF NOT EXISTS "dedup_outbox_settled_idx" ON "dedup_outbox" (settled_at) WHERE state IN ('sent', 'applied', 'rejected');
CREATE INDEX IF NOT EXISTS "dedup_outbox_dead_idx" ON "dedup_outbox" (settled_at NULLS FIRST, id) WHERE state = 'dead';

-- One row per message enqueued inside an effect's transaction. It commits
-- with the effect and its marker, or not at all.
CREATE TABLE IF NOT EXISTS dedup_outbox (
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
    -- reconciler found it applied at the destination; dead: gave up.
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'sending', 'sent', 'applied', 'dead')),
    -- Sends so far, and the lease's fencing token: each lease adds one; a
    -- relay that gives a message back unsent (stopping) takes its one back.
    attempts        integer     NOT NULL DEFAULT 0,
    -- Sends since the message was enqueued or last re-queued by the reconciler.
    tries           integer     NOT NULL DEFAULT 0,
    requeues        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    lease_until     timestamptz,
    -- When the first send of the current run of attempts began without an
    -- acknowledgement since; the reconciler asks the destination past a bound.
    unacked_since   timestamptz,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    settled_at      timestamptz,
    CONSTRAINT dedup_outbox_idempotency_key_key UNIQUE (idempotency_key)
);

CREATE INDEX IF NOT EXISTS dedup_outbox_due_idx ON dedup_outbox (next_attempt_at) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS dedup_outbox_lease_idx ON dedup_outbox (lease_until) WHERE state = 'sending';
CREATE INDEX IF NOT EXISTS dedup_outbox_event_idx ON dedup_outbox (event_key, name);
CREATE INDEX IF NOT EXISTS dedup_outbox_settled_idx ON dedup_outbox (settled_at) WHERE state IN ('sent', 'applied');
CREATE INDEX IF NOT EXISTS dedup_outbox_dead_idx ON dedup_outbox (id) WHERE state = 'dead';

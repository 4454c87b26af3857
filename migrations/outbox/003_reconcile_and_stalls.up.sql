-- When the reconciler last asked the destination about the message and got
-- no answer it could act on (the check failed, or a dead letter out of
-- re-queues was still not applied). A run asks about the messages never
-- asked, or asked longest ago, first: those it cannot settle do not crowd
-- out the others, run after run.
ALTER TABLE dedup_outbox ADD COLUMN IF NOT EXISTS checked_at timestamptz;
-- A relay began sending the message under its current lease and has not
-- recorded the outcome yet. A claim that finds it set (the relay's process
-- stopped during the send: a crash, an out-of-memory kill) counts a stall.
ALTER TABLE dedup_outbox ADD COLUMN IF NOT EXISTS in_send boolean NOT NULL DEFAULT false;
-- Sends in a row that began and never recorded an outcome. At the relay's
-- MaxAttempts the message is made dead without another send, so a message
-- whose send stops the process does not stop every relay in turn. A
-- recorded failure resets them; a re-queue by the reconciler keeps them.
ALTER TABLE dedup_outbox ADD COLUMN IF NOT EXISTS stalls integer NOT NULL DEFAULT 0;

-- When the reconciler last asked the destination about the message and got
-- no answer it could act on (the check failed, or a dead letter out of
-- re-queues was still not applied). A run asks about the messages never
-- asked, or asked longest ago, first: those it cannot settle do not crowd
-- out the others, run after run.
ALTER TABLE dedup_outbox ADD COLUMN IF NOT EXISTS checked_at timestamptz;

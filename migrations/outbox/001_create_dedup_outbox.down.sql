DROP TABLE IF EXISTS dedup_outbox;

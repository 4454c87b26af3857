CREATE TABLE IF NOT EXISTS account (
    id      text   PRIMARY KEY,
    balance bigint NOT NULL CHECK (balance >= 0)
);

-- One row per applied debit or credit. A transfer applied exactly once has
-- exactly one debit and one credit entry.
CREATE TABLE IF NOT EXISTS ledger_entry (
    id          bigserial   PRIMARY KEY,
    transfer_id text        NOT NULL,
    account     text        NOT NULL REFERENCES account (id),
    amount      bigint      NOT NULL,
    kind        text        NOT NULL CHECK (kind IN ('debit', 'credit')),
    attempt     integer     NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX IF NOT EXISTS ledger_entry_transfer_id_idx ON ledger_entry (transfer_id);

-- Bundle versions per node (the signed bytes are rebuilt deterministically from these),
-- the node's current certificate, and append-only evidence from agents.
ALTER TABLE nodes ADD COLUMN cert_pem TEXT;

CREATE TABLE bundles (
    node       TEXT PRIMARY KEY,
    version    INTEGER NOT NULL,
    digest     TEXT    NOT NULL,
    issued_at  INTEGER NOT NULL
);

CREATE TABLE evidence (
    node         TEXT    NOT NULL,
    seq          INTEGER NOT NULL,
    version      INTEGER NOT NULL,
    result       TEXT    NOT NULL,
    error        TEXT,
    files        TEXT    NOT NULL,
    at           INTEGER NOT NULL,
    received_at  INTEGER NOT NULL,
    PRIMARY KEY (node, seq)
);

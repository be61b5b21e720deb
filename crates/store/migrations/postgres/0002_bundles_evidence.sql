-- Bundle versions per node (the signed bytes are rebuilt deterministically from these),
-- the node's current certificate, and append-only evidence from agents.
ALTER TABLE nodes ADD COLUMN cert_pem TEXT;

CREATE TABLE bundles (
    node       TEXT PRIMARY KEY,
    version    BIGINT NOT NULL,
    digest     TEXT    NOT NULL,
    issued_at  BIGINT NOT NULL
);

CREATE TABLE evidence (
    node         TEXT    NOT NULL,
    seq          BIGINT NOT NULL,
    version      BIGINT NOT NULL,
    result       TEXT    NOT NULL,
    error        TEXT,
    files        TEXT    NOT NULL,
    at           BIGINT NOT NULL,
    received_at  BIGINT NOT NULL,
    PRIMARY KEY (node, seq)
);

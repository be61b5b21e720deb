-- Revocations followed until every node that held the revoked key applied a bundle without it
-- (ADR 0022), and removals of pools' members by the sweep, followed the same way (`kind`).
-- `holders_known` is set by the first publish run after the decision, which records
-- the holders (the nodes whose published bundle named the key as a peer); each holder's
-- `dropped_in` is the first version of its bundle without the key. `completed_at` and `holders`
-- are written once, with the audit record of the completion. (Numbered 0006: 0005 is left to the
-- service certificates' table.)
CREATE TABLE revocations (
    node           TEXT    PRIMARY KEY,
    kind           TEXT    NOT NULL DEFAULT 'revocation',
    decided_at     BIGINT  NOT NULL,
    holders_known  BIGINT  NOT NULL DEFAULT 0,
    completed_at   BIGINT,
    holders        BIGINT  NOT NULL DEFAULT 0
);

CREATE TABLE revocation_holders (
    node        TEXT    NOT NULL,
    holder      TEXT    NOT NULL,
    dropped_in  BIGINT,
    PRIMARY KEY (node, holder)
);

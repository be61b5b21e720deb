-- What nodes trust beyond the CA, delivered in their signed bundles (issue 21, items 2 and 4).
--
-- The controllers a node asks, in order (ADR 0028): empty until the first
-- `trellis controllers add`, when the configured advertise addresses are written first.
CREATE TABLE controllers (
    address   TEXT    PRIMARY KEY,
    position  BIGINT NOT NULL,
    added_at  BIGINT NOT NULL
);

-- Rotations of the bundle-signing key (ADR 0027), by the next key (base64 of the public key):
-- announced in bundles signed by the current key from `started_at`; completed, once, when
-- every active node applied a bundle announcing it, or the overlap passed (`completed_by`).
CREATE TABLE rotations (
    next_key      TEXT    PRIMARY KEY,
    kind          TEXT    NOT NULL,
    started_at    BIGINT NOT NULL,
    overlap_secs  BIGINT NOT NULL,
    completed_at  BIGINT,
    completed_by  TEXT
);
-- At most one open rotation of each kind, whatever starts race: the second insert fails, and
-- its retry sees the first.
CREATE UNIQUE INDEX rotations_open ON rotations (kind) WHERE completed_at IS NULL;

-- Each node's first bundle version announcing a rotation's key, recorded by the publish run
-- that made it: the node confirmed the rotation once its evidence applied that version.
CREATE TABLE rotation_nodes (
    next_key  TEXT    NOT NULL,
    node      TEXT    NOT NULL,
    version   BIGINT NOT NULL,
    PRIMARY KEY (next_key, node)
);

-- The controller's records. Timestamps are unix seconds; flags are 0/1 integers, so the same
-- queries read both backends.
CREATE TABLE revisions (
    number      INTEGER PRIMARY KEY,
    created_at  INTEGER NOT NULL,
    digest      TEXT    NOT NULL,
    files       TEXT    NOT NULL
);

CREATE TABLE addresses (
    node  TEXT PRIMARY KEY,
    ipv4  TEXT,
    ipv6  TEXT
);

CREATE TABLE nodes (
    name              TEXT PRIMARY KEY,
    state             TEXT    NOT NULL,
    wg_public_key     TEXT    UNIQUE,
    cert_serial       TEXT,
    prev_cert_serial  TEXT,
    cert_not_after    INTEGER,
    enrolled_at       INTEGER NOT NULL,
    last_contact      INTEGER
);

CREATE TABLE tokens (
    id                TEXT PRIMARY KEY,
    node              TEXT    NOT NULL,
    secret_sha256     TEXT    NOT NULL,
    created_at        INTEGER NOT NULL,
    expires_at        INTEGER NOT NULL,
    used_at           INTEGER,
    revoked_at        INTEGER,
    require_approval  INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE audit (
    seq        INTEGER PRIMARY KEY,
    at         INTEGER NOT NULL,
    actor      TEXT    NOT NULL,
    action     TEXT    NOT NULL,
    subject    TEXT    NOT NULL,
    detail     TEXT    NOT NULL,
    prev_hash  TEXT    NOT NULL,
    hash       TEXT    NOT NULL
);

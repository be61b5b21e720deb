-- The controller's records. Timestamps are unix seconds; flags are 0/1 integers, so the same
-- queries read both backends.
CREATE TABLE revisions (
    number      BIGINT PRIMARY KEY,
    created_at  BIGINT  NOT NULL,
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
    cert_not_after    BIGINT,
    enrolled_at       BIGINT  NOT NULL,
    last_contact      BIGINT
);

CREATE TABLE tokens (
    id                TEXT PRIMARY KEY,
    node              TEXT    NOT NULL,
    secret_sha256     TEXT    NOT NULL,
    created_at        BIGINT  NOT NULL,
    expires_at        BIGINT  NOT NULL,
    used_at           BIGINT,
    revoked_at        BIGINT,
    require_approval  BIGINT  NOT NULL DEFAULT 0
);

CREATE TABLE audit (
    seq        BIGINT PRIMARY KEY,
    at         BIGINT  NOT NULL,
    actor      TEXT    NOT NULL,
    action     TEXT    NOT NULL,
    subject    TEXT    NOT NULL,
    detail     TEXT    NOT NULL,
    prev_hash  TEXT    NOT NULL,
    hash       TEXT    NOT NULL
);

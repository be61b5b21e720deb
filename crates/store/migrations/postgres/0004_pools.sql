-- Pools of short-lived nodes (ADR 0019). A pool token is redeemed up to `uses` times (`used`
-- counts them); a node made by one records its pool and the overlay addresses it was given,
-- which no other node may hold.
ALTER TABLE tokens ADD COLUMN pool TEXT;
ALTER TABLE tokens ADD COLUMN uses BIGINT NOT NULL DEFAULT 1;
ALTER TABLE tokens ADD COLUMN used BIGINT NOT NULL DEFAULT 0;
UPDATE tokens SET used = 1 WHERE used_at IS NOT NULL;
ALTER TABLE nodes ADD COLUMN pool TEXT;
ALTER TABLE nodes ADD COLUMN ipv4 TEXT;
ALTER TABLE nodes ADD COLUMN ipv6 TEXT;
CREATE UNIQUE INDEX nodes_ipv4 ON nodes (ipv4);
CREATE UNIQUE INDEX nodes_ipv6 ON nodes (ipv6);
CREATE INDEX nodes_pool ON nodes (pool);
-- One row per pool, written first by every redemption for it: on PostgreSQL the row lock makes
-- redemptions for one pool take turns, so the size check below it sees every member.
CREATE TABLE pool_locks (
    pool  TEXT PRIMARY KEY
);

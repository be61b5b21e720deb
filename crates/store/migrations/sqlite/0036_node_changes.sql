-- Which node records changed, in the order they changed (ADR 0036): a publish run keeps every
-- record and reads only those changed since its last read. Triggers number every write of a
-- column a run reads, whoever writes it (this replica or another), and remember each name
-- deleted; `last_contact` and the agent's version are not counted (a run does not read them).
CREATE TABLE node_changes (
    id   INTEGER PRIMARY KEY CHECK (id = 1),
    seq  BIGINT  NOT NULL
);
INSERT INTO node_changes (id, seq) VALUES (1, 0);

ALTER TABLE nodes ADD COLUMN changed BIGINT NOT NULL DEFAULT 0;
CREATE INDEX nodes_by_change ON nodes (changed);

CREATE TABLE nodes_gone (
    name     TEXT    PRIMARY KEY,
    changed  BIGINT  NOT NULL
);

CREATE TRIGGER node_inserted AFTER INSERT ON nodes BEGIN
    UPDATE node_changes SET seq = seq + 1 WHERE id = 1;
    UPDATE nodes SET changed = (SELECT seq FROM node_changes WHERE id = 1) WHERE name = NEW.name;
END;

CREATE TRIGGER node_updated
AFTER UPDATE OF name, state, wg_public_key, cert_serial, prev_cert_serial, cert_not_after, enrolled_at, cert_pem, pool, ipv4, ipv6 ON nodes
BEGIN
    UPDATE node_changes SET seq = seq + 1 WHERE id = 1;
    UPDATE nodes SET changed = (SELECT seq FROM node_changes WHERE id = 1) WHERE name = NEW.name;
END;

CREATE TRIGGER node_deleted AFTER DELETE ON nodes BEGIN
    UPDATE node_changes SET seq = seq + 1 WHERE id = 1;
    INSERT INTO nodes_gone (name, changed) SELECT OLD.name, seq FROM node_changes WHERE id = 1
        ON CONFLICT (name) DO UPDATE SET changed = excluded.changed;
END;

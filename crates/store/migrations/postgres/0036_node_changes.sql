-- Which node records changed, in the order they changed (ADR 0036): a publish run keeps every
-- record and reads only those changed since its last read. Triggers number every write of a
-- column a run reads, whoever writes it (this replica or another), and remember each name
-- deleted; `last_contact` and the agent's version are not counted (a run does not read them).
-- The counter's row is locked from a write until its commit, so numbers are taken in the order
-- transactions commit: a reader that sees number N sees every change numbered up to N.
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

CREATE FUNCTION node_changed() RETURNS trigger AS $$
DECLARE
    n BIGINT;
BEGIN
    UPDATE node_changes SET seq = seq + 1 WHERE id = 1 RETURNING seq INTO n;
    IF TG_OP = 'DELETE' THEN
        INSERT INTO nodes_gone (name, changed) VALUES (OLD.name, n)
            ON CONFLICT (name) DO UPDATE SET changed = excluded.changed;
        RETURN OLD;
    END IF;
    NEW.changed := n;
    RETURN NEW;
END
$$ LANGUAGE plpgsql;

CREATE TRIGGER node_written
BEFORE INSERT OR UPDATE OF name, state, wg_public_key, cert_serial, prev_cert_serial, cert_not_after, enrolled_at, cert_pem, pool, ipv4, ipv6 ON nodes
FOR EACH ROW EXECUTE FUNCTION node_changed();

CREATE TRIGGER node_deleted AFTER DELETE ON nodes FOR EACH ROW EXECUTE FUNCTION node_changed();

-- Evidence is kept per node up to a bound; what was pruned is remembered so that gaps stay
-- countable: records with seq <= below are gone, and pruned says how many there were.
CREATE TABLE evidence_floor (
    node    TEXT   PRIMARY KEY,
    below   BIGINT NOT NULL,
    pruned  BIGINT NOT NULL
);

-- What each node reports of its direct paths (ADR 0032): on a hub, the endpoint each peer it
-- has a session with sends from; on every node, the path of each relayed peer it may reach
-- directly. The agent's JSON (bounded and cleaned by the controller, a non-hub's observations
-- dropped), with when it said so. One row a node, replaced by each report.
CREATE TABLE path_reports (
    node         TEXT    PRIMARY KEY,
    report       TEXT    NOT NULL,
    reported_at  BIGINT  NOT NULL
);

-- What each ingress node reports of its Traefik (ADR 0026): running or not, its routers as
-- Traefik shows them and the certificates it holds, as the agent's JSON (bounded by the
-- controller), with when it said so. One row a node, replaced by each report.
CREATE TABLE ingress_reports (
    node         TEXT    PRIMARY KEY,
    report       TEXT    NOT NULL,
    reported_at  BIGINT  NOT NULL
);

-- Service certificates (ADR 0023): per node and module, the certificate last issued (its serial,
-- the names it carries, one per line, and its validity) and the last refusal, so that operators
-- see both and a failed renewal shows beside the certificate it leaves in place.
CREATE TABLE service_certs (
    node        TEXT NOT NULL,
    module      TEXT NOT NULL,
    serial      TEXT,
    names       TEXT NOT NULL DEFAULT '',
    issued_at   BIGINT,
    not_after   BIGINT,
    refused_at  BIGINT,
    refusal     TEXT,
    PRIMARY KEY (node, module)
);

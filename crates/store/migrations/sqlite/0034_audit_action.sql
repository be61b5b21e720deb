-- Audit records by action: every publish run counts the node revocations ever decided (the
-- `revocations` of trust.toml, ADR 0024), which reads only those records through this index.
CREATE INDEX audit_action ON audit (action);

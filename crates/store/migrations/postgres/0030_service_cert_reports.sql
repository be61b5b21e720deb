-- Service certificates as the node holds them (ADR 0023): each agent reports, per module, the
-- serial on its disk and why its last attempt failed there (a group missing, a unit that would
-- not reload, files that could not be written), so that a renewal failing on the node shows
-- beside the certificate, as the controller's own refusals do.
ALTER TABLE service_certs ADD COLUMN held_serial TEXT;
ALTER TABLE service_certs ADD COLUMN held_not_after BIGINT;
ALTER TABLE service_certs ADD COLUMN node_error TEXT;
ALTER TABLE service_certs ADD COLUMN reported_at BIGINT;

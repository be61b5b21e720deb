-- Whether the agent that reported the record manages no WireGuard interface (`--wireguard
-- none`, `--files-only`): its "applied" says nothing of the data plane, so a revocation holder
-- that reports only such records is shown unverified (the review of 2026-12-02, finding 11).
ALTER TABLE evidence ADD COLUMN unmanaged INTEGER NOT NULL DEFAULT 0;
-- The holders a completed revocation counted that only such agents reported for, by name
-- (comma-separated): what evidence could not prove.
ALTER TABLE revocations ADD COLUMN unverified TEXT NOT NULL DEFAULT '';

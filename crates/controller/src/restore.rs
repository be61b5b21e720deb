//! A database restored from a backup, caught when the controller starts (ADR 0024). The
//! controller keeps, in its state directory and outside the database, the signed checkpoint of
//! the audit head (`audit`) and the highest bundle version it published (`versions.high`). A
//! database whose chain does not hold the checkpoint's record, as signed, was restored from
//! before it (or rewritten): the controller refuses to serve it, saying what it found and what to
//! do, until started once with `--restored`. Then every bundle version moves past the high-water
//! mark (so every node takes its next bundle), the restore is audited, and the checkpoint is
//! signed again at the new head. A whole state directory restored with its database agrees with
//! itself and starts as it is; the nodes themselves then catch it up (`bundle::is_ahead`).

use std::path::Path;
use std::sync::atomic::Ordering;

use trellis_proto::AuditAction;
use trellis_store::Audit;

use crate::{audit, Controller, Error, Result};

/// The step the high-water mark moves in (see `Controller::raise_high_water`).
pub const HIGH_WATER_STEP: i64 = 1024;

/// The mark in a file; 0 when there is none (a controller that never published).
pub fn read_high_water(path: &Path) -> i64 {
    std::fs::read_to_string(path).ok().and_then(|t| t.trim().parse().ok()).unwrap_or(0)
}

impl Controller {
    /// Why the database is behind this controller's signed checkpoint, if it is: one sentence.
    pub(crate) async fn behind_checkpoint(&self) -> Result<Option<String>> {
        let Some(path) = &self.checkpoint else { return Ok(None) };
        let Some(cp) = audit::read_checkpoint(path) else { return Ok(None) };
        if !audit::checkpoint_signed_by(&cp, &self.signing_key().verifying_key()) {
            // Not ours: `trellis audit verify` says so; it is no measure of the database.
            tracing::warn!("{} is not signed by this controller's key; not compared with the database", path.display());
            return Ok(None);
        }
        let head = self.store.audit_head().await?;
        Ok(match self.store.audit_hash_at(cp.seq).await? {
            Some(hash) if hash == cp.hash => None,
            Some(_) => Some(format!(
                "the database's audit record {} is not the one this controller signed in {} (its chain ends at record {head}): it was restored from another backup, or rewritten",
                cp.seq,
                path.display()
            )),
            None => Some(format!(
                "the database's audit chain ends at record {head}, but this controller signed record {} in {}: the database was restored from an older backup, or records were removed",
                cp.seq,
                path.display()
            )),
        })
    }

    /// At start: refuses a database behind the checkpoint unless `restored`; with `restored`,
    /// recovers from the restore.
    pub(crate) async fn start_after_restore(&self, restored: bool) -> anyhow::Result<()> {
        let Some(why) = self.behind_checkpoint().await? else {
            if restored {
                tracing::info!("--restored: the database is not behind this controller's checkpoint; nothing to recover");
            }
            return Ok(());
        };
        if !restored {
            anyhow::bail!(
                "{why}. If you restored it from a backup, start once with `trellis serve --restored`: every bundle version then moves past the highest this controller published ({}), so every node takes its next bundle, and the restore is recorded in the audit chain. Otherwise restore the newest backup, or the state directory that goes with this database",
                self.high_water_mark()
            );
        }
        let lost = match (self.checkpoint.as_ref().and_then(|p| audit::read_checkpoint(p)), self.store.audit_head().await) {
            (Some(cp), Ok(head)) if cp.seq > head => format!("{} audit record(s) decided after the backup are lost", cp.seq - head),
            _ => "decisions made after the backup are lost".to_string(),
        };
        let past = self.recover_from_restore(&why).await?;
        tracing::warn!(
            "restored from a backup: {why}; every bundle version moved past {past}, the restore recorded in the audit chain. {lost}: revocations of nodes and tokens and controllers removed are made again from the state directory's {}; approvals, rotations, declarations applied and tokens issued since must be made again",
            crate::layout::LEDGER
        );
        Ok(())
    }

    /// Moves every bundle version past the high-water mark (and past every version in the
    /// database), audits the restore and signs the new head into the checkpoint. Returns the mark.
    pub(crate) async fn recover_from_restore(&self, why: &str) -> Result<i64> {
        let stored = self.store.bundles().await?.values().map(|b| b.version).max().unwrap_or(0);
        let past = self.high_water_mark().max(stored);
        // A tag names versions up to the ceiling only: above it every long-poll answers at once.
        if stored.saturating_add(past) > trellis_proto::etag::MAX_VERSION {
            return Err(Error::internal(
                "recovering from the restore",
                format!(
                    "moving every bundle version past {past} would take versions above {}, the most a bundle's tag can name",
                    trellis_proto::etag::MAX_VERSION
                ),
            ));
        }
        let detail = format!("{why}; every bundle version moved past {past}");
        let audit = Audit { at: self.now(), actor: "admin", action: AuditAction::RestoredFromBackup, subject: "database", detail };
        self.store.renumber_past(past, &audit).await?;
        let (seq, hash) = self.store.audit_head_hash().await?.ok_or_else(|| Error::internal("recording the restore", "no audit head"))?;
        self.write_checkpoint_anew(seq, &hash).await?;
        Ok(past)
    }

    /// The highest bundle version this state directory published (0 without a state directory).
    pub(crate) fn high_water_mark(&self) -> i64 {
        self.high_water.as_ref().map_or(0, |(_, mark)| mark.load(Ordering::SeqCst))
    }

    /// Keeps the high-water mark at or above `version` (a publish run numbered it). The mark
    /// only has to be above every version published, so it is written rounded up to the next
    /// multiple of [`HIGH_WATER_STEP`]: the file is written once in that many versions, not on
    /// every publish run.
    pub(crate) fn raise_high_water(&self, version: i64) -> Result<()> {
        let Some((path, mark)) = &self.high_water else { return Ok(()) };
        if mark.load(Ordering::SeqCst) >= version {
            return Ok(());
        }
        let rounded = (version / HIGH_WATER_STEP + 1) * HIGH_WATER_STEP;
        if mark.fetch_max(rounded, Ordering::SeqCst) >= rounded {
            return Ok(());
        }
        trellis_files::replace(path, format!("{rounded}\n").as_bytes(), 0o644)
            .map_err(|e| Error::internal("writing the high-water mark", e))
    }
}

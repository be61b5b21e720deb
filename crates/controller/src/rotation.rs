//! Rotations, of the bundle-signing key (`trust`) and of the mesh CA (`authority`), as both
//! run them: the start recorded and audited, refused while another of its kind is open; the
//! versions that announced the next key or CA recorded after each run; the completion once every
//! active node confirmed it or the overlap passed; the listing `trellis rotate status` shows. A
//! leaf of the two: it names the kinds they are recorded as, and imports neither.

use trellis_proto::{self as proto, AuditAction};
use trellis_store::{Audit, RotationRecord, StoreError};

use crate::{Controller, Error, Result};

/// The kind a signing-key rotation is recorded as (ADR 0027).
pub const SIGNING_KEY_ROTATION: &str = "signing-key";
/// The kind a CA rotation is recorded as (ADR 0029).
pub const CA_ROTATION: &str = "ca";

/// The longest overlap a rotation may wait for nodes that are away.
pub const MAX_OVERLAP_SECS: u64 = 90 * 86_400;

/// What a rotation of one kind records when it starts.
pub(crate) struct Started {
    pub kind: &'static str,
    /// What is rotated, as refusals say it.
    pub what: &'static str,
    pub action: AuditAction,
}

/// An overlap is from a second to [`MAX_OVERLAP_SECS`].
pub(crate) fn check_overlap(secs: u64) -> Result<()> {
    if secs == 0 || secs > MAX_OVERLAP_SECS {
        return Err(Error::BadRequest(format!("the overlap must be from 1 s to {} days", MAX_OVERLAP_SECS / 86_400)));
    }
    Ok(())
}

impl Controller {
    /// Records the start of a rotation to `next_key`, with its audit record; refused while
    /// another of its kind is in progress.
    pub(crate) async fn start_rotation(&self, started: Started, next_key: &str, overlap_secs: u64, detail: String) -> Result<()> {
        let record = RotationRecord {
            next_key: next_key.to_string(),
            kind: started.kind.into(),
            started_at: self.now(),
            overlap_secs: overlap_secs as i64,
            completed_at: None,
            completed_by: None,
        };
        let audit = Audit { at: record.started_at, actor: "admin", action: started.action, subject: next_key, detail };
        self.store.start_rotation(&record, &audit).await.map_err(|e| match e {
            StoreError::RotationInProgress(key) => {
                Error::BadRequest(format!("a rotation of the {} to {key} is in progress; see `trellis rotate status`", started.what))
            }
            other => other.into(),
        })
    }

    /// A rotation just started: publishing is asked for, and the rotation as listed returned.
    pub(crate) async fn rotation_started(&self, next_key: &str) -> Result<proto::Rotation> {
        self.ask_publish();
        self.rotations()
            .await?
            .into_iter()
            .find(|r| r.next_key == next_key)
            .ok_or_else(|| Error::internal("starting a rotation", "not recorded"))
    }

    /// Every rotation, newest first, with which active nodes confirmed it.
    pub async fn rotations(&self) -> Result<Vec<proto::Rotation>> {
        let records = self.store.rotations().await?;
        let mut out = Vec::with_capacity(records.len());
        let active = self.active_nodes().await?;
        let evidence = self.store.evidence_summary().await?;
        for r in records {
            let announced = self.store.announced(&r.next_key).await?;
            // A CA is confirmed by a node that also holds a certificate it issued (ADR 0029).
            let holding = match (r.kind.as_str(), r.completed_at) {
                (CA_ROTATION, None) => Some(self.holding_certificates_of(&r.next_key).await?),
                _ => None,
            };
            let (mut confirmed, mut waiting) = (Vec::new(), Vec::new());
            for node in &active {
                let applied = evidence.get(node).and_then(|e| e.applied_version);
                let holds = holding.as_ref().is_none_or(|h| h.contains(node));
                match (announced.get(node), applied) {
                    (Some(v), Some(a)) if a >= *v && holds => confirmed.push(node.clone()),
                    _ => waiting.push(node.clone()),
                }
            }
            out.push(proto::Rotation {
                kind: r.kind,
                completes_by: r.started_at + r.overlap_secs,
                next_key: r.next_key,
                started_at: r.started_at,
                overlap_secs: r.overlap_secs,
                completed_at: r.completed_at,
                completed_by: r.completed_by,
                confirmed,
                waiting,
            });
        }
        Ok(out)
    }

    /// The names of the active nodes of the current mesh.
    async fn active_nodes(&self) -> Result<Vec<String>> {
        Ok(self.roster().await?.into_iter().filter(|e| e.state == proto::NodeState::Active).map(|e| e.name).collect())
    }

    /// After a run that announced `next_key` (a signing key, or a CA's fingerprint): records the
    /// version each node published in it first announced it, and completes the rotation once
    /// every active node applied such a version (for a CA, and holds a certificate it issued),
    /// or its overlap passed (then asks for a run, which signs with the new key, or trusts the
    /// new CA only).
    pub(crate) async fn follow_rotation(&self, next_key: &str, published: &[(String, i64)]) -> Result<()> {
        self.store.record_announced(next_key, published).await?;
        let Some(r) = self.rotations().await?.into_iter().find(|r| r.next_key == next_key) else { return Ok(()) };
        if r.completed_at.is_some() {
            return Ok(());
        }
        let now = self.now();
        let by = if r.waiting.is_empty() {
            "evidence"
        } else if now >= r.completes_by {
            "overlap"
        } else {
            return Ok(());
        };
        let detail = match by {
            "evidence" => format!("every active node ({}) applied a bundle announcing it", r.confirmed.len()),
            _ => format!("the overlap passed with {} node(s) not confirmed: {}", r.waiting.len(), r.waiting.join(", ")),
        };
        let (action, what) = match r.kind.as_str() {
            CA_ROTATION => (AuditAction::CaRotationCompleted, "mesh CA"),
            _ => (AuditAction::SigningKeyRotationCompleted, "signing key"),
        };
        let audit = Audit { at: now, actor: "controller", action, subject: next_key, detail };
        if self.store.complete_rotation(next_key, now, by, &audit).await? {
            tracing::info!("the rotation of the {what} completed ({by})");
            self.ask_publish();
        }
        Ok(())
    }

    /// Evidence arrived: while a rotation is open, the next look may find it confirmed.
    pub(crate) fn rotation_evidence(&self) {
        if self.next_signing_key().is_some() || self.next_ca_fingerprint().is_some() {
            self.rotation_due.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Completes an open rotation that evidence arrived for since the last look, or whose overlap
    /// passed (`overlap`: look whether or not evidence arrived). The server calls it every tick.
    pub(crate) async fn settle_rotation(&self, overlap: bool) -> Result<()> {
        let next = self.next_signing_key();
        let next_ca = self.next_ca_fingerprint();
        if next.is_none() && next_ca.is_none() {
            return Ok(());
        }
        if !self.rotation_due.swap(false, std::sync::atomic::Ordering::SeqCst) && !overlap {
            return Ok(());
        }
        for key in next.iter().chain(next_ca.iter()) {
            self.follow_rotation(key, &[]).await?;
        }
        Ok(())
    }
}

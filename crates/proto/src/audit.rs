//! The audit chain (ADR 0008): one record per governance decision, each chained by SHA-256 to the
//! one before it. The record is also the wire form of `GET /v1/admin/audit`, so the admin CLI
//! verifies a chain it fetched without the store.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

crate::state::states! {
    /// What a governance decision did, as its audit record names it. The names are hashed into
    /// the chain, so they never change: a renamed action would break every chain that holds it.
    AuditAction, "an audit action" {
        DeclarationApplied = "declaration applied",
        TokenIssued = "token issued",
        TokenRevoked = "token revoked",
        NodeEnrolled = "node enrolled",
        /// A redemption refused, audited by itself.
        TokenRedemptionRefused = "token redemption refused",
        /// The redemptions refused from one source in a window and counted, not audited one by one.
        TokenRedemptionsRefused = "token redemptions refused",
        CertificateRenewed = "certificate renewed",
        NodeApproved = "node approved",
        NodeRevoked = "node revoked",
        /// A pool's member removed by the sweep.
        NodeRemoved = "node removed",
        /// Every node that held a revoked node's key applied a bundle without it (ADR 0022).
        RevocationCompleted = "revocation completed",
        /// Every node that held a removed pool member's key applied a bundle without it.
        RemovalCompleted = "removal completed",
        /// `trellis serve --restored` on a database behind the controller's signed checkpoint.
        RestoredFromBackup = "restored from backup",
        /// A service certificate signed for a module a node runs (ADR 0023).
        ServiceCertificateIssued = "service certificate issued",
        /// A service certificate request refused, with why.
        ServiceCertificateRefused = "service certificate refused",
        /// A controller address added to the list nodes are given (ADR 0028).
        ControllerAdded = "controller added",
        /// A controller address removed from the list nodes are given.
        ControllerRemoved = "controller removed",
        /// A next bundle-signing key announced (ADR 0027).
        SigningKeyRotationStarted = "signing key rotation started",
        /// Bundles signed with the next key only, from now on.
        SigningKeyRotationCompleted = "signing key rotation completed",
        /// Every node that sent a route or relayed traffic through a node that no longer
        /// carries it applied a bundle that does not (ADR 0022).
        RoutesWithdrawn = "routes withdrawal completed",
        /// A next mesh CA announced; node and server certificates are issued under it (ADR 0029).
        CaRotationStarted = "CA rotation started",
        /// Only the next mesh CA is trusted, from now on.
        CaRotationCompleted = "CA rotation completed",
        /// The controller's server certificate renewed while serving.
        ServerCertificateRenewed = "server certificate renewed",
        /// The services CA certified again for the declaration's domain and overlay alone.
        ServicesCaScoped = "services CA scoped",
    }
}

/// One record as stored. Its action is kept as the text that was hashed (an [`AuditAction`]'s
/// name when this controller wrote it), so that a chain is checked byte for byte, whatever wrote
/// it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditRecord {
    pub seq: i64,
    pub at: i64,
    pub actor: String,
    pub action: String,
    pub subject: String,
    pub detail: String,
    pub prev_hash: String,
    pub hash: String,
}

/// The hash that chains an audit record to the one before it.
pub fn hash(seq: i64, at: i64, actor: &str, action: &str, subject: &str, detail: &str, prev_hash: &str) -> String {
    let mut h = Sha256::new();
    for part in [&seq.to_string(), &at.to_string(), actor, action, subject, detail, prev_hash] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(h.finalize())
}

/// Checks a chain record by record from its first, holding only the hash before: a chain read
/// in pages is checked in bounded memory. With a checkpoint (whose signature the caller has
/// checked), the chain must also reach the checkpoint's record, with the same hash there.
#[derive(Debug, Default)]
pub struct ChainCheck {
    count: i64,
    prev: String,
    checkpoint: Option<Checkpoint>,
    seen_at_checkpoint: Option<String>,
}

impl ChainCheck {
    pub fn new(checkpoint: Option<Checkpoint>) -> ChainCheck {
        ChainCheck { checkpoint, ..ChainCheck::default() }
    }

    /// The next record; on a break, says at which record.
    pub fn feed(&mut self, r: &AuditRecord) -> Result<(), String> {
        let expected = self.count + 1;
        if r.seq != expected {
            return Err(format!("audit record {expected} is missing (found {} in its place)", r.seq));
        }
        if r.prev_hash != self.prev {
            return Err(format!("audit record {} does not follow record {}: the chain is broken", r.seq, r.seq - 1));
        }
        if hash(r.seq, r.at, &r.actor, &r.action, &r.subject, &r.detail, &r.prev_hash) != r.hash {
            return Err(format!("audit record {} was altered: its hash does not match its content", r.seq));
        }
        if self.checkpoint.as_ref().is_some_and(|c| c.seq == r.seq) {
            self.seen_at_checkpoint = Some(r.hash.clone());
        }
        self.count = r.seq;
        self.prev.clone_from(&r.hash);
        Ok(())
    }

    /// The hash of the newest record fed, empty before the first.
    pub fn head(&self) -> &str {
        &self.prev
    }

    /// The end of the chain: the number of records, once the checkpoint (if any) is met.
    pub fn finish(self) -> Result<usize, String> {
        if let Some(cp) = &self.checkpoint {
            match &self.seen_at_checkpoint {
                None => {
                    return Err(format!(
                    "the audit chain ends at record {}, but the controller's checkpoint says it reached record {}: records were removed",
                    self.count, cp.seq
                ))
                }
                Some(h) if *h != cp.hash => {
                    return Err(format!(
                        "audit record {} is not the one the controller's checkpoint names: the chain was rewritten",
                        cp.seq
                    ))
                }
                Some(_) => {}
            }
        }
        Ok(self.count as usize)
    }
}

/// Checks a whole chain from its first record; on a break, says at which record. Returns the
/// number of records.
pub fn verify(records: &[AuditRecord]) -> Result<usize, String> {
    let mut check = ChainCheck::new(None);
    records.iter().try_for_each(|r| check.feed(r))?;
    check.finish()
}

/// The head of the chain as the controller saw it, kept outside the database: the newest
/// record's sequence number and hash. A chain that ends before it, or holds another hash at its
/// sequence number, was cut or rewritten.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Checkpoint {
    pub seq: i64,
    pub hash: String,
    /// Base64 of the ed25519 signature by the controller's bundle-signing key over
    /// [`Checkpoint::signed_bytes`].
    pub signature: String,
}

impl Checkpoint {
    /// What the signature covers.
    pub fn signed_bytes(seq: i64, hash: &str) -> Vec<u8> {
        format!("trellis audit checkpoint v1\n{seq}\n{hash}\n").into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A whole chain checked against a checkpoint of its head.
    fn verify_against(records: &[AuditRecord], checkpoint: &Checkpoint) -> Result<usize, String> {
        let mut check = ChainCheck::new(Some(checkpoint.clone()));
        records.iter().try_for_each(|r| check.feed(r))?;
        check.finish()
    }

    fn chain(n: i64) -> Vec<AuditRecord> {
        let mut out: Vec<AuditRecord> = Vec::new();
        for seq in 1..=n {
            let prev_hash = out.last().map(|r| r.hash.clone()).unwrap_or_default();
            let hash = hash(seq, 100 + seq, "admin", AuditAction::NodeApproved.as_str(), "db-1", "", &prev_hash);
            out.push(AuditRecord {
                seq,
                at: 100 + seq,
                actor: "admin".into(),
                action: AuditAction::NodeApproved.to_string(),
                subject: "db-1".into(),
                detail: String::new(),
                prev_hash,
                hash,
            });
        }
        out
    }

    #[test]
    fn a_chain_verifies_and_each_break_is_named() {
        assert_eq!(verify(&chain(3)), Ok(3));
        let mut altered = chain(3);
        altered[1].subject = "db-2".into();
        assert_eq!(verify(&altered), Err("audit record 2 was altered: its hash does not match its content".into()));
        let mut gap = chain(3);
        gap.remove(1);
        assert_eq!(verify(&gap), Err("audit record 2 is missing (found 3 in its place)".into()));
        let mut relinked = chain(3);
        relinked[2].prev_hash = relinked[0].hash.clone();
        assert_eq!(verify(&relinked), Err("audit record 3 does not follow record 2: the chain is broken".into()));
    }

    #[test]
    fn a_checkpoint_catches_a_cut_tail_and_a_recomputed_chain() {
        let full = chain(3);
        let cp = Checkpoint { seq: 3, hash: full[2].hash.clone(), signature: String::new() };
        assert_eq!(verify_against(&full, &cp), Ok(3));
        assert_eq!(
            verify_against(&full[..2], &cp),
            Err("the audit chain ends at record 2, but the controller's checkpoint says it reached record 3: records were removed".into())
        );
        // Rewritten and re-chained: the chain verifies alone, but not against the checkpoint.
        let mut rewritten = chain(3);
        rewritten[2].detail = "nothing happened".into();
        rewritten[2].hash =
            hash(3, rewritten[2].at, "admin", AuditAction::NodeApproved.as_str(), "db-1", "nothing happened", &rewritten[2].prev_hash);
        assert_eq!(verify(&rewritten), Ok(3));
        assert_eq!(
            verify_against(&rewritten, &cp),
            Err("audit record 3 is not the one the controller's checkpoint names: the chain was rewritten".into())
        );
        assert_eq!(verify_against(&chain(4), &cp), Ok(4), "records after the checkpoint are fine");
    }

    #[test]
    fn the_actions_keep_the_names_existing_chains_hashed() {
        // Chains written before the actions were an enum hold these exact names; each is also the
        // enum's serde, `Display` and `FromStr` name.
        let names: Vec<&str> = AuditAction::ALL.iter().map(|a| a.as_str()).collect();
        assert_eq!(
            names,
            [
                "declaration applied",
                "token issued",
                "token revoked",
                "node enrolled",
                "token redemption refused",
                "token redemptions refused",
                "certificate renewed",
                "node approved",
                "node revoked",
                "node removed",
                "revocation completed",
                "removal completed",
                "restored from backup",
                "service certificate issued",
                "service certificate refused",
                "controller added",
                "controller removed",
                "signing key rotation started",
                "signing key rotation completed",
                "routes withdrawal completed",
                "CA rotation started",
                "CA rotation completed",
                "server certificate renewed",
                "services CA scoped",
            ]
        );
        for a in AuditAction::ALL {
            assert_eq!(serde_json::to_string(a).unwrap(), format!("\"{a}\""));
            assert_eq!(a.as_str().parse::<AuditAction>(), Ok(*a));
        }
        assert_eq!("node deleted".parse::<AuditAction>().unwrap_err().to_string(), "\"node deleted\" is not an audit action");
    }
}

//! The audit chain (ADR 0008): one record per governance decision, each chained by SHA-256 to the
//! one before it. The record is also the wire form of `GET /v1/admin/audit`, so the admin CLI
//! verifies a chain it fetched without the store.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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

/// Checks a whole chain from its first record; on a break, says at which record. Returns the
/// number of records.
pub fn verify(records: &[AuditRecord]) -> Result<usize, String> {
    let mut prev = String::new();
    for (i, r) in records.iter().enumerate() {
        if r.seq != i as i64 + 1 {
            return Err(format!("audit record {} is missing (found {} in its place)", i + 1, r.seq));
        }
        if r.prev_hash != prev {
            return Err(format!("audit record {} does not follow record {}: the chain is broken", r.seq, r.seq - 1));
        }
        if hash(r.seq, r.at, &r.actor, &r.action, &r.subject, &r.detail, &r.prev_hash) != r.hash {
            return Err(format!("audit record {} was altered: its hash does not match its content", r.seq));
        }
        prev = r.hash.clone();
    }
    Ok(records.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: i64) -> Vec<AuditRecord> {
        let mut out: Vec<AuditRecord> = Vec::new();
        for seq in 1..=n {
            let prev_hash = out.last().map(|r| r.hash.clone()).unwrap_or_default();
            let hash = hash(seq, 100 + seq, "admin", "node approved", "db-1", "", &prev_hash);
            out.push(AuditRecord {
                seq,
                at: 100 + seq,
                actor: "admin".into(),
                action: "node approved".into(),
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
}

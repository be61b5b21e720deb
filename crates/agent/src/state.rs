//! The state directory's files the agent reads back as values (`--state-dir`; their names are
//! `statedir`'s): the identity, the manifest of the bundle applied and the evidence waiting to be
//! delivered, and the directory's lock. Beneath every phase: it uses only the leaf `statedir`.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use base64::Engine;
use serde::{Deserialize, Serialize};
use trellis_core::bundle::Bundle;
use trellis_proto as proto;

use crate::statedir::{read_json, write_json, EVIDENCE, EVIDENCE_LAST, EVIDENCE_NEXT, IDENTITY, LOCK, MANIFEST};

/// Takes the directory's lock for as long as the file returned stays open, or refuses in one
/// sentence when another agent holds it: `run` and `apply` at once would each load the ruleset
/// and write the files against a view of them the other has changed. A lock, not a pid file: it
/// goes with the process however that ends.
pub fn lock(dir: &Path) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(LOCK);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: flock on a descriptor held open by `file`.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::WouldBlock {
            anyhow::bail!("another trellis-agent holds the state directory {}: stop it, or wait for its apply to end", dir.display());
        }
        return Err(e).with_context(|| format!("cannot lock {}", path.display()));
    }
    Ok(file)
}

// --- identity --------------------------------------------------------------------------------

/// `identity.toml`: who the node is, as the controller answered its enrolment.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Identity {
    pub node: String,
    pub mesh: String,
    pub controllers: Vec<String>,
    /// Base64 of the controller's ed25519 bundle-signing public key.
    pub signing_public_key: String,
    /// Base64 of the key announced to come next, in a bundle signed with the current one
    /// (ADR 0027): a bundle signed with it is taken, and then it is the only key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_signing_public_key: Option<String>,
    /// As of enrolment.
    pub state: proto::EnrolledState,
    /// The most node revocations a bundle this node applied counted (`trust.toml`, ADR 0024):
    /// a bundle counting fewer comes from a controller restored from before one of them, and is
    /// refused.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub revocations: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The keys a bundle or a freshness stamp may be signed with: the current one, and the one
/// announced to come next.
#[derive(Clone, Debug)]
pub struct SigningKeys {
    pub current: ed25519_dalek::VerifyingKey,
    pub next: Option<ed25519_dalek::VerifyingKey>,
}

impl SigningKeys {
    /// Verifies a bundle with the current key, or the next: whether the next signed it.
    pub fn verify(
        &self,
        bytes: &[u8],
        id: &Identity,
        last: Option<trellis_core::bundle::Applied>,
    ) -> Result<(trellis_core::bundle::Verified, bool), trellis_core::bundle::BundleError> {
        use trellis_core::bundle::{verify, BundleError};
        match (verify(bytes, &self.current, &id.mesh, &id.node, last), &self.next) {
            (Err(BundleError::BadSignature), Some(next)) => Ok((verify(bytes, next, &id.mesh, &id.node, last)?, true)),
            (other, _) => other.map(|v| (v, false)),
        }
    }

    /// Verifies a delta against the bundle held (ADR 0033) with the current key, or the next:
    /// whether the next signed it.
    pub fn verify_delta(
        &self,
        delta: &[u8],
        id: &Identity,
        last: Option<trellis_core::bundle::Applied>,
        held: &trellis_core::bundle::Bundle,
    ) -> Result<(trellis_core::bundle::Verified, bool), trellis_core::bundle::BundleError> {
        use trellis_core::bundle::{verify_delta, BundleError};
        match (verify_delta(delta, &self.current, &id.mesh, &id.node, last, held), &self.next) {
            (Err(BundleError::BadSignature), Some(next)) => Ok((verify_delta(delta, next, &id.mesh, &id.node, last, held)?, true)),
            (other, _) => other.map(|v| (v, false)),
        }
    }

    /// Verifies a freshness stamp with the current key, or the next.
    pub fn verify_stamp(&self, stamp: &[u8], mesh: &str) -> Result<i64, trellis_core::bundle::BundleError> {
        use trellis_core::bundle::{verify_stamp, BundleError};
        match (verify_stamp(stamp, &self.current, mesh), &self.next) {
            (Err(BundleError::BadSignature), Some(next)) => verify_stamp(stamp, next, mesh),
            (other, _) => other,
        }
    }
}

impl Identity {
    pub fn load(dir: &Path) -> Result<Identity> {
        let path = dir.join(IDENTITY);
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display())).with_context(|| {
            format!("{} holds no enrolled node; run `trellis-agent enrol TOKEN --state-dir {}`", dir.display(), dir.display())
        })?;
        toml::from_str(&text).with_context(|| format!("{} is not a valid identity", path.display()))
    }

    pub fn save(&self, dir: &Path) -> Result<()> {
        Ok(trellis_files::replace(&dir.join(IDENTITY), toml::to_string(self)?.as_bytes(), 0o644)?)
    }

    /// The key bundles and freshness stamps are signed with.
    pub fn signing_key(&self) -> Result<ed25519_dalek::VerifyingKey> {
        key_of(&self.signing_public_key, "signing_public_key")
    }

    /// The current key and the one announced to come next.
    pub fn signing_keys(&self) -> Result<SigningKeys> {
        let next = self.next_signing_public_key.as_deref().map(|k| key_of(k, "next_signing_public_key")).transpose()?;
        Ok(SigningKeys { current: self.signing_key()?, next })
    }

    /// This identity after applying a bundle whose `trust.toml` said `trust` (absent from a
    /// controller older than it), signed with the next key if `by_next`: that key is then the
    /// only one, the controller list is the one delivered, and a key announced is kept as next.
    pub fn adopting(&self, trust: Option<&trellis_core::trust::TrustFile>, by_next: bool) -> Identity {
        let mut id = self.clone();
        if by_next {
            if let Some(next) = id.next_signing_public_key.take() {
                id.signing_public_key = next;
            }
        }
        if let Some(t) = trust {
            id.controllers = t.controllers.clone();
            id.next_signing_public_key =
                t.next_signing_key.map(|k| base64::engine::general_purpose::STANDARD.encode(k)).filter(|k| *k != id.signing_public_key);
            id.revocations = id.revocations.max(t.revocations);
        }
        id
    }

    /// Why a bundle whose `trust.toml` said `trust` is refused before anything is written, if it
    /// is: it counts fewer node revocations than a bundle this node applied, so its controller
    /// was restored from before some of them and may give a revoked node's key back (the
    /// review of 2026-12-02, finding 2). A bundle without `trust.toml` (a controller older than
    /// it) is not judged.
    pub fn refuses_revocations(&self, trust: Option<&trellis_core::trust::TrustFile>) -> Option<String> {
        let counted = trust?.revocations;
        (counted < self.revocations).then(|| {
            format!(
                "the bundle counts {counted} node revocation(s), fewer than the {} of a bundle this node applied: its controller \
                 was restored from before some of them; revoke those nodes again there (trellis node revoke), and this node takes its \
                 bundles again (ADR 0024)",
                self.revocations
            )
        })
    }
}

/// An ed25519 public key in base64, from the identity's `field`.
fn key_of(b64: &str, field: &str) -> Result<ed25519_dalek::VerifyingKey> {
    let bytes = base64::engine::general_purpose::STANDARD.decode(b64).with_context(|| format!("identity.toml: {field} is not base64"))?;
    let bytes: [u8; 32] = bytes.try_into().map_err(|_| anyhow::anyhow!("identity.toml: {field} is not 32 bytes"))?;
    ed25519_dalek::VerifyingKey::from_bytes(&bytes).with_context(|| format!("identity.toml: {field} is not an ed25519 key"))
}

// --- manifest --------------------------------------------------------------------------------

/// What the agent last applied, kept on disk so a restart resumes without rewriting anything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u64,
    pub digest: String,
    pub files: Vec<ManifestFile>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    pub path: String,
    pub sha256: String,
    pub mode: u32,
}

impl Manifest {
    pub fn of(bundle: &Bundle) -> Manifest {
        Manifest {
            version: bundle.version,
            digest: hex::encode(bundle.content_digest()),
            files: bundle
                .files
                .iter()
                .map(|f| ManifestFile { path: f.path.clone(), sha256: hex::encode(f.sha256), mode: f.mode })
                .collect(),
        }
    }

    /// The digest, when the manifest holds a valid one.
    pub fn digest(&self) -> Option<[u8; 32]> {
        hex::decode(&self.digest).ok().and_then(|d| d.try_into().ok())
    }

    /// The manifest saved in `dir`; the empty one (version 0) when there is none.
    pub fn load(dir: &Path) -> Manifest {
        read_json(&dir.join(MANIFEST))
    }

    pub fn save(&self, dir: &Path) -> Result<()> {
        write_json(&dir.join(MANIFEST), self)
    }
}

// --- evidence --------------------------------------------------------------------------------

pub const EVIDENCE_BOUND: u64 = 10 * 1024 * 1024;

/// Evidence waiting to be delivered: one JSON record a line, oldest first, bounded on disk.
pub struct EvidenceBuffer {
    path: PathBuf,
    next_path: PathBuf,
    last_path: PathBuf,
}

impl EvidenceBuffer {
    pub fn new(dir: &Path) -> Self {
        EvidenceBuffer { path: dir.join(EVIDENCE), next_path: dir.join(EVIDENCE_NEXT), last_path: dir.join(EVIDENCE_LAST) }
    }

    /// The last record of an applied bundle the controller acknowledged, if any.
    pub fn last_applied(&self) -> Option<proto::Evidence> {
        std::fs::read_to_string(&self.last_path).ok().and_then(|l| serde_json::from_str(l.trim()).ok())
    }

    pub fn pending(&self) -> Vec<proto::Evidence> {
        std::fs::read_to_string(&self.path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    }

    fn next_seq(&self) -> i64 {
        std::fs::read_to_string(&self.next_path).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(1)
    }

    /// Appends a record with the next sequence number; drops the oldest records (their numbers
    /// become a visible gap) when the buffer would pass its bound. Returns how many were dropped.
    pub fn push(&self, mut record: proto::Evidence) -> Result<u64> {
        record.seq = self.next_seq();
        trellis_files::replace(&self.next_path, (record.seq + 1).to_string().as_bytes(), 0o600)?;
        let mut lines: VecDeque<String> = std::fs::read_to_string(&self.path).unwrap_or_default().lines().map(str::to_string).collect();
        lines.push_back(serde_json::to_string(&record)?);
        let mut dropped = 0;
        let mut size: u64 = lines.iter().map(|l| l.len() as u64 + 1).sum();
        while size > EVIDENCE_BOUND && lines.len() > 1 {
            size -= lines.pop_front().map_or(0, |l| l.len() as u64 + 1);
            dropped += 1;
        }
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        trellis_files::replace(&self.path, text.as_bytes(), 0o600)?;
        Ok(dropped)
    }

    /// Removes the records the controller acknowledged (the first `n`), keeping the last of them
    /// that reports an applied bundle ([`EvidenceBuffer::last_applied`]).
    pub fn ack(&self, n: usize) -> Result<()> {
        let all: Vec<String> = std::fs::read_to_string(&self.path).unwrap_or_default().lines().map(str::to_string).collect();
        let applied = all
            .iter()
            .take(n)
            .rev()
            .find(|l| serde_json::from_str::<proto::Evidence>(l).is_ok_and(|r| r.result == proto::EvidenceResult::Applied));
        if let Some(line) = applied {
            trellis_files::replace(&self.last_path, format!("{line}\n").as_bytes(), 0o600)?;
        }
        let lines: Vec<String> = all.into_iter().skip(n).collect();
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        Ok(trellis_files::replace(&self.path, text.as_bytes(), 0o600)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(version: i64) -> proto::Evidence {
        proto::Evidence { seq: 0, version, result: proto::EvidenceResult::Applied, error: None, files: Vec::new(), at: 1, unmanaged: false }
    }

    /// ADR 0024: the count of revocations only rises on the node, and a bundle counting fewer
    /// than one applied is refused with a sentence that says what to do; one without a
    /// `trust.toml` (an older controller) is not judged.
    #[test]
    fn a_bundle_counting_fewer_revocations_than_one_applied_is_refused() {
        let id = Identity {
            node: "db-1".into(),
            mesh: "basic".into(),
            controllers: vec!["127.0.0.1:8443".into()],
            signing_public_key: String::new(),
            next_signing_public_key: None,
            state: proto::EnrolledState::Active,
            revocations: 0,
        };
        let trust = |n: u64| trellis_core::trust::TrustFile {
            controllers: vec!["127.0.0.1:8443".into()],
            server_names: vec!["127.0.0.1".into()],
            revocations: n,
            ..Default::default()
        };
        let id = id.adopting(Some(&trust(2)), false);
        assert_eq!(id.revocations, 2);
        assert_eq!(id.adopting(Some(&trust(1)), false).revocations, 2, "the count never falls");
        assert_eq!(id.refuses_revocations(Some(&trust(2))), None);
        assert_eq!(id.refuses_revocations(Some(&trust(3))), None);
        assert_eq!(id.refuses_revocations(None), None);
        let why = id.refuses_revocations(Some(&trust(1))).expect("refused");
        assert!(why.contains("counts 1 node revocation(s), fewer than the 2") && why.contains("trellis node revoke"), "{why}");
        // Kept across a restart, and read from an identity written before the field.
        let text = toml::to_string(&id).unwrap();
        assert!(text.contains("revocations = 2"), "{text}");
        let old: Identity = toml::from_str(&text.replace("revocations = 2\n", "")).unwrap();
        assert_eq!(old.revocations, 0);
    }

    #[test]
    fn evidence_is_numbered_kept_in_order_and_acknowledged_from_the_front() {
        let dir = std::env::temp_dir().join(format!("trellis-evidence-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let buf = EvidenceBuffer::new(&dir);
        for v in 1..=5 {
            assert_eq!(buf.push(record(v)).unwrap(), 0);
        }
        let seqs: Vec<i64> = buf.pending().iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [1, 2, 3, 4, 5]);
        buf.ack(2).unwrap();
        buf.push(record(6)).unwrap();
        let seqs: Vec<i64> = buf.pending().iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [3, 4, 5, 6], "numbers keep rising after an acknowledgement");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_buffer_is_bounded_and_drops_the_oldest() {
        let dir = std::env::temp_dir().join(format!("trellis-evidence-bound-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let buf = EvidenceBuffer::new(&dir);
        let mut big = record(1);
        big.error = Some("x".repeat(1024 * 1024));
        let mut dropped = 0;
        for _ in 0..12 {
            dropped += buf.push(big.clone()).unwrap();
        }
        assert!(dropped >= 2, "dropped {dropped}");
        let size = std::fs::metadata(dir.join(EVIDENCE)).unwrap().len();
        assert!(size <= EVIDENCE_BOUND, "{size}");
        let seqs: Vec<i64> = buf.pending().iter().map(|r| r.seq).collect();
        assert_eq!(*seqs.last().unwrap(), 12, "the newest is kept");
        assert_eq!(seqs.first().copied(), Some(12 - seqs.len() as i64 + 1), "the oldest went first; the gap is visible by number");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

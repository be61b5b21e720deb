//! Anchoring the audit chain: after every decision (and whenever another replica moved the
//! head) the controller signs the head's sequence number and hash with its bundle-signing key and
//! keeps that checkpoint in its state directory, outside the database. Someone who can write the
//! database can recompute the chain, but not the checkpoint: `trellis audit verify` checks the
//! chain against it, so a cut tail or a rewritten record is seen.

use std::path::Path;

use base64::Engine;
use ed25519_dalek::Signer;
use trellis_proto::audit::Checkpoint;

use crate::bundle::SETTLE;
use crate::{Controller, Error, Result};

/// The checkpoint in a file, if it holds one.
pub fn read_checkpoint(path: &Path) -> Option<Checkpoint> {
    std::fs::read(path).ok().and_then(|b| serde_json::from_slice(&b).ok())
}

/// Whether a checkpoint is signed by this key.
pub fn checkpoint_signed_by(cp: &Checkpoint, key: &ed25519_dalek::VerifyingKey) -> bool {
    let Ok(sig) = base64::engine::general_purpose::STANDARD.decode(&cp.signature) else { return false };
    let Ok(sig) = ed25519_dalek::Signature::from_slice(&sig) else { return false };
    key.verify_strict(&Checkpoint::signed_bytes(cp.seq, &cp.hash), &sig).is_ok()
}

impl Controller {
    /// Signs the audit head (`seq`, `hash`) into the checkpoint file. Only forward: a head below
    /// the one signed means records vanished from the database, and the checkpoint that shows it
    /// is kept. The sequence number last signed is held in memory (read from the file once).
    pub(crate) async fn write_checkpoint(&self, seq: i64, hash: &str) -> Result<()> {
        let Some(path) = &self.checkpoint else { return Ok(()) };
        let mut signed = self.checkpoint_seq.lock().await;
        let last = *signed.get_or_insert_with(|| read_checkpoint(path).map_or(0, |cp| cp.seq));
        if last >= seq {
            return Ok(());
        }
        let hash = hash.to_string();
        let signature = self.signing_key().sign(&Checkpoint::signed_bytes(seq, &hash));
        let cp = Checkpoint { seq, hash, signature: base64::engine::general_purpose::STANDARD.encode(signature.to_bytes()) };
        let bytes = serde_json::to_vec_pretty(&cp).map_err(|e| Error::internal("writing the audit checkpoint", e))?;
        trellis_files::replace(path, &bytes, 0o600).map_err(|e| Error::internal("writing the audit checkpoint", e))?;
        *signed = Some(seq);
        Ok(())
    }

    /// Signs the audit head into the checkpoint file even though it is below the one signed: the
    /// chain after a restore, anchored again (`restore`).
    pub(crate) async fn write_checkpoint_anew(&self, seq: i64, hash: &str) -> Result<()> {
        let Some(path) = &self.checkpoint else { return Ok(()) };
        let mut signed = self.checkpoint_seq.lock().await;
        let signature = self.signing_key().sign(&Checkpoint::signed_bytes(seq, hash));
        let cp =
            Checkpoint { seq, hash: hash.to_string(), signature: base64::engine::general_purpose::STANDARD.encode(signature.to_bytes()) };
        let bytes = serde_json::to_vec_pretty(&cp).map_err(|e| Error::internal("writing the audit checkpoint", e))?;
        trellis_files::replace(path, &bytes, 0o600).map_err(|e| Error::internal("writing the audit checkpoint", e))?;
        *signed = Some(seq);
        Ok(())
    }

    /// The newest checkpoint, once the publish run that covers every decision made here before
    /// the call has signed it (waiting at most [`SETTLE`]).
    pub async fn checkpoint(&self) -> Result<Checkpoint> {
        self.settle(SETTLE).await?;
        self.checkpoint.as_deref().and_then(read_checkpoint).ok_or_else(|| Error::NotFound("audit checkpoint yet".into()))
    }
}

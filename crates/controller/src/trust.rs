//! What nodes trust beyond the CA, delivered in every bundle as `trust.toml` (issue 21): the
//! controller list (ADR 0028: `trellis controllers add|remove`, no node enrols again) and the
//! rotation of the bundle-signing key (ADR 0027: the next key announced in bundles signed by the
//! current one; once every active node applied such a bundle, or the overlap passed, bundles are
//! signed with the next key only, and an agent that took one refuses the old key).

use std::path::PathBuf;

use base64::Engine;
use ed25519_dalek::SigningKey;
use trellis_core::trust::{controller_address, TrustFile};
use trellis_proto::{self as proto, AuditAction};
use trellis_store::Audit;

use crate::layout::{NEXT_SIGNING_KEY, RETIRED_SIGNING_KEY, RETIRED_SIGNING_KEY_OLD};
use crate::rotation::{check_overlap, Started, SIGNING_KEY_ROTATION};
use crate::{Controller, Error, Result};

/// The keys bundles, stamps and checkpoints are signed with: the current one, and the next once
/// a rotation announced it.
pub(crate) struct Signing {
    pub current: SigningKey,
    pub next: Option<SigningKey>,
}

/// What one publish run puts in every bundle's `trust.toml`, and the key it signs with.
pub(crate) struct RunTrust {
    pub text: String,
    pub key: SigningKey,
    /// The next key this run announces (base64 of its public half), while a rotation is open.
    pub announcing: Option<String>,
    /// The next CA this run announces (its fingerprint, hex), while a CA rotation is open.
    pub announcing_ca: Option<String>,
}

fn b64(key: &ed25519_dalek::VerifyingKey) -> String {
    base64::engine::general_purpose::STANDARD.encode(key.to_bytes())
}

/// Reads a signing key file (base64 of the 32-byte seed).
pub(crate) fn read_key(path: &std::path::Path) -> anyhow::Result<SigningKey> {
    use anyhow::Context;
    let text = trellis_files::read(path)?;
    let bytes =
        base64::engine::general_purpose::STANDARD.decode(text.trim()).with_context(|| format!("{} is not base64", path.display()))?;
    let seed: [u8; 32] = bytes.try_into().map_err(|_| anyhow::anyhow!("{} does not hold 32 bytes", path.display()))?;
    Ok(SigningKey::from_bytes(&seed))
}

impl Controller {
    /// The key this controller signs with now.
    pub(crate) fn signing_key(&self) -> SigningKey {
        self.signing.read().expect("signing").current.clone()
    }

    /// The next signing key held (base64 of its public half), while a rotation announced one.
    pub(crate) fn next_signing_key(&self) -> Option<String> {
        self.signing.read().expect("signing").next.as_ref().map(|k| b64(&k.verifying_key()))
    }

    /// Where this controller's state directory keeps a file, if it has one (not in process).
    fn state_file(&self, name: &str) -> Option<PathBuf> {
        self.state_dir.as_ref().map(|d| d.join(name))
    }

    /// The controller list nodes are given, with the server certificate's names: the stored list,
    /// or the configured advertise addresses while none was set.
    pub async fn controllers(&self) -> Result<proto::ControllerList> {
        let stored = self.store.controllers().await?;
        let controllers = if stored.is_empty() { self.config.advertise.clone() } else { stored };
        Ok(proto::ControllerList { controllers, server_names: self.server_names.clone() })
    }

    /// Adds a controller address at the end of the list nodes are given; audited. Refused: an
    /// address that is not `HOST:PORT`, one listed already, one whose host the server
    /// certificate does not name (a node dialling it would refuse the handshake).
    pub async fn add_controller(&self, address: &str) -> Result<proto::ControllerList> {
        if !controller_address(address) {
            return Err(Error::BadRequest(format!("`{}` is not HOST:PORT", proto::text::printable(address))));
        }
        let mut list = self.controllers().await?;
        if list.controllers.iter().any(|c| c == address) {
            return Err(Error::BadRequest(format!("controller {address} is listed already")));
        }
        let host = crate::state::split_host_port(address).map_err(|e| Error::BadRequest(e.to_string()))?.0;
        if !self.server_names.is_empty() && !self.server_names.contains(&host) {
            return Err(Error::BadRequest(format!(
                "the server certificate names {}, not {host}: a node dialling {address} would refuse the controller; add an address under one of those names",
                self.server_names.join(", ")
            )));
        }
        if list.controllers.len() >= trellis_core::trust::MAX_CONTROLLERS {
            return Err(Error::BadRequest(format!("the list holds {} controllers, the most it may", trellis_core::trust::MAX_CONTROLLERS)));
        }
        list.controllers.push(address.to_string());
        let audit = Audit {
            at: self.now(),
            actor: "admin",
            action: AuditAction::ControllerAdded,
            subject: address,
            detail: list.controllers.join(", "),
        };
        self.store.set_controllers(&list.controllers, audit.at, &audit).await?;
        self.ask_publish();
        Ok(list)
    }

    /// Removes a controller address from the list nodes are given; audited. The last one stays.
    pub async fn remove_controller(&self, address: &str) -> Result<proto::ControllerList> {
        let mut list = self.controllers().await?;
        if !list.controllers.iter().any(|c| c == address) {
            return Err(Error::NotFound(format!(
                "controller {} in the list ({})",
                proto::text::printable(address),
                list.controllers.join(", ")
            )));
        }
        if list.controllers.len() == 1 {
            return Err(Error::BadRequest(format!(
                "{address} is the only controller listed: nodes would have none to ask; add another first"
            )));
        }
        list.controllers.retain(|c| c != address);
        let audit = Audit {
            at: self.now(),
            actor: "admin",
            action: AuditAction::ControllerRemoved,
            subject: address,
            detail: list.controllers.join(", "),
        };
        self.store.set_controllers(&list.controllers, audit.at, &audit).await?;
        self.remember(crate::ledger::Entry::Controller { address: address.to_string(), at: audit.at });
        self.ask_publish();
        Ok(list)
    }

    /// Starts a rotation of the bundle-signing key to the key in this controller's
    /// `signing.next.key` (the one `trellis rotate signing-key` wrote), whose public half the
    /// request names; audited. Refused while another is in progress.
    pub async fn rotate_signing_key(&self, req: &proto::SigningKeyRotation) -> Result<proto::Rotation> {
        check_overlap(req.overlap_secs)?;
        let next = self.load_next_key(&req.next_public_key)?;
        let started = Started { kind: SIGNING_KEY_ROTATION, what: "signing key", action: AuditAction::SigningKeyRotationStarted };
        self.start_rotation(started, &req.next_public_key, req.overlap_secs, format!("overlap {} s", req.overlap_secs)).await?;
        self.signing.write().expect("signing").next = Some(next);
        self.rotation_started(&req.next_public_key).await
    }

    /// The next key from this state directory, which must be the one named.
    fn load_next_key(&self, named: &str) -> Result<SigningKey> {
        let Some(path) = self.state_file(NEXT_SIGNING_KEY) else {
            return Err(Error::BadRequest("this controller has no state directory to hold a next signing key".into()));
        };
        let key = read_key(&path).map_err(|e| {
            Error::BadRequest(format!(
                "cannot read the next signing key {}: {e:#}; run `trellis rotate signing-key --state-dir` on this controller's state directory (and copy signing.next.key to every replica's)",
                path.display()
            ))
        })?;
        if b64(&key.verifying_key()) != named {
            return Err(Error::BadRequest(format!("{} holds another key than the one named", path.display())));
        }
        if key.verifying_key() == self.signing_key().verifying_key() {
            return Err(Error::BadRequest("the next signing key is the current one".into()));
        }
        Ok(key)
    }

    /// What this publish run delivers in `trust.toml` and signs with. A rotation completed
    /// (here or by another replica) makes its key the current one first, and retires the old.
    pub(crate) async fn run_trust(&self) -> Result<RunTrust> {
        let rotations = self.store.rotations().await?;
        let ca_rotation = rotations.iter().find(|r| r.kind == crate::rotation::CA_ROTATION);
        let (ca, next_ca, announcing_ca) = self.run_ca(ca_rotation).await?;
        let rotation = rotations.into_iter().find(|r| r.kind == SIGNING_KEY_ROTATION);
        let mut announcing = None;
        if let Some(r) = &rotation {
            let current = b64(&self.signing_key().verifying_key());
            if r.completed_at.is_some() && current != r.next_key {
                self.promote(&r.next_key)?;
            } else if r.completed_at.is_none() {
                let held = self.signing.read().expect("signing").next.as_ref().map(|k| b64(&k.verifying_key()));
                if held.as_deref() != Some(&r.next_key) {
                    // Another replica started it: this one reads the key from its own copy.
                    match self.load_next_key(&r.next_key) {
                        Ok(key) => self.signing.write().expect("signing").next = Some(key),
                        Err(e) => tracing::error!("a rotation of the signing key is in progress, but this replica cannot announce it: {e}"),
                    }
                }
                let held = self.signing.read().expect("signing").next.as_ref().map(|k| b64(&k.verifying_key()));
                if held.as_deref() == Some(&r.next_key) {
                    announcing = Some(r.next_key.clone());
                }
            }
        }
        let list = self.controllers().await?;
        let next_signing_key =
            announcing.as_ref().and_then(|k| base64::engine::general_purpose::STANDARD.decode(k).ok()).and_then(|b| b.try_into().ok());
        let revocations = self.store.revocations_decided().await?;
        let text = TrustFile { controllers: list.controllers, server_names: list.server_names, next_signing_key, ca, next_ca, revocations }
            .write();
        // What every agent will read: a file it would refuse is not published (every agent would
        // keep trusting what it did, and a rotation could never be confirmed).
        TrustFile::parse(&text).map_err(|e| Error::internal("writing trust.toml", e))?;
        Ok(RunTrust { text, key: self.signing_key(), announcing, announcing_ca })
    }

    /// The rotation to `next_key` completed: its key signs from now on; the old one's public half
    /// is kept as `signing.retired.pub` (the private half of one kept by an older controller is
    /// removed) and the state directory's `signing.key` is the new one.
    fn promote(&self, next_key: &str) -> Result<()> {
        let mut signing = self.signing.write().expect("signing");
        let Some(next) = signing.next.take().filter(|k| b64(&k.verifying_key()) == next_key) else {
            drop(signing);
            // A replica that never held the key: its own copy, or it cannot sign any more.
            let key = self.load_next_key(next_key)?;
            self.signing.write().expect("signing").next = Some(key);
            return self.promote(next_key);
        };
        if let Some(dir) = &self.state_dir {
            let enc = |k: &SigningKey| base64::engine::general_purpose::STANDARD.encode(k.to_bytes());
            let write = |name: &str, k: &SigningKey| {
                trellis_files::replace(&dir.join(name), enc(k).as_bytes(), 0o600)
                    .map_err(|e| Error::internal("keeping the signing keys", e))
            };
            let public = base64::engine::general_purpose::STANDARD.encode(signing.current.verifying_key().to_bytes());
            trellis_files::replace(&dir.join(RETIRED_SIGNING_KEY), format!("{public}\n").as_bytes(), 0o644)
                .map_err(|e| Error::internal("keeping the signing keys", e))?;
            write(crate::layout::SIGNING_KEY, &next)?;
            let _ = std::fs::remove_file(dir.join(NEXT_SIGNING_KEY));
            let _ = std::fs::remove_file(dir.join(RETIRED_SIGNING_KEY_OLD));
        }
        signing.current = next;
        tracing::info!("bundles are signed with the rotated key {next_key} from now on");
        Ok(())
    }
}

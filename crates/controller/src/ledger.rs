//! Revocations kept outside the database (the review of 2026-12-02, finding 2). A database
//! restored from a backup taken before a node was revoked held the node `active` again, and its
//! key went back into every peer's bundle; a revoked token could be redeemed again and a removed
//! controller was listed again. Each of these decisions is also appended to `revocations.ledger`
//! in the state directory (one JSON line each, synced, the file 0600), and at every start the
//! controller makes again what the ledger holds and the database lacks, audited as re-applied.
//! A node enrolled again since (another key and certificate) is not the node that was revoked,
//! and is left as it is. A whole state directory restored with its database rolls the ledger
//! back too: that case is the nodes' to witness (ADR 0024).

use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};
use trellis_proto::{AuditAction, EnrolledState};
use trellis_store::Audit;

use crate::layout::LEDGER;
use crate::{Controller, Result};

/// The longest ledger line read; a longer one is no entry trellis wrote.
const MAX_LINE: usize = 4096;

/// One decision that a restore must not undo.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Entry {
    /// A node revoked, with the key and certificate it had then.
    Node { name: String, key: Option<String>, serial: Option<String>, at: i64 },
    /// A token revoked.
    Token { id: String, at: i64 },
    /// A controller address taken out of the list nodes are given.
    Controller { address: String, at: i64 },
}

/// Appends `entry` to the ledger at `path`, created 0600, and syncs it.
pub fn append(path: &Path, entry: &Entry) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut line = serde_json::to_string(entry).map_err(std::io::Error::other)?;
    line.push('\n');
    let mut f = std::fs::OpenOptions::new().create(true).append(true).mode(0o600).open(path)?;
    f.write_all(line.as_bytes())?;
    f.sync_all()
}

/// The ledger's entries, in the order they were decided, and one sentence per line that is no
/// entry (a line cut short by a crash, say), naming it.
pub fn read(path: &Path) -> (Vec<Entry>, Vec<String>) {
    let Ok(text) = std::fs::read_to_string(path) else { return (Vec::new(), Vec::new()) };
    let (mut entries, mut bad) = (Vec::new(), Vec::new());
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        match (line.len() <= MAX_LINE).then(|| serde_json::from_str::<Entry>(line)) {
            Some(Ok(e)) => entries.push(e),
            _ => bad.push(format!("{}:{}: not a ledger entry; left out", path.display(), i + 1)),
        }
    }
    (entries, bad)
}

impl Controller {
    /// Records a decision a restore must not undo in the state directory's ledger (none in
    /// process). The decision stands in the database already; a ledger that cannot be written
    /// is logged, never a refusal of the decision.
    pub(crate) fn remember(&self, entry: Entry) {
        let Some(dir) = &self.state_dir else { return };
        if let Err(e) = append(&dir.join(LEDGER), &entry) {
            tracing::error!(
                "cannot write {}: {e}; a restore from a backup taken before now would undo {entry:?}",
                dir.join(LEDGER).display()
            );
        }
    }

    /// Makes again every decision of the ledger the database lacks (it was restored from before
    /// them), each audited; returns how many. Run at every start.
    pub(crate) async fn reapply_ledger(&self) -> Result<usize> {
        let Some(dir) = &self.state_dir else { return Ok(0) };
        let path = dir.join(LEDGER);
        let (entries, bad) = read(&path);
        for b in bad {
            tracing::warn!("{b}");
        }
        let mut made = 0;
        for e in entries {
            let why = |what: &str, at: i64| {
                format!(
                    "re-applied from {}: {what} on {}, which the database did not hold (it was restored from a backup taken before)",
                    path.display(),
                    trellis_proto::text::date(at)
                )
            };
            match &e {
                Entry::Node { name, key, serial, at } => {
                    let Some(r) = self.store.node(name).await? else { continue };
                    let same = (key.is_some() && r.wg_public_key == *key) || (serial.is_some() && r.cert_serial == *serial);
                    if r.state == EnrolledState::Revoked || !same {
                        continue;
                    }
                    let detail = why("revoked", *at);
                    let audit = Audit { at: self.now(), actor: "controller", action: AuditAction::NodeRevoked, subject: name, detail };
                    self.store.set_state(name, &[EnrolledState::Pending, EnrolledState::Active], EnrolledState::Revoked, &audit).await?;
                    self.publisher.set_state(name, EnrolledState::Revoked);
                    tracing::warn!(node = %name, "node `{name}` was revoked on {} and the restored database held it {}: revoked again", trellis_proto::text::date(*at), r.state.as_str());
                    made += 1;
                }
                Entry::Token { id, at } => {
                    let Some(t) = self.store.token(id).await? else { continue };
                    let audit = Audit {
                        at: self.now(),
                        actor: "controller",
                        action: AuditAction::TokenRevoked,
                        subject: &t.node,
                        detail: why(&format!("token {id} revoked"), *at),
                    };
                    if self.store.revoke_token(id, &audit).await? {
                        tracing::warn!(
                            "token {id} was revoked on {} and the restored database held it usable: revoked again",
                            trellis_proto::text::date(*at)
                        );
                        made += 1;
                    }
                }
                Entry::Controller { address, at } => {
                    let mut list = self.controllers().await?;
                    if !list.controllers.iter().any(|c| c == address) || list.controllers.len() == 1 {
                        continue;
                    }
                    list.controllers.retain(|c| c != address);
                    let audit = Audit {
                        at: self.now(),
                        actor: "controller",
                        action: AuditAction::ControllerRemoved,
                        subject: address,
                        detail: why(&format!("removed, leaving {}", list.controllers.join(", ")), *at),
                    };
                    self.store.set_controllers(&list.controllers, audit.at, &audit).await?;
                    tracing::warn!(
                        "controller {address} was removed on {} and the restored database listed it: removed again",
                        trellis_proto::text::date(*at)
                    );
                    made += 1;
                }
            }
        }
        if made > 0 {
            self.ask_publish();
        }
        Ok(made)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_read_back_and_a_line_cut_short_is_named_and_left_out() {
        let dir = trellis_testing::TempDir::new("ledger");
        let path = dir.join(LEDGER);
        let entries = [
            Entry::Node { name: "op-1".into(), key: Some("k".into()), serial: Some("s".into()), at: 10 },
            Entry::Token { id: "t1".into(), at: 11 },
            Entry::Controller { address: "c:8443".into(), at: 12 },
        ];
        for e in &entries {
            append(&path, e).unwrap();
        }
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"{\"kind\":\"node\",\"na").unwrap();
        let (read_back, bad) = read(&path);
        assert_eq!(read_back, entries);
        assert_eq!(bad, [format!("{}:4: not a ledger entry; left out", path.display())]);
    }
}

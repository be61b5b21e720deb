//! Declarations: applying a new revision (validated exactly like `trellis check`, allocated,
//! stored with its audit record) and the parsed declaration of the current revision.

use std::sync::Arc;

use sha2::{Digest, Sha256};
use trellis_core::decl::Indexed;
use trellis_core::Declaration;
use trellis_proto as proto;
use trellis_proto::AuditAction;
use trellis_store::Audit;

use crate::{Controller, Error, Result};

pub fn diagnostic(d: &trellis_core::Diagnostic) -> proto::Diagnostic {
    proto::Diagnostic {
        severity: d.severity.as_str().to_string(),
        file: d.loc.file.to_string(),
        line: d.loc.line,
        column: d.loc.col,
        message: d.message.clone(),
    }
}

fn valid_path(p: &str) -> bool {
    p == trellis_core::load::MESH_FILE
        || p.strip_prefix("modules/")
            .and_then(|n| n.strip_suffix(".toml"))
            .is_some_and(|n| !n.is_empty() && n.len() <= 64 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'))
}

/// Loads a stored or submitted set of files, named as in the declaration directory.
pub fn load_files(files: &[(String, String)]) -> trellis_core::Loaded {
    trellis_core::load_relative(files, str::to_string)
}

/// The digest that says whether two revisions hold the same files.
fn digest(files: &[(String, String)]) -> String {
    let mut h = Sha256::new();
    for (p, t) in files {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p.as_bytes());
        h.update((t.len() as u64).to_be_bytes());
        h.update(t.as_bytes());
    }
    hex::encode(h.finalize())
}

impl Controller {
    /// The declaration of the current revision, if any: parsed once per revision.
    pub(crate) async fn current_declaration(&self) -> Result<Option<(i64, Arc<Declaration>)>> {
        Ok(self.current_indexed().await?.map(|(n, d)| (n, d.decl().clone())))
    }

    /// The declaration of the current revision with its nodes indexed by name and declared key,
    /// for the requests that look nodes up (enrolments, tokens): parsed and indexed once per
    /// revision.
    pub(crate) async fn current_indexed(&self) -> Result<Option<(i64, Arc<Indexed>)>> {
        let Some((number, _)) = self.store.current_revision_head().await? else {
            return Ok(None);
        };
        let mut cache = self.declaration.lock().await;
        if let Some((n, d)) = cache.as_ref() {
            if *n == number {
                return Ok(Some((number, d.clone())));
            }
        }
        let Some(rev) = self.store.current_revision().await? else {
            return Ok(None);
        };
        let decl =
            load_files(&rev.files).declaration.ok_or_else(|| Error::internal("loading the stored revision", "it no longer validates"))?;
        let decl = Arc::new(Indexed::new(Arc::new(decl)));
        *cache = Some((rev.number, decl.clone()));
        Ok(Some((rev.number, decl)))
    }

    /// Why `decl`'s overlay cannot be, if a controller's address is inside one of its prefixes:
    /// every node drops what arrives from outside the overlay with an overlay source (the
    /// underlay must not pass for the overlay), and so would drop the controller's answers.
    async fn controller_in_overlay(&self, decl: &trellis_core::Declaration) -> Result<Option<String>> {
        let mut addresses: Vec<String> = self.config.advertise.clone();
        addresses.extend(self.controllers().await?.controllers);
        for a in &addresses {
            let Ok((host, _)) = crate::state::split_host_port(a) else { continue };
            let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() else { continue };
            let inside = match ip {
                std::net::IpAddr::V4(v4) => decl.mesh.overlay_ipv4.filter(|p| p.contains(&v4)).map(|p| p.to_string()),
                std::net::IpAddr::V6(v6) => decl.mesh.overlay_ipv6.filter(|p| p.contains(&v6)).map(|p| p.to_string()),
            };
            if let Some(prefix) = inside {
                return Ok(Some(format!(
                    "the overlay's prefix {prefix} holds the controller's address {ip} ({a}): nodes drop what arrives from outside the overlay with an overlay address as its source, so they would drop the controller's answers; choose an overlay prefix apart from every underlay network; nothing was changed"
                )));
            }
        }
        Ok(None)
    }

    /// Applies a declaration as a new revision, unless it has errors (then nothing changes) or
    /// the current revision is not `expect_revision`. The same files as the current revision are
    /// answered as unchanged.
    pub async fn apply(&self, submitted: &[proto::DeclFile], expect_revision: Option<i64>) -> Result<proto::ApplyResponse> {
        let mut files: Vec<(String, String)> = Vec::new();
        for f in submitted {
            if !valid_path(&f.path) {
                return Err(Error::BadRequest(format!("file {:?} is neither mesh.toml nor modules/NAME.toml", f.path)));
            }
            if files.iter().any(|(p, _)| *p == f.path) {
                return Err(Error::BadRequest(format!("file {:?} is sent twice", f.path)));
            }
            files.push((f.path.clone(), f.text.clone()));
        }
        if !files.iter().any(|(p, _)| p == trellis_core::load::MESH_FILE) {
            return Err(Error::BadRequest("the declaration has no mesh.toml".into()));
        }
        files.sort();
        let checked = trellis_core::check(&files, str::to_string);
        let errors = checked.errors();
        let out: Vec<proto::Diagnostic> = checked.diagnostics.iter().map(diagnostic).collect();
        let decl = checked.declaration;
        let Some(decl) = decl.filter(|_| errors == 0) else {
            return Err(Error::InvalidDeclaration {
                message: format!("the declaration has {errors} error(s); nothing was changed"),
                diagnostics: out,
            });
        };
        if let Some(message) = self.controller_in_overlay(&decl).await? {
            return Err(Error::InvalidDeclaration { message, diagnostics: out });
        }
        let digest = digest(&files);
        if let Some(cur) = self.store.current_revision_head().await? {
            // The store refuses a stale expectation too, inside the transaction; this answers an
            // unchanged declaration without writing anything.
            if expect_revision.is_none_or(|e| e == cur.0) && cur.1 == digest {
                return Ok(proto::ApplyResponse { revision: cur.0, diagnostics: out, unchanged: true });
            }
        }
        let previous = self.store.allocation().await?;
        // Declared nodes are placed around the pools' members, whose addresses (pinned, kept on
        // their records) are not the declaration's to store.
        let members: Vec<trellis_core::decl::Member> = self.store.members().await?.iter().filter_map(crate::pools::member_of).collect();
        let mut allocation = trellis_core::allocate(&decl.with_members(&members), &previous)
            .map_err(|d| Error::InvalidDeclaration { message: d.message.clone(), diagnostics: vec![diagnostic(&d)] })?;
        // A member whose name the declaration now gives a declared node (its pool gone or
        // renamed) goes with this revision: a record of a pool is never taken for a declared node.
        let declared: std::collections::HashSet<&str> = decl.nodes.iter().map(|n| n.name.as_str()).collect();
        let (replaced, members): (Vec<_>, Vec<_>) = members.iter().partition(|m| declared.contains(m.name.as_str()));
        for m in members {
            allocation.ipv4.remove(&m.name);
            allocation.ipv6.remove(&m.name);
        }
        let mut detail = format!("sha256 {digest}");
        if !replaced.is_empty() {
            let named: Vec<String> = replaced.iter().map(|m| format!("{} (pool {})", m.name, m.pool)).collect();
            detail.push_str(&format!("; removed the pool members it names as declared nodes: {}", named.join(", ")));
        }
        let audit = Audit { at: self.now(), actor: "admin", action: AuditAction::DeclarationApplied, subject: &decl.mesh.name, detail };
        let replaced: Vec<String> = replaced.iter().map(|m| m.name.clone()).collect();
        let revision = self.store.apply(&files, &digest, &allocation, expect_revision, &replaced, &audit).await?;
        // Before the answer, so that what the apply decided is all in the audit chain when it
        // returns (publish runs look again, for a start on a declaration and a CA rotated).
        self.scope_services_ca(&decl.mesh).await?;
        // The publish run that follows uses this declaration instead of parsing the stored files
        // again (the cache is keyed by revision, so a newer one elsewhere still wins).
        {
            let mut cache = self.declaration.lock().await;
            if cache.as_ref().is_none_or(|(n, _)| *n < revision) {
                *cache = Some((revision, Arc::new(Indexed::new(Arc::new(decl)))));
            }
        }
        self.ask_publish();
        Ok(proto::ApplyResponse { revision, diagnostics: out, unchanged: false })
    }
}

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

/// A declaration offered in `Controller::applying` while its apply stores it, withdrawn when
/// dropped (unless another apply has offered its own since).
struct Offered<'a> {
    slot: &'a std::sync::Mutex<Option<(String, Arc<Indexed>)>>,
    decl: Arc<Indexed>,
}

impl<'a> Offered<'a> {
    fn new(slot: &'a std::sync::Mutex<Option<(String, Arc<Indexed>)>>, digest: &str, decl: &Arc<Indexed>) -> Self {
        *slot.lock().expect("applying") = Some((digest.to_string(), decl.clone()));
        Offered { slot, decl: decl.clone() }
    }
}

impl Drop for Offered<'_> {
    fn drop(&mut self) {
        let mut slot = self.slot.lock().expect("applying");
        if slot.as_ref().is_some_and(|(_, d)| Arc::ptr_eq(d, &self.decl)) {
            slot.take();
        }
    }
}

/// What an apply allocated: from the allocation stored with revision `held_revision`
/// (`previous`), around the pools' `members`.
struct Placed {
    held_revision: i64,
    previous: Arc<trellis_core::Allocation>,
    /// `previous` itself when the declaration keeps the addressing of the revision it was
    /// stored with.
    allocation: Arc<trellis_core::Allocation>,
    members: Vec<trellis_core::decl::Member>,
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
        let Some((number, digest)) = self.store.current_revision_head().await? else {
            return Ok(None);
        };
        let mut cache = self.declaration.lock().await;
        if let Some((n, d)) = cache.as_ref() {
            if *n == number {
                return Ok(Some((number, d.clone())));
            }
        }
        // The revision an apply has just stored: its files are the ones it parsed.
        let applying = self.applying.lock().expect("applying").as_ref().filter(|(d, _)| *d == digest).map(|(_, decl)| decl.clone());
        if let Some(decl) = applying {
            *cache = Some((number, decl.clone()));
            return Ok(Some((number, decl)));
        }
        let Some(rev) = self.store.current_revision().await? else {
            return Ok(None);
        };
        let decl =
            self.load(&rev.files).declaration.ok_or_else(|| Error::internal("loading the stored revision", "it no longer validates"))?;
        let decl = Arc::new(Indexed::new(Arc::new(decl)));
        *cache = Some((rev.number, decl.clone()));
        Ok(Some((rev.number, decl)))
    }

    /// Loads a stored or submitted set of files, named as in the declaration directory, parsing
    /// only the node tables of `mesh.toml` whose text the last load did not have (ADR 0034).
    fn load(&self, files: &[(String, String)]) -> trellis_core::Loaded {
        let mut cache = self.load_cache.lock().expect("load cache");
        trellis_core::load::load_relative_cached(files, str::to_string, &mut cache)
    }

    /// The allocation stored with the current revision, with its number (0 before the first):
    /// kept between requests, read again only when another revision became current.
    pub(crate) async fn current_allocation(&self) -> Result<(i64, Arc<trellis_core::Allocation>)> {
        let mut cache = self.allocation.lock().await;
        let Some((number, digest)) = self.store.current_revision_head().await? else {
            return Ok((0, Arc::new(self.store.allocation().await?)));
        };
        if let Some((n, d, a)) = cache.as_ref() {
            if *n == number && *d == digest {
                return Ok((number, a.clone()));
            }
        }
        let allocation = Arc::new(self.store.allocation().await?);
        // Kept only when no apply committed between the two reads (the rows read are then the
        // ones stored with this revision).
        if self.store.current_revision_head().await?.is_some_and(|(n, d)| n == number && d == digest) {
            *cache = Some((number, digest, allocation.clone()));
        }
        Ok((number, allocation))
    }

    /// The addresses `decl` would store, placed around the pools' members (whose addresses,
    /// pinned, kept on their records, are not the declaration's to store) and from the current
    /// revision's; or why the pool is exhausted.
    async fn place(&self, decl: &Declaration) -> Result<std::result::Result<Placed, trellis_core::Diagnostic>> {
        let (held_revision, previous) = self.current_allocation().await?;
        let members: Vec<trellis_core::decl::Member> = self.store.members().await?.iter().filter_map(crate::pools::member_of).collect();
        // The same nodes, pins, overlays and mesh name as the revision the allocation is stored
        // with: allocating again gives every declared node the address it holds, so it is not
        // done. Only when that is certain: the allocation is the one kept for the current
        // revision (read with the head unmoved), it holds an address of each family for each
        // declared node and nothing else, and no pool has a member (a member placed while an
        // apply ran may hold a declared node's address: allocating moves the node, or says why
        // it cannot). The declaration cache is not waited for: a publish run may be filling it.
        let confirmed = self.allocation.lock().await.as_ref().is_some_and(|(n, _, a)| *n == held_revision && Arc::ptr_eq(a, &previous));
        let complete = |pool: bool, held: usize| held == if pool { decl.nodes.len() } else { 0 };
        let complete = complete(decl.mesh.overlay_ipv4.is_some(), previous.ipv4.len())
            && complete(decl.mesh.overlay_ipv6.is_some(), previous.ipv6.len());
        let same =
            self.declaration.try_lock().ok().map(|cache| {
                cache.as_ref().is_some_and(|(n, d)| *n == held_revision && trellis_core::alloc::same_addressing(d.decl(), decl))
            });
        if confirmed && members.is_empty() && complete && same == Some(true) {
            return Ok(Ok(Placed { held_revision, allocation: previous.clone(), previous, members }));
        }
        tracing::debug!(confirmed, members = members.len(), complete, same = ?same, "allocating again");
        Ok(trellis_core::allocate(&decl.with_members(&members), &previous).map(|allocation| Placed {
            held_revision,
            previous,
            allocation: Arc::new(allocation),
            members,
        }))
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
        // What is stored with the revision and depends on its files only (their digest, and
        // the files packed) is made on a blocking thread while they are loaded and checked (the
        // load takes one core, then the check and the index by name both): at 100,000 nodes it is
        // 60-90 ms, and all of it is thrown away when the check refuses.
        let files = Arc::new(submitted_files(submitted)?);
        let stored = {
            let files = files.clone();
            tokio::task::spawn_blocking(move || (digest(&files), trellis_store::Packed::new(&files)))
        };
        let started = std::time::Instant::now();
        let (diagnostics, accepted, t) = self.load_and_check(&files).await?;
        let errors = diagnostics.iter().filter(|d| d.is_error()).count();
        let out: Vec<proto::Diagnostic> = diagnostics.iter().map(diagnostic).collect();
        let (decl, Placed { held_revision, previous, mut allocation, members }, indexed) = match accepted {
            Some(accepted) if errors == 0 => accepted,
            _ => {
                return Err(Error::InvalidDeclaration {
                    message: format!("the declaration has {errors} error(s); nothing was changed"),
                    diagnostics: out,
                })
            }
        };
        let (digest, packed) = stored.await.map_err(|e| Error::internal("digesting and packing the declaration", e))?;
        if let Some(message) = self.controller_in_overlay(&decl).await? {
            return Err(Error::InvalidDeclaration { message, diagnostics: out });
        }
        if let Some(cur) = self.store.current_revision_head().await? {
            // The store refuses a stale expectation too, inside the transaction; this answers an
            // unchanged declaration without writing anything.
            if expect_revision.is_none_or(|e| e == cur.0) && cur.1 == digest {
                return Ok(proto::ApplyResponse { revision: cur.0, diagnostics: out, unchanged: true });
            }
        }
        let (replaced, detail) = members_replaced(&decl, &members, &mut allocation, &digest);
        let subject = decl.mesh.name.clone();
        let audit = Audit { at: self.now(), actor: "admin", action: AuditAction::DeclarationApplied, subject: &subject, detail };
        let addresses = trellis_store::Addresses { allocation: allocation.clone(), held: Some((held_revision, previous)) };
        // The declaration indexed beside the check is offered to whoever finds the revision
        // current before this apply has put it in the cache (a publish run woken by the database
        // would else parse the stored files again, holding the cache while this apply waits on
        // it); withdrawn however this request ends (stored, refused, or dropped while it waits).
        let _offered = Offered::new(&self.applying, &digest, &indexed);
        let stored_at = std::time::Instant::now();
        let revision = self.store.apply(packed, &digest, addresses, expect_revision, &replaced, &audit).await?;
        let store_ms = stored_at.elapsed().as_millis();
        let before_store_ms = (stored_at - started).as_millis() - t.load_ms - t.place_ms - t.check_ms;
        self.remember_stored(revision, &digest, allocation, &indexed).await;
        // Before the answer, so that what the apply decided is all in the audit chain when it
        // returns (publish runs look again, for a start on a declaration and a CA rotated).
        self.scope_services_ca(&indexed.decl().mesh).await?;
        self.ask_publish();
        tracing::debug!(
            revision,
            parsed = t.parsed,
            whole = t.whole,
            load_ms = t.load_ms,
            place_ms = t.place_ms,
            check_ms = t.check_ms,
            before_store_ms,
            store_ms,
            after_store_ms = stored_at.elapsed().as_millis() - store_ms,
            ms = started.elapsed().as_millis(),
            "apply"
        );
        Ok(proto::ApplyResponse { revision, diagnostics: out, unchanged: false })
    }

    /// The files loaded, placed and checked as `trellis check` checks them, but allocated once:
    /// the addresses the check's topology needs are the ones this revision stores (ADR 0034).
    /// Every diagnostic, sorted; the declaration with its placement and its index by name when
    /// it loaded and was placed; each stage timed for the debug log, as a publish run's are.
    async fn load_and_check(&self, files: &[(String, String)]) -> Result<(Vec<trellis_core::Diagnostic>, Option<Accepted>, Timings)> {
        let started = std::time::Instant::now();
        let counts = |c: &trellis_core::load::LoadCache| (c.parsed, c.whole);
        let before = counts(&self.load_cache.lock().expect("load cache"));
        let loaded = self.load(files);
        let after = counts(&self.load_cache.lock().expect("load cache"));
        let mut t =
            Timings { parsed: after.0 - before.0, whole: after.1 - before.1, load_ms: started.elapsed().as_millis(), ..Timings::default() };
        let mut diagnostics = loaded.diagnostics;
        let mut accepted = None;
        if let Some(decl) = loaded.declaration.map(Arc::new).filter(|_| !diagnostics.iter().any(|d| d.is_error())) {
            match self.place(&decl).await? {
                Ok(p) => {
                    t.place_ms = started.elapsed().as_millis() - t.load_ms;
                    // The index of the revision held, if any and not being made, to make this one's from.
                    let before = self.declaration.try_lock().ok().and_then(|held| held.as_ref().map(|(_, indexed)| indexed.clone()));
                    let (checked, indexed) = self.check_beside(&decl, &p.allocation, before.as_deref());
                    diagnostics.extend(checked);
                    t.check_ms = started.elapsed().as_millis() - t.load_ms - t.place_ms;
                    accepted = Some((decl, p, indexed));
                }
                Err(exhausted) => diagnostics.push(exhausted),
            }
        }
        trellis_core::diag::sort(&mut diagnostics);
        Ok((diagnostics, accepted, t))
    }

    /// The check, from what the check before held when there is one (another apply running at
    /// once checks whole), off the runtime's threads; beside it the declaration indexed, as
    /// stored with the revision (it does not depend on what the check says), from the index of
    /// the revision before when given.
    fn check_beside(
        &self,
        decl: &Arc<Declaration>,
        allocation: &Arc<trellis_core::Allocation>,
        indexed_before: Option<&Indexed>,
    ) -> (Vec<trellis_core::Diagnostic>, Arc<Indexed>) {
        let held = self.check_held.lock().expect("check held").take();
        crate::publish::off_runtime(|| {
            std::thread::scope(|s| {
                let check = s.spawn(|| {
                    let before = held.as_ref().map(|(a, h)| (h, Arc::ptr_eq(a, allocation)));
                    let (checked, held) = trellis_core::explain::check_after(decl, allocation, before);
                    *self.check_held.lock().expect("check held") = Some((allocation.clone(), held));
                    checked
                });
                let indexed = Arc::new(match indexed_before {
                    Some(before) => Indexed::new_after(decl.clone(), before),
                    None => Indexed::new(decl.clone()),
                });
                (check.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)), indexed)
            })
        })
    }

    /// Keeps what an apply stored for the requests after it: the allocation, from which the next
    /// apply allocates, and the declaration indexed, which the publish run that follows uses
    /// instead of parsing the stored files again (each cache keyed by revision, so a newer one
    /// elsewhere still wins).
    async fn remember_stored(&self, revision: i64, digest: &str, allocation: Arc<trellis_core::Allocation>, indexed: &Arc<Indexed>) {
        {
            let mut cache = self.allocation.lock().await;
            if cache.as_ref().is_none_or(|(n, ..)| *n < revision) {
                *cache = Some((revision, digest.to_string(), allocation));
            }
        }
        let mut cache = self.declaration.lock().await;
        if cache.as_ref().is_none_or(|(n, _)| *n < revision) {
            *cache = Some((revision, indexed.clone()));
        }
    }
}

/// A declaration that loaded and was placed: with its placement and its index by name.
type Accepted = (Arc<Declaration>, Placed, Arc<Indexed>);

/// How long an apply's stages took, and what its load parsed, for the debug log.
#[derive(Default)]
struct Timings {
    parsed: usize,
    whole: usize,
    load_ms: u128,
    place_ms: u128,
    check_ms: u128,
}

/// The files of an apply, in path order: each `mesh.toml` or `modules/NAME.toml`, once, with a
/// `mesh.toml` among them.
fn submitted_files(submitted: &[proto::DeclFile]) -> Result<Vec<(String, String)>> {
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
    Ok(files)
}

/// The pool members a declaration names as declared nodes (their pool gone or renamed), which go
/// with its revision (a record of a pool is never taken for a declared node), and the audit
/// record's detail that says so beside the files' digest. The other members' addresses leave
/// `allocation`.
fn members_replaced(
    decl: &Declaration,
    members: &[trellis_core::decl::Member],
    allocation: &mut Arc<trellis_core::Allocation>,
    digest: &str,
) -> (Vec<String>, String) {
    let declared: std::collections::HashSet<&str> =
        if members.is_empty() { Default::default() } else { decl.nodes.iter().map(|n| n.name.as_str()).collect() };
    let (replaced, members): (Vec<_>, Vec<_>) = members.iter().partition(|m| declared.contains(m.name.as_str()));
    for m in members {
        if allocation.ipv4.contains_key(&m.name) || allocation.ipv6.contains_key(&m.name) {
            let allocation = Arc::make_mut(allocation);
            allocation.ipv4.remove(&m.name);
            allocation.ipv6.remove(&m.name);
        }
    }
    let mut detail = format!("sha256 {digest}");
    if !replaced.is_empty() {
        let named: Vec<String> = replaced.iter().map(|m| format!("{} (pool {})", m.name, m.pool)).collect();
        detail.push_str(&format!("; removed the pool members it names as declared nodes: {}", named.join(", ")));
    }
    (replaced.iter().map(|m| m.name.clone()).collect(), detail)
}

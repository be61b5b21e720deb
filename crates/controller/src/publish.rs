//! Publishing bundles: recompile, give a new version (from the database) only to nodes whose
//! files changed, sign, and hold the signed bundles in memory so that an unchanged bundle is
//! answered `304` without recompiling or re-signing. Long-polls wait on a watch channel.
//!
//! A decision does not publish in its request: it returns once it is durable in the database and
//! asks for a run. One background task publishes, one run at a time, and each run covers every
//! decision made before it started (it reads the database after counting them), so a burst of
//! decisions is a handful of runs, not one each. Nothing of record is held only in memory: a run
//! reads everything it publishes from the database.
//!
//! Every governance decision moves the audit head; a replica that sees the head move (another
//! replica decided something) publishes too, so all replicas converge on the same versions. A
//! replica also republishes the nodes whose stored version is not the one it holds: a run that
//! read the database before a decision may commit after the run covering it, so the same content
//! can come back at a higher version with no move of the head. The signed bytes for one version
//! are identical everywhere: the body is deterministic and ed25519 signatures are too.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use base64::Engine;
use trellis_core::bundle::{assemble, entries, number, Listed, Shared};
use trellis_core::decl::PublicKey;
use trellis_core::{Compiled, Text};

use crate::{Controller, Error, Result};

/// One node's current bundle, signed.
pub struct Published {
    pub version: i64,
    /// The digest of its content as signed (`trellis_core::bundle::content_digest`): with the
    /// version, what its ETag names.
    pub digest: [u8; 32],
    pub signed: Signed,
    /// For a large bundle, the edits from the version before it (that version, the delta): a
    /// node holding that one fetches these instead of the whole bundle.
    pub delta: Option<(i64, bytes::Bytes)>,
}

/// Bundles from this size on are also sent as deltas from their previous version; smaller ones
/// cost less to send whole than to diff.
pub const DELTA_FROM: usize = 128 * 1024;

/// A signed bundle as held: the head (magic, signature, manifest) and the files' contents in
/// manifest order, as the compiled output holds them. A content is made of pieces shared with
/// other files (a peer's `[Peer]` section, a rule's filter block, a module's zone records): the
/// bundles hold them once, with the compiled output, and `Body` sends them from there. None of
/// them is copied into a buffer per file or per bundle: ten thousand wireguard.conf files
/// naming the same few thousand peers would hold about 190 MiB of copies of a few MiB.
pub type Signed = trellis_core::bundle::Signed<Text>;

/// Pieces from this size on are sent from where the compiled output holds them; smaller ones
/// are gathered into the buffer of the answer that sends them.
const SHARED_PIECE: usize = 4096;

/// The most bytes of small pieces one chunk of an answer gathers.
const CHUNK: usize = 16 * 1024;

struct ArcStr(Arc<str>);

impl AsRef<[u8]> for ArcStr {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

/// A bundle's bytes in order, as the chunks of one answer: the head, then each large piece as it
/// is held (no copy) and the runs of small pieces between them gathered into buffers of at most
/// `CHUNK` bytes. What it gathers lives while the answer is sent, not while the bundle is held.
pub struct Body {
    bundle: Arc<Published>,
    head: bool,
    /// The next piece to send: a content of the bundle, a chunk of it and a piece of that.
    file: usize,
    chunk: usize,
    piece: usize,
    left: usize,
}

impl Body {
    pub fn new(bundle: Arc<Published>) -> Body {
        let left = bundle.signed.len();
        Body { bundle, head: true, file: 0, chunk: 0, piece: 0, left }
    }

    /// The bytes not sent yet.
    pub fn remaining(&self) -> usize {
        self.left
    }
}

impl Iterator for Body {
    type Item = bytes::Bytes;

    fn next(&mut self) -> Option<bytes::Bytes> {
        let signed = &self.bundle.signed;
        if std::mem::take(&mut self.head) && !signed.head.is_empty() {
            self.left -= signed.head.len();
            return Some(signed.head.clone());
        }
        let mut run = bytes::BytesMut::new();
        while let Some(content) = signed.contents.get(self.file) {
            let Some(chunk) = content.chunks().get(self.chunk) else {
                (self.file, self.chunk, self.piece) = (self.file + 1, 0, 0);
                continue;
            };
            let Some(piece) = chunk.pieces().get(self.piece) else {
                (self.chunk, self.piece) = (self.chunk + 1, 0);
                continue;
            };
            if piece.len() >= SHARED_PIECE {
                if !run.is_empty() {
                    break;
                }
                self.piece += 1;
                self.left -= piece.len();
                return Some(bytes::Bytes::from_owner(ArcStr(piece.clone())));
            }
            if run.len() + piece.len() > CHUNK {
                break;
            }
            if run.capacity() == 0 {
                run.reserve(self.left.min(CHUNK));
            }
            run.extend_from_slice(piece.as_bytes());
            self.piece += 1;
        }
        self.left -= run.len();
        (!run.is_empty()).then(|| run.freeze())
    }
}

/// Compiled file contents, each hashed once: an entry lives as long as the compiled output holds
/// its content (it keeps the content alive, so its address names it), so a file a recompile left
/// unchanged is not hashed again when its bundle is signed again.
#[derive(Default)]
struct Contents(HashMap<usize, (Text, [u8; 32])>);

impl Contents {
    /// Hashes, on every core, the contents of `compiled`'s files for these nodes that are not
    /// held yet.
    fn add(&mut self, compiled: &Compiled, nodes: &[&str]) {
        let mut new: Vec<Text> = Vec::new();
        let mut ids = HashSet::new();
        for n in nodes {
            for f in &compiled.nodes[*n].files {
                if !self.0.contains_key(&f.content.id()) && ids.insert(f.content.id()) {
                    new.push(f.content.clone());
                }
            }
        }
        let digests = trellis_core::par::map(new.len(), |i| new[i].sha256());
        for (content, digest) in new.into_iter().zip(digests) {
            self.0.insert(content.id(), (content, digest));
        }
    }

    /// The SHA-256 of a content `add` holds.
    fn digest(&self, content: &Text) -> [u8; 32] {
        self.0[&content.id()].1
    }

    /// Forgets the contents the compiled output no longer holds.
    fn keep_only(&mut self, compiled: &Compiled) {
        let live: HashSet<usize> = compiled.nodes.values().flat_map(|o| o.files.iter()).map(|f| f.content.id()).collect();
        self.0.retain(|k, _| live.contains(k));
    }
}

/// What the node endpoints need to authenticate a certificate without the database.
#[derive(Clone, Debug)]
pub struct AuthEntry {
    pub state: trellis_proto::EnrolledState,
    pub serials: Vec<String>,
    /// The pool of a member whose name the current declaration gives a declared node: the
    /// record is no node of the mesh, and its certificate is refused.
    pub replaced: Option<String>,
}

#[derive(Default)]
struct Run {
    compiled: Option<Compiled>,
    /// The active nodes' keys, kept across runs and changed in place: the compiler reads only the
    /// names changed since the last run.
    keys: trellis_core::Keys,
    /// Per node: the digest last published and the certificate it carried.
    published: HashMap<String, (String, Option<String>)>,
    audit_head: i64,
    /// Hashed file contents, kept across runs.
    contents: Contents,
    /// Nodes whose stored version is not the one held here: the next run publishes them again.
    lagging: HashSet<String>,
    /// The stored versions (`Store::bundle_versions`) last seen to match the ones held here.
    versions_seen: Option<(i64, i64)>,
    /// Who held the key of each node that left the compiled mesh in the last run.
    left: crate::revocations::Left,
    /// The declaration revision the last run compiled, and its hubs: routes and hubs change
    /// with it.
    revision: Option<i64>,
    hubs: HashSet<String>,
    /// The `trust.toml` every bundle of the last run carried: when it changes, every node is
    /// published again.
    trust: String,
}

pub(crate) struct Publisher {
    run: tokio::sync::Mutex<Run>,
    table: RwLock<HashMap<String, Arc<Published>>>,
    auth: RwLock<HashMap<String, AuthEntry>>,
    changes: tokio::sync::watch::Sender<u64>,
    mesh: RwLock<String>,
    stamp: Mutex<(i64, Arc<str>)>,
    contacts: Mutex<HashMap<String, i64>>,
    /// Decisions made here, counted; each asks for a run.
    asked: AtomicU64,
    /// The count of decisions that the newest finished run covers.
    covered: tokio::sync::watch::Sender<u64>,
    /// Wakes the background task; a wake while it runs is kept, so it runs once more.
    wake: tokio::sync::Notify,
    /// Whether a background task publishes (see `Controller::publishing`); without one,
    /// `settle` publishes in its caller.
    background: AtomicBool,
    /// Runs finished, for figures and tests.
    runs: AtomicU64,
    /// The long-polls open per node, oldest first (see `polling`).
    polling: Mutex<HashMap<String, Polls>>,
    /// The pools' members, as the last run read them: only their long-polls count as contact at
    /// each batch (nothing else is removed for want of contact, and ten thousand agents would
    /// otherwise be written every five seconds).
    members: RwLock<HashSet<String>>,
}

/// The most long-polls one node holds open at once. An agent holds one (two for a moment when it
/// moves to another replica); a node opening more has the oldest answered at once, so that one
/// certificate cannot hold thousands of requests (3,000 held 85 MB).
pub const POLLS_PER_NODE: usize = 4;

/// One node's long-polls, oldest first: each one's number and what tells it to answer now.
#[derive(Default)]
struct Polls {
    next: u64,
    open: std::collections::VecDeque<(u64, tokio::sync::oneshot::Sender<()>)>,
}

/// A long-poll in progress (see [`Publisher::polling`]).
pub struct Polling<'a> {
    publisher: &'a Publisher,
    node: String,
    id: u64,
    /// Resolves when newer long-polls of the same node pushed this one out.
    pub displaced: tokio::sync::oneshot::Receiver<()>,
}

impl Drop for Polling<'_> {
    fn drop(&mut self) {
        let mut p = self.publisher.polling.lock().expect("polling");
        if let Some(polls) = p.get_mut(&self.node) {
            polls.open.retain(|(id, _)| *id != self.id);
            if polls.open.is_empty() {
                p.remove(&self.node);
            }
        }
    }
}

impl Default for Publisher {
    fn default() -> Self {
        Publisher {
            run: Default::default(),
            table: Default::default(),
            auth: Default::default(),
            changes: tokio::sync::watch::channel(0).0,
            mesh: Default::default(),
            stamp: Mutex::new((0, Arc::from(""))),
            contacts: Default::default(),
            asked: AtomicU64::new(0),
            covered: tokio::sync::watch::channel(0).0,
            wake: tokio::sync::Notify::new(),
            background: AtomicBool::new(false),
            runs: AtomicU64::new(0),
            polling: Default::default(),
            members: Default::default(),
        }
    }
}

impl Publisher {
    pub fn current(&self, node: &str) -> Option<Arc<Published>> {
        self.table.read().expect("bundle table").get(node).cloned()
    }

    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    pub fn auth(&self, node: &str) -> Option<AuthEntry> {
        self.auth.read().expect("auth table").get(node).cloned()
    }

    /// Remembers that a node made contact; written to the database in batches.
    pub fn contact(&self, node: &str, at: i64) {
        self.contacts.lock().expect("contacts").insert(node.to_string(), at);
    }

    /// A node is long-polling: until the guard drops, every batch of contacts written counts it
    /// as in contact if it is a pool's member (a long-poll is a node waiting, not a node gone;
    /// members are removed after a time without contact). A node holds at most
    /// [`POLLS_PER_NODE`]: beyond it, the oldest is told (`Polling::displaced`) to answer now.
    pub fn polling(&self, node: &str) -> Polling<'_> {
        let (tell, displaced) = tokio::sync::oneshot::channel();
        let mut p = self.polling.lock().expect("polling");
        let polls = p.entry(node.to_string()).or_default();
        while polls.open.len() >= POLLS_PER_NODE {
            if let Some((_, oldest)) = polls.open.pop_front() {
                let _ = oldest.send(());
            }
        }
        let id = polls.next;
        polls.next += 1;
        polls.open.push_back((id, tell));
        Polling { publisher: self, node: node.to_string(), id, displaced }
    }

    /// How many publish runs have finished.
    pub fn runs(&self) -> u64 {
        self.runs.load(Ordering::SeqCst)
    }

    /// A decision changed a node's state: authentication follows at once, before the run that
    /// publishes it (a revoked node is refused on its next request, not after the next run).
    pub(crate) fn set_state(&self, node: &str, state: trellis_proto::EnrolledState) {
        if let Some(e) = self.auth.write().expect("auth table").get_mut(node) {
            e.state = state;
        }
    }

    /// The table from the records, as the mesh (declared nodes by name, members by name and pool,
    /// if a declaration is current) takes them.
    fn set_auth(&self, records: &[trellis_store::NodeRecord], mesh: Option<&HashMap<&str, Option<&str>>>) {
        let map = records
            .iter()
            .map(|r| {
                let serials = [r.cert_serial.clone(), r.prev_cert_serial.clone()].into_iter().flatten().collect();
                let replaced = r.pool.clone().filter(|_| mesh.is_some_and(|m| m.get(r.name.as_str()) == Some(&None)));
                (r.name.clone(), AuthEntry { state: r.state, serials, replaced })
            })
            .collect();
        *self.auth.write().expect("auth table") = map;
    }
}

impl Controller {
    /// Writes the contacts held in memory to the database.
    pub async fn flush_contacts(&self) {
        let now = self.now();
        let mut batch: HashMap<String, i64> = self.publisher.contacts.lock().expect("contacts").drain().collect();
        {
            let members = self.publisher.members.read().expect("members");
            for node in self.publisher.polling.lock().expect("polling").keys().filter(|n| members.contains(*n)) {
                batch.insert(node.clone(), now);
            }
        }
        let batch: Vec<(String, i64)> = batch.into_iter().collect();
        if batch.is_empty() {
            return;
        }
        if let Err(e) = self.store.touch_all(&batch).await {
            tracing::error!("cannot record the contact of {} node(s): {e}", batch.len());
        }
    }

    /// The freshness stamp (base64), signed at most once a second.
    pub(crate) fn stamp(&self) -> Arc<str> {
        let p = &self.publisher;
        let t = self.now();
        let mut s = p.stamp.lock().expect("stamp");
        if s.0 != t {
            let mesh = p.mesh.read().expect("mesh").clone();
            let bytes = trellis_core::bundle::sign_stamp(&self.signing_key(), &mesh, t);
            *s = (t, Arc::from(base64::engine::general_purpose::STANDARD.encode(bytes)));
        }
        s.1.clone()
    }

    /// Asks for a publish run after a decision, which is already durable: the background task
    /// (or the next `settle`) publishes it. Decisions asked while a run is under way share the
    /// next run.
    pub(crate) fn ask_publish(&self) {
        self.publisher.asked.fetch_add(1, Ordering::SeqCst);
        self.publisher.wake.notify_one();
    }

    /// Publishes in the background, one run at a time, whenever decisions ask for it; a failed
    /// run is retried a second later. Runs until the task is aborted.
    pub async fn publishing(self: Arc<Self>) {
        self.publisher.background.store(true, Ordering::SeqCst);
        struct Stopped<'a>(&'a AtomicBool);
        impl Drop for Stopped<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        let _stopped = Stopped(&self.publisher.background);
        loop {
            if self.publisher.asked.load(Ordering::SeqCst) <= *self.publisher.covered.borrow() {
                self.publisher.wake.notified().await;
            }
            if let Err(e) = self.publish().await {
                tracing::error!("publishing failed ({e}); will retry in a second");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }

    /// Returns once every decision made here before the call is published: waits for the
    /// background task, or publishes in the caller when there is none. Gives up after `within`
    /// (the decisions stand; publishing is behind).
    pub async fn settle(&self, within: Duration) -> Result<()> {
        let p = &self.publisher;
        let target = p.asked.load(Ordering::SeqCst);
        if *p.covered.borrow() >= target {
            return Ok(());
        }
        if !p.background.load(Ordering::SeqCst) {
            self.publish().await?;
            return Ok(());
        }
        let mut covered = p.covered.subscribe();
        let caught_up = tokio::time::timeout(within, covered.wait_for(|c| *c >= target)).await.is_ok();
        if caught_up {
            Ok(())
        } else {
            Err(Error::PublishingBehind(within.as_secs()))
        }
    }

    /// Publishes if another replica decided something since the last run, or if a stored
    /// version is not the one held here (another replica published that node again).
    pub async fn publish_if_moved(&self) -> Result<()> {
        let head = self.store.audit_head().await?;
        let versions = self.store.bundle_versions().await?;
        let mut run = self.publisher.run.lock().await;
        let moved = head != run.audit_head;
        // Compared while no run is under way (this holds the run's lock): the table then holds
        // every version this replica published itself.
        if run.versions_seen != Some(versions) {
            let stored = self.store.bundles().await?;
            let table = self.publisher.table.read().expect("bundle table");
            run.lagging =
                stored.into_iter().filter(|(n, v)| table.get(n).is_some_and(|p| p.version != v.version)).map(|(n, _)| n).collect();
            if run.lagging.is_empty() {
                run.versions_seen = Some(versions);
            }
        }
        let lagging = !run.lagging.is_empty();
        drop(run);
        if moved || lagging {
            self.publish().await?;
        }
        Ok(())
    }

    /// Recompiles and publishes every node whose files changed, then signs the audit head (every
    /// decision and every move of the head by another replica comes through here). Runs one at
    /// a time.
    pub async fn publish(&self) -> Result<usize> {
        let started = std::time::Instant::now();
        let run = async {
            let (published, head) = self.publish_bundles().await?;
            if let Some((seq, hash)) = &head {
                self.write_checkpoint(*seq, hash).await?;
            }
            Ok((published, head.map(|(seq, _)| seq)))
        };
        let result = run.await;
        let took = started.elapsed();
        self.metrics.publish_run(took, result.as_ref().map(|(n, _)| *n).map_err(|_| ()));
        if let Ok((bundles, audit_seq)) = &result {
            tracing::debug!(bundles, audit_seq, ms = took.as_millis() as u64, "publish run");
            // A run can complete a revocation (a holder left the mesh); evidence completes the
            // others.
            if let Err(e) = self.settle_revocations().await {
                tracing::error!("following revocations failed: {e}");
            }
        }
        result.map(|(n, _)| n)
    }

    /// Publishes; returns how many bundles changed and the audit head it published at.
    async fn publish_bundles(&self) -> Result<(usize, Option<(i64, String)>)> {
        let p = &self.publisher;
        let mut run = p.run.lock().await;
        // Every decision counted here is durable already, so the reads below see it.
        let upto = p.asked.load(Ordering::SeqCst);
        let done = |run: &mut Run, head: i64| {
            run.audit_head = head;
            p.runs.fetch_add(1, Ordering::SeqCst);
            p.covered.send_if_modified(|c| std::mem::replace(c, (*c).max(upto)) < upto);
            p.changes.send_modify(|g| *g += 1);
        };
        let head_record = self.store.audit_head_hash().await?;
        let head = head_record.as_ref().map_or(0, |(seq, _)| *seq);
        // Read before the nodes: a revocation listed here is one the nodes read below show.
        let unrecorded = self.store.revocations_unrecorded().await?;
        let records = self.store.nodes().await?;
        *p.members.write().expect("members") = records.iter().filter(|r| r.pool.is_some()).map(|r| r.name.clone()).collect();
        let Some((revision, decl)) = self.current_declaration().await? else {
            p.set_auth(&records, None);
            // Without a declaration nothing was published: nobody held a key.
            for node in &unrecorded {
                self.store.record_holders(node, &[]).await?;
            }
            done(&mut run, head);
            return Ok((0, head_record));
        };
        // Pools' members are nodes of the mesh too (ADR 0019).
        let decl = self.with_members(revision, decl, &records);
        *p.mesh.write().expect("mesh") = decl.mesh.name.clone();
        self.scope_services_ca(&decl.mesh).await?;
        // The mesh's nodes by name, with the pool of each member: a record is taken for the node
        // of its name only if it is of the same kind (a member of a pool that is gone is never
        // taken for a declared node of its name). A map, not `Declaration::node` (a linear
        // search: 50 million comparisons a run at 10k).
        let declared: HashMap<&str, Option<&str>> = decl.nodes.iter().map(|n| (n.name.as_str(), n.pool.as_deref())).collect();
        p.set_auth(&records, Some(&declared));
        let active: Vec<&trellis_store::NodeRecord> = records
            .iter()
            .filter(|r| r.state == trellis_proto::EnrolledState::Active && declared.get(r.name.as_str()) == Some(&r.pool.as_deref()))
            .collect();
        // Who held the keys leaving the compiled mesh, while the previous compile still says.
        let left_now = {
            let now_active: HashSet<&str> = active.iter().map(|r| r.name.as_str()).collect();
            let leaving: HashSet<&str> = run.keys.iter().map(|(n, _)| n).filter(|n| !now_active.contains(n)).collect();
            match &run.compiled {
                Some(previous) if !leaving.is_empty() => crate::revocations::holders_in(previous, &leaving),
                _ => Default::default(),
            }
        };
        run.keys.replace(active.iter().filter_map(|r| r.wg_public_key.as_deref().and_then(PublicKey::parse).map(|k| (r.name.as_str(), k))));
        // A recompile keeps addresses from its previous output (the same allocation the apply
        // stored); only a first compile reads them from the database.
        let allocation = if run.compiled.is_some() { Default::default() } else { self.store.allocation().await? };
        let previous = run.compiled.take();
        // What each node sent through routers and hubs, when a new declaration may have taken
        // some of it away (ADR 0022): read before the compile consumes the previous one.
        let hubs: HashSet<String> = decl.nodes.iter().filter(|n| n.hub).map(|n| n.name.clone()).collect();
        let carried_before = match (&previous, run.revision) {
            (Some(before), Some(r)) if r != revision => {
                let demoted: HashSet<&str> = run.hubs.iter().filter(|h| !hubs.contains(*h)).map(String::as_str).collect();
                Some(crate::revocations::carried(before, &demoted))
            }
            _ => None,
        };
        let compiled = trellis_core::compile(&decl, &run.keys, &allocation, previous).map_err(|d| Error::internal("compiling", d))?;
        let rendered: HashSet<&str> = compiled.rendered.iter().map(String::as_str).collect();
        // The controller list, the next signing key and the mesh CA (ADR 0027, 0028, 0029), the
        // same in every bundle; read before the CAs, which a completed rotation changes.
        let trust = self.run_trust().await?;
        let shared = Shared::new(&self.trusted_ca_pem(), &trust.text);
        let trust_moved = run.trust != trust.text;
        let mut contents = std::mem::take(&mut run.contents);
        let mut pending = bundle_files(p, &run, &active, &compiled, &rendered, trust_moved, &mut contents, &shared);
        drop(rendered);
        let changes: Vec<(String, String)> = pending.iter().map(|(r, _, d)| (r.name.clone(), d.clone())).collect();
        let versions: HashMap<String, trellis_store::BundleVersion> = self.store.publish(&changes, self.now()).await?.into_iter().collect();
        self.raise_high_water(versions.values().map(|v| v.version).max().unwrap_or(0))?;
        // Another replica may have published other content for a node: ours is stale; the next
        // run (its audit head moved) will catch up.
        let stale: HashSet<String> =
            pending.iter().filter(|(r, _, digest)| versions[&r.name].digest != *digest).map(|(r, _, _)| r.name.clone()).collect();
        pending.retain(|(r, _, digest)| versions[&r.name].digest == *digest);
        let (count, published) = sign_and_swap(p, &mut run, pending, &versions, &trust.key, &decl.mesh.name, &active);
        let mut known = std::mem::take(&mut run.left);
        known.extend(left_now.iter().map(|(k, v)| (k.clone(), v.clone())));
        self.follow_revocations(&unrecorded, &known, &compiled, (&decl, &run.keys, &records), &stale).await?;
        if let Some(before) = carried_before {
            for (through, holders) in crate::revocations::withdrawn(&before, &compiled) {
                // Each holder's plan changed, so this run published it: that version, or the one
                // another replica stored for it.
                let list: Vec<(String, Option<i64>)> =
                    holders.into_iter().map(|h| (h.clone(), versions.get(&h).map(|v| v.version))).collect();
                tracing::info!(node = %through, holders = list.len(), "withdrawing routes: holders recorded");
                self.store.open_withdrawal(&through, self.now(), &list).await?;
            }
        }
        run.revision = Some(revision);
        run.hubs = hubs;
        if let Some(next) = &trust.announcing {
            self.follow_rotation(next, &published).await?;
        }
        if let Some(next) = &trust.announcing_ca {
            self.follow_rotation(next, &published).await?;
        }
        run.trust = trust.text;
        run.left = left_now;
        contents.keep_only(&compiled);
        run.contents = contents;
        run.lagging.clear();
        run.compiled = Some(compiled);
        done(&mut run, head);
        Ok((count, head_record))
    }
}

/// A bundle to publish: its node, its files and the digest of their entries.
type Pending<'r> = (&'r trellis_store::NodeRecord, Vec<Listed>, String);

/// The bundles of the nodes due this run (their plan was rendered again, their certificate or
/// the trust moved, or the table lacks them), each as its files in a bundle's order, with the
/// files the controller adds, and the digest of their entries.
#[allow(clippy::too_many_arguments)]
fn bundle_files<'r>(
    p: &Publisher,
    run: &Run,
    active: &[&'r trellis_store::NodeRecord],
    compiled: &'r Compiled,
    rendered: &HashSet<&str>,
    trust_moved: bool,
    contents: &mut Contents,
    shared: &Shared,
) -> Vec<Pending<'r>> {
    let mut due: Vec<&trellis_store::NodeRecord> = Vec::new();
    for r in active {
        if !compiled.nodes.contains_key(&r.name) {
            continue;
        }
        let previous = run.published.get(&r.name);
        let unchanged = !trust_moved
            && previous.is_some_and(|(_, cert)| *cert == r.cert_pem)
            && !rendered.contains(r.name.as_str())
            && !run.lagging.contains(&r.name)
            && p.current(&r.name).is_some();
        if !unchanged {
            due.push(r);
        }
    }
    contents.add(compiled, &due.iter().map(|r| r.name.as_str()).collect::<Vec<_>>());
    let mut pending: Vec<Pending> = Vec::with_capacity(due.len());
    for r in due {
        let files = assemble(&compiled.nodes[&r.name].files, |c| contents.digest(c), shared, r.cert_pem.as_deref());
        let digest = hex::encode(trellis_core::bundle::entries_digest(&entries(&files)));
        pending.push((r, files, digest));
    }
    pending
}

/// Sets each zone's serial to its bundle's version, signs every pending bundle (on every core),
/// makes the deltas of large ones, and swaps them into the table the long-polls read; returns
/// how many were published and each node's version.
fn sign_and_swap(
    p: &Publisher,
    run: &mut Run,
    mut pending: Vec<Pending>,
    versions: &HashMap<String, trellis_store::BundleVersion>,
    key: &ed25519_dalek::SigningKey,
    mesh: &str,
    active: &[&trellis_store::NodeRecord],
) -> (usize, Vec<(String, i64)>) {
    // The digest above, which decides whether the content changed, is of the zone as compiled.
    for (r, files, _) in &mut pending {
        number(files, versions[&r.name].version as u64);
    }
    // Signed on every core: ten thousand signatures are a few hundred milliseconds on one.
    let heads = trellis_core::par::map(pending.len(), |i| {
        let (r, files, _) = &pending[i];
        let v = &versions[&r.name];
        let entries = entries(files);
        (
            trellis_core::bundle::sign_entries(key, mesh, &r.name, v.version as u64, v.issued_at, &entries),
            trellis_core::bundle::entries_digest(&entries),
        )
    });
    let signed = pending
        .iter()
        .zip(heads)
        .map(|((_, files, _), (head, digest))| (Signed { head, contents: files.iter().map(|f| f.content.clone()).collect() }, digest));
    let signed: Vec<(Signed, [u8; 32])> = signed.collect();
    let mut count = 0;
    let mut large = Vec::new();
    let mut published = Vec::new();
    for ((record, _, digest), (signed, content)) in pending.into_iter().zip(signed) {
        let node = record.name.clone();
        let v = &versions[&node];
        published.push((node.clone(), v.version));
        run.published.insert(node.clone(), (digest, record.cert_pem.clone()));
        // A large bundle's previous version, to make a delta from.
        let previous = (signed.len() >= DELTA_FROM).then(|| p.current(&node)).flatten().filter(|old| old.version < v.version);
        large.push((node, v.version, content, signed, previous));
        count += 1;
    }
    // Deltas, on every core: a bundle of a few megabytes takes some milliseconds.
    let heavy: Vec<usize> = (0..large.len()).filter(|&i| large[i].4.is_some()).collect();
    let made = trellis_core::par::map_each(heavy.len(), |k| {
        let (_, _, _, new, old) = &large[heavy[k]];
        let old = old.as_ref().expect("only bundles with a previous version");
        (old.version, bytes::Bytes::from(trellis_core::delta::make(&old.signed.to_vec(), &new.to_vec())))
    });
    let mut made: HashMap<usize, (i64, bytes::Bytes)> = heavy.into_iter().zip(made).collect();
    let table: HashMap<String, Arc<Published>> = large
        .into_iter()
        .enumerate()
        .map(|(i, (node, version, digest, signed, _))| (node, Arc::new(Published { version, digest, signed, delta: made.remove(&i) })))
        .collect();
    {
        let mut t = p.table.write().expect("bundle table");
        t.extend(table);
        let live: HashSet<&str> = active.iter().map(|r| r.name.as_str()).collect();
        t.retain(|n, _| live.contains(n.as_str()));
        run.published.retain(|n, _| live.contains(n.as_str()));
    }
    (count, published)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(c: char, n: usize) -> Arc<str> {
        Arc::from(c.to_string().repeat(n).as_str())
    }

    #[test]
    fn an_answer_sends_the_bundle_as_held_large_pieces_without_a_copy() {
        let large = piece('L', SHARED_PIECE);
        let small: Vec<Arc<str>> = (0..40).map(|i| piece(char::from(b'a' + i % 26), 700)).collect();
        let mut first = small[..30].to_vec();
        first.push(large.clone());
        first.extend_from_slice(&small[30..]);
        let contents = vec![Text::from_pieces(first), Text::from(""), Text::from_pieces(vec![piece('z', 3), large.clone()])];
        let head = bytes::Bytes::from_static(b"TRB1 head");
        let bundle = Arc::new(Published { version: 7, digest: [0; 32], signed: Signed { head: head.clone(), contents }, delta: None });
        let mut body = Body::new(bundle.clone());
        assert_eq!(body.remaining(), bundle.signed.len());
        let mut chunks = Vec::new();
        let mut left = Vec::new();
        while let Some(c) = body.next() {
            chunks.push(c);
            left.push(body.remaining());
        }
        assert_eq!(chunks.concat(), bundle.signed.to_vec());
        assert_eq!(body.remaining(), 0);
        assert_eq!(left.last(), Some(&0));
        assert_eq!(chunks[0], head);
        // 30 small pieces (21,000 bytes) come as one full chunk and one short one, then the large
        // piece itself, then the last 10 and the next file's small piece, then the large one.
        let sizes: Vec<usize> = chunks.iter().map(bytes::Bytes::len).collect();
        assert_eq!(sizes, [head.len(), 16_100, 4_900, SHARED_PIECE, 7_003, SHARED_PIECE]);
        for i in [3, 5] {
            assert_eq!(chunks[i].as_ptr(), large.as_ptr(), "a large piece is sent from where it is held");
        }
    }
}

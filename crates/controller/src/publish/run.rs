//! The IO shell of a publish run, a short sequence: read what the plan needs from the database
//! and the trust in force, plan (`plan`, pure), store the versions, seal (number, sign, make
//! deltas), swap into the table the long-polls read, follow what was published (revocations,
//! withdrawals, rotations).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use trellis_core::bundle::{entries, number, Shared};
use trellis_core::Declaration;
use trellis_store::{BundleVersion, NodeRecord};

use super::body::{Published, Signed, EDITS_FROM};
use super::plan::{assembled, plan, Due, Inputs, Run, RunPlan};
use super::tables::Publisher;
use crate::trust::RunTrust;
use crate::{Controller, Result};

/// What a run reads from the database before it plans.
struct Read {
    /// The audit head it publishes at.
    head: Option<(i64, String)>,
    /// Revocations and removals whose holders no run recorded yet.
    unrecorded: Vec<String>,
    records: Vec<NodeRecord>,
    /// Where the records' read stood (`Store::node_changes`).
    records_read: trellis_store::RecordsRead,
    /// The current declaration with its pools' members, and its revision.
    declaration: Option<(i64, Arc<Declaration>)>,
    /// Every node's last path report (ADR 0032).
    path_reports: Vec<(String, String, i64)>,
    /// No record was written or deleted since the run before read them.
    unchanged: bool,
}

/// How many due bundles of the rest a run stores, signs and swaps in at a time (ADR 0042): no
/// more than the store reads back by name (with 4,096, each slice read all 100,000 stored
/// versions back, and the run after a storm stored for 7.9 s instead of 2).
pub(super) const REST_SLICE: usize = trellis_store::BUNDLES_BY_NAME;

/// How long a run spends on the rest before it puts off what is left, when decisions wait
/// (ADR 0042): at 100,000 nodes, about 20,000 bundles.
pub(super) const REST_BUDGET: std::time::Duration = std::time::Duration::from_secs(1);

/// A bundle signed this run: its record, the digest of its entries and the bundle as held.
type Sealed<'r> = (&'r NodeRecord, String, Published);

impl Controller {
    /// Publishes: read → plan → carry out in stages (assemble → store → seal → swap) → follow.
    /// Returns how many bundles changed and the audit head it published at.
    pub(super) async fn publish_bundles(&self) -> Result<(usize, Option<(i64, String)>)> {
        let p = &self.publisher;
        let mut run = p.run.lock().await;
        // Every decision counted here is durable already, so the reads below see it.
        let upto = p.asked.load(Ordering::SeqCst);
        let started = std::time::Instant::now();
        // Taken out while the run reads: a run that fails reads every record again.
        let kept = run.records.take();
        let read = self.read_run(kept).await?;
        let read_ms = started.elapsed().as_millis() as u64;
        let head = read.head.as_ref().map_or(0, |(seq, _)| *seq);
        let Some((revision, decl)) = &read.declaration else {
            return self.publish_nothing(&mut run, read, upto).await;
        };
        // The mesh's nodes by name, with the pool of each member: a record is taken for the node
        // of its name only if it is of the same kind (a member of a pool that is gone is never
        // taken for a declared node of its name). A map, not `Declaration::node` (a linear
        // search: 50 million comparisons a run at 10k).
        let at = std::time::Instant::now();
        let declared: HashMap<&str, Option<&str>> = decl.nodes.iter().map(|n| (n.name.as_str(), n.pool.as_deref())).collect();
        refresh_auth(p, &mut run, &read, decl, &declared);
        let auth_ms = at.elapsed().as_millis() as u64;
        let at = std::time::Instant::now();
        // The controller list, the next signing key and the mesh CA (ADR 0027, 0028, 0029), the
        // same in every bundle; read before the CAs, which a completed rotation changes.
        let trust = self.run_trust().await?;
        let shared = Shared::new(&self.trusted_ca_pem(), &trust.text);
        // A recompile keeps addresses from its previous output (the same allocation the apply
        // stored); only a first compile reads them from the database.
        let allocation = if run.compiled.is_some() { Default::default() } else { self.store.allocation().await? };
        let held = |node: &str| p.current(node).is_some();
        // The certificates bundles carry: read only for the nodes whose serial moved since.
        // Records unchanged are those the last finished run kept, and it held their certificates:
        // a run with a declaration read them; one without has none to read (no token is made
        // before a declaration, and revisions are never deleted).
        let certs = self.certificates(&read.records, std::mem::take(&mut run.certs), read.unchanged).await?;
        let cert = |node: &str| certs.get(node).and_then(|(_, pem)| pem.as_deref());
        let hubs: HashSet<&str> = decl.nodes.iter().filter(|n| n.hub).map(|n| n.name.as_str()).collect();
        let failed = p.failed_pairs.lock().expect("failed pairs").clone();
        let paths = crate::paths::inputs(&read.path_reports, &read.records, &hubs, &failed, self.now());
        let inputs_ms = at.elapsed().as_millis() as u64;
        let inputs = Inputs {
            records: &read.records,
            records_unchanged: read.unchanged,
            decl,
            revision: *revision,
            declared: &declared,
            unrecorded: &read.unrecorded,
            allocation,
            trust: &trust.text,
            held: &held,
            held_count: p.held_count(),
            paths: &paths,
        };
        let at = std::time::Instant::now();
        // The plan and the seal are seconds of CPU at 100,000 nodes: off the runtime's threads,
        // so that the long-polls, enrolments and connections go on being answered meanwhile
        // (at 100,000 nodes with 19,400 agents, connections timed out while a run planned).
        p.release_plans();
        let plan = off_runtime(|| plan(inputs, &mut run));
        let mut plan = match plan {
            Ok(plan) => plan,
            Err(e) => {
                run.certs = certs;
                return Err(e);
            }
        };
        let plan_ms = at.elapsed().as_millis() as u64;
        let due = std::mem::take(&mut plan.due);
        let follows =
            !plan.revocations.is_empty() || !plan.withdrawals.is_empty() || trust.announcing.is_some() || trust.announcing_ca.is_some();
        let staging =
            Staging { c: self, plan: &plan, shared: &shared, cert: &cert, trust: &trust, mesh: &decl.mesh.name, started, upto, follows };
        // Kept whether or not the stages fail.
        let carried = staging.carry_out(&mut run, due).await;
        run.certs = certs;
        let mut carried = carried?;
        run.deferred = std::mem::take(&mut carried.put_off);
        run.versions_seen = self.versions_now_seen(&carried).await;
        let t = &carried.times;
        // Where a run's time goes, for whoever profiles delivery (`bench delivery` at scale).
        tracing::debug!(
            bundles = carried.published.len(),
            firsts = t.firsts,
            read_ms,
            auth_ms,
            inputs_ms,
            plan_ms,
            assemble_ms = t.assemble_ms,
            store_ms = t.store_ms,
            seal_ms = t.seal_ms,
            first_swapped_ms = t.first_swapped_ms,
            put_off = run.deferred.len(),
            swapped_ms = started.elapsed().as_millis() as u64,
            "publish run"
        );
        self.follow_and_keep(&mut run, plan, &carried, &trust).await?;
        run.revision = Some(*revision);
        run.trust = trust.text;
        run.records = Some((read.records_read, read.records));
        // A run that put bundles off has not covered the decisions it read: whoever waits for
        // them (`settle`, an apply) waits for the run that publishes what was put off, and the
        // background task runs again at once (a decision is waiting).
        let covered = if run.deferred.is_empty() { upto } else { 0 };
        p.finish(&mut run, head, covered);
        Ok((carried.published.len(), read.head))
    }

    /// The stored versions' count and sum the stages left the store with, read once every stage
    /// has stored (`Carried::seen`): known when the store holds that, and nothing another
    /// replica stored meanwhile. Not read when nothing was stored. A hint only
    /// (`publish_if_moved` reads every version when it is unknown): a failed read does not fail
    /// a run whose bundles are in the table.
    async fn versions_now_seen(&self, carried: &Carried) -> Option<(i64, i64)> {
        match carried.seen {
            Some(expected) if carried.versions.is_empty() => Some(expected),
            Some(expected) => self.store.bundle_versions().await.ok().filter(|now| *now == expected),
            None => None,
        }
    }

    /// Follows what the run published (`follow`), then keeps what the next run compares with
    /// and the pairs and plans status reads.
    async fn follow_and_keep(&self, run: &mut Run, plan: RunPlan<'_>, carried: &Carried, trust: &RunTrust) -> Result<()> {
        let at = std::time::Instant::now();
        self.follow(&plan, &carried.versions, &carried.stale, trust, &carried.published).await?;
        let follow_ms = at.elapsed().as_millis() as u64;
        let at = std::time::Instant::now();
        let relayed = run.keep(plan);
        let plans = run.compiled.as_ref().map(|c| c.nodes.values().map(|o| o.plan.clone()).collect()).unwrap_or_default();
        *self.publisher.pairs.write().expect("pairs") = Arc::new(super::tables::Pairs { relayed, plans: Some(plans) });
        tracing::debug!(follow_ms, kept_ms = at.elapsed().as_millis() as u64, "publish run followed");
        Ok(())
    }

    /// A run without a declaration: nothing is published and nobody held a key; the records
    /// are kept without a plan (the next plan finds its active nodes again).
    async fn publish_nothing(&self, run: &mut Run, read: Read, upto: u64) -> Result<(usize, Option<(i64, String)>)> {
        let p = &self.publisher;
        p.set_auth(&read.records, None);
        run.auth_for = None;
        run.planned_for = None;
        for node in &read.unrecorded {
            self.store.record_holders(node, &[]).await?;
        }
        run.records = Some((read.records_read, read.records));
        p.finish(run, read.head.as_ref().map_or(0, |(seq, _)| *seq), upto);
        Ok((0, read.head))
    }

    /// The run's reads: the audit head, the revocations not recorded, every node's record and
    /// the current declaration with its members. Also what only these reads tell: the pools'
    /// members (whose long-polls count as contact), the mesh's name, the services CA's scope.
    async fn read_run(&self, kept: Option<(trellis_store::RecordsRead, Vec<NodeRecord>)>) -> Result<Read> {
        let p = &self.publisher;
        let head = self.store.audit_head_hash().await?;
        // Read before the nodes: a revocation listed here is one the nodes read below show.
        let unrecorded = self.store.revocations_unrecorded().await?;
        // Every record, kept from the run before and brought up to date with those written since
        // (ADR 0036): at 100,000 nodes, reading every record took a run 0.5 to 2 s.
        let at = std::time::Instant::now();
        let (since, kept) = kept.map_or((None, Vec::new()), |(read, records)| (Some(read), records));
        let changes = self.store.node_changes(since.as_ref()).await?;
        let (records_read, changed) = (changes.read.clone(), changes.records.len());
        let unchanged = since.is_some() && !changes.whole && changes.records.is_empty() && changes.gone.is_empty();
        let records = changes.onto(kept);
        let records_ms = at.elapsed().as_millis() as u64;
        *p.members.write().expect("members") = records.iter().filter(|r| r.pool.is_some()).map(|r| r.name.clone()).collect();
        let declaration = match self.current_declaration().await? {
            Some((revision, decl)) => {
                // Pools' members are nodes of the mesh too (ADR 0019).
                let decl = self.with_members(revision, decl, &records);
                *p.mesh.write().expect("mesh") = decl.mesh.name.clone();
                self.scope_services_ca(&decl.mesh).await?;
                Some((revision, decl))
            }
            None => None,
        };
        let at = std::time::Instant::now();
        let path_reports = self.store.path_reports().await?;
        tracing::debug!(records_ms, changed, reports_ms = at.elapsed().as_millis() as u64, "publish read");
        Ok(Read { head, unrecorded, records, records_read, declaration, path_reports, unchanged })
    }

    /// Every record's certificate with its serial, by name: those in `held` whose serial is the
    /// record's, and the rest read from the store (at 100,000 nodes, reading every certificate
    /// each run was 69 MB). A record read after a renewal may name the serial before; the
    /// certificate read is then the newer one, and the next run, seeing the serial move, checks
    /// the bundle again. `kept`: `held` are the certificates of these records already (the
    /// records the last run finished with, none written since): nothing is looked up.
    async fn certificates(
        &self,
        records: &[NodeRecord],
        mut held: HashMap<String, trellis_store::SerialAndCert>,
        kept: bool,
    ) -> Result<HashMap<String, trellis_store::SerialAndCert>> {
        if kept {
            return Ok(held);
        }
        let with: Vec<&NodeRecord> = records.iter().filter(|r| r.cert_serial.is_some()).collect();
        let missing: Vec<&str> =
            with.iter().filter(|r| held.get(&r.name).map(|(s, _)| s) != r.cert_serial.as_ref()).map(|r| r.name.as_str()).collect();
        if !missing.is_empty() {
            // Those not read back (revoked or removed meanwhile) keep no certificate from before.
            for name in &missing {
                held.remove(*name);
            }
            held.extend(self.store.cert_pems(&missing).await?);
        }
        if held.len() > with.len() {
            let names: HashSet<&str> = with.iter().map(|r| r.name.as_str()).collect();
            held.retain(|n, _| names.contains(n.as_str()));
        }
        Ok(held)
    }

    /// Stores a version for each due bundle (a new one where its content changed) and returns
    /// the versions in force, the nodes for which another replica stored other content (ours is
    /// stale; the next run, its audit head moved, catches up) and the bundles left to publish.
    async fn store_versions<'r>(&self, mut due: Vec<Due<'r>>) -> Result<(HashMap<String, BundleVersion>, HashSet<String>, Vec<Due<'r>>)> {
        let changes: Vec<(String, String)> = due.iter().map(|d| (d.record.name.clone(), d.digest.clone())).collect();
        let versions: HashMap<String, BundleVersion> = self.store.publish(&changes, self.now()).await?.into_iter().collect();
        self.raise_high_water(versions.values().map(|v| v.version).max().unwrap_or(0))?;
        let stale: HashSet<String> =
            due.iter().filter(|d| versions[&d.record.name].digest != d.digest).map(|d| d.record.name.clone()).collect();
        due.retain(|d| versions[&d.record.name].digest == d.digest);
        Ok((versions, stale, due))
    }

    /// The stored versions' count and sum once a stage of this run stored `versions` (none of
    /// them another replica's content), when they were `seen` (matching the table) before it:
    /// read from the table before the stage's swap (it still holds the versions before). The
    /// run compares the result with the store once every stage has stored: equal, no other
    /// replica published meanwhile, and the table, once swapped to these versions, matches
    /// again. Else `None`, and the next `publish_if_moved` reads every stored version again, as
    /// it did after every run before (100,000 rows, about a second at 100,000 nodes, under the
    /// run's lock: a publish that came then waited for it).
    fn seen_after(&self, seen: Option<(i64, i64)>, versions: &HashMap<String, BundleVersion>) -> Option<(i64, i64)> {
        let (mut count, mut sum) = seen?;
        let table = self.publisher.table.read().expect("bundle table");
        for (node, v) in versions {
            match table.get(node) {
                Some(held) => sum += v.version - held.version,
                None => {
                    count += 1;
                    sum += v.version;
                }
            }
        }
        Some((count, sum))
    }

    /// What follows a run: the holders of revocations and their versions without the key, the
    /// holders of withdrawn routes, the versions that announced a rotation.
    async fn follow(
        &self,
        plan: &RunPlan<'_>,
        versions: &HashMap<String, BundleVersion>,
        stale: &HashSet<String>,
        trust: &RunTrust,
        published: &[(String, i64)],
    ) -> Result<()> {
        self.follow_revocations(&plan.revocations, &plan.compiled, stale).await?;
        for (through, holders) in &plan.withdrawals {
            // Each holder's plan changed, so this run published it: that version, or the one
            // another replica stored for it.
            let list: Vec<(String, Option<i64>)> = holders.iter().map(|h| (h.clone(), versions.get(h).map(|v| v.version))).collect();
            tracing::info!(node = %through, holders = list.len(), "withdrawing routes: holders recorded");
            self.store.open_withdrawal(through, self.now(), &list).await?;
        }
        for next in trust.announcing.iter().chain(&trust.announcing_ca) {
            self.follow_rotation(next, published).await?;
        }
        Ok(())
    }
}

/// The table that node requests are authenticated by follows the records and the declaration
/// (with its members, the same `Arc` while they stay): made again only when either moved (at
/// 100,000 nodes, 150-200 ms of every run, those that publish nothing too).
fn refresh_auth(p: &Publisher, run: &mut Run, read: &Read, decl: &Arc<Declaration>, declared: &HashMap<&str, Option<&str>>) {
    match (read.unchanged, run.auth_for.as_ref()) {
        (true, Some(d)) if Arc::ptr_eq(d, decl) => return,
        // The same records under another declaration: only members' entries follow it.
        (true, Some(_)) => p.set_auth_replaced(&read.records, declared),
        _ => p.set_auth(&read.records, Some(declared)),
    }
    run.auth_for = Some(decl.clone());
}

/// What every stage of a run shares: the plan, the files every bundle carries and how long the
/// run has been going.
struct Staging<'s, 'r> {
    c: &'s Controller,
    plan: &'s RunPlan<'r>,
    shared: &'s Shared,
    cert: &'s (dyn Fn(&str) -> Option<&'s str> + Sync),
    trust: &'s RunTrust,
    mesh: &'s str,
    started: std::time::Instant,
    /// The decisions the run read: one counted after it is waiting.
    upto: u64,
    /// The run has something to follow that the holders' answers could run ahead of (a
    /// revocation, a withdrawal of routes, a rotation announced): the long-polls are told at
    /// its end only, and nothing is put off.
    follows: bool,
}

/// What the stages of a run carried out.
struct Carried {
    versions: HashMap<String, BundleVersion>,
    /// The nodes for which another replica stored other content.
    stale: HashSet<String>,
    /// Each node swapped in, with its version.
    published: Vec<(String, i64)>,
    /// The stored versions' count and sum the store should hold now (`Controller::seen_after`).
    seen: Option<(i64, i64)>,
    /// The nodes whose bundles were put off to the next run.
    put_off: Vec<String>,
    times: StageTimes,
}

/// Where the stages' time went.
#[derive(Default)]
struct StageTimes {
    firsts: usize,
    assemble_ms: u64,
    store_ms: u64,
    seal_ms: u64,
    first_swapped_ms: Option<u64>,
}

impl Staging<'_, '_> {
    /// Carries out the due bundles in stages (ADR 0042): first the nodes that hold no bundle
    /// (enrolled since the run before), then the rest in slices, each assembled, stored, sealed
    /// and swapped in. In an enrolment storm nearly every node is due in every run (each gains
    /// peers): a node that enrolled waited for the store and the signatures of some 100,000
    /// bundles before its first (at 100,000 nodes, 3-4 s of a run of 4-9 s), and then for as
    /// long again while the run it had missed finished them. Once the rest has taken its budget
    /// while decisions wait, and nothing is to follow, the slices left are put off to the next
    /// run, which publishes them before its own rest: every node is still published within a
    /// few runs. Then the nodes no longer active are dropped from the table.
    async fn carry_out(&self, run: &mut Run, due: Vec<&NodeRecord>) -> Result<Carried> {
        let p = &self.c.publisher;
        let (first, mut rest): (Vec<_>, Vec<_>) = due.into_iter().partition(|r| p.current(&r.name).is_none());
        // What the run before put off goes first.
        if !run.deferred.is_empty() {
            let before: trellis_core::FastSet<&str> = run.deferred.iter().map(String::as_str).collect();
            rest.sort_by_key(|r| !before.contains(r.name.as_str()));
        }
        let mut carried = Carried {
            versions: HashMap::new(),
            stale: HashSet::new(),
            published: Vec::new(),
            // The stored versions this replica had seen match its table (`publish_if_moved`),
            // moved on by what this run stores; unknown when the run fails on the way.
            seen: run.versions_seen.take(),
            put_off: Vec::new(),
            times: StageTimes { firsts: first.len(), ..Default::default() },
        };
        run.stale = false;
        if !first.is_empty() {
            self.stage(run, first, &mut carried).await?;
            carried.times.first_swapped_ms = Some(self.started.elapsed().as_millis() as u64);
            let hold = p.hold.lock().expect("hold").take();
            if let Some((there, go)) = hold {
                let _ = there.send(());
                let _ = go.await;
            }
        }
        let (slice, budget) = *p.rest.lock().expect("rest");
        let slice = slice.max(1);
        let rest_started = std::time::Instant::now();
        for (i, due) in rest.chunks(slice).enumerate() {
            let waiting = p.asked.load(Ordering::SeqCst) > self.upto;
            if i > 0 && waiting && !self.follows && rest_started.elapsed() >= budget {
                carried.put_off = rest[i * slice..].iter().map(|r| r.name.clone()).collect();
                break;
            }
            self.stage(run, due.to_vec(), &mut carried).await?;
        }
        // Drops the nodes no longer active (none when they are those the run before swapped in).
        swap(p, run, Vec::new(), (&self.plan.active, self.plan.active_unchanged));
        Ok(carried)
    }

    /// One stage: its bundles assembled, their versions stored, sealed, swapped into the table,
    /// and the long-polls told unless the run has something to follow that the holders'
    /// answers could run ahead of (`finish` tells them again).
    async fn stage(&self, run: &mut Run, due: Vec<&NodeRecord>, carried: &mut Carried) -> Result<()> {
        let (p, plan, times) = (&self.c.publisher, self.plan, &mut carried.times);
        let at = std::time::Instant::now();
        let due = off_runtime(|| assembled(run, due, &plan.compiled, (self.shared, self.cert, &plan.paths)));
        times.assemble_ms += at.elapsed().as_millis() as u64;
        let at = std::time::Instant::now();
        let (stored, stale, due) = self.c.store_versions(due).await?;
        times.store_ms += at.elapsed().as_millis() as u64;
        // What `published` says of a stale node is behind (it was not swapped in): the next plan
        // walks every active node.
        run.stale |= !stale.is_empty();
        // The count and sum the store should hold, from the table before this swap.
        carried.seen = if stale.is_empty() { self.c.seen_after(carried.seen, &stored) } else { None };
        let at = std::time::Instant::now();
        let sealed = off_runtime(|| seal(p, due, &stored, self.trust, self.mesh));
        times.seal_ms += at.elapsed().as_millis() as u64;
        let swapped = swap(p, run, sealed, (&[], true));
        if !swapped.is_empty() && !self.follows {
            p.tell_polls();
        }
        carried.published.extend(swapped);
        carried.versions.extend(stored);
        carried.stale.extend(stale);
        Ok(())
    }
}

/// Runs `f`, a long computation, where it does not hold up the runtime's other tasks: on a
/// multi-threaded runtime the thread gives its tasks to another first (`block_in_place`); on a
/// runtime of one thread (a test's) there is none to give them to, and it runs as it is.
pub(crate) fn off_runtime<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Numbers each due bundle's zone with its version, signs every one (on every core) and makes
/// keeps, for large files that changed, the version before's file to make edits from.
fn seal<'r>(
    p: &Publisher,
    mut due: Vec<Due<'r>>,
    versions: &HashMap<String, BundleVersion>,
    trust: &RunTrust,
    mesh: &str,
) -> Vec<Sealed<'r>> {
    // The digest, which decided whether the content changed, is of the zone as compiled.
    for d in &mut due {
        number(&mut d.files, versions[&d.record.name].version as u64);
    }
    // Signed on every core: ten thousand signatures are a few hundred milliseconds on one.
    let heads = trellis_core::par::map(due.len(), |i| {
        let d = &due[i];
        let v = &versions[&d.record.name];
        let entries = entries(&d.files);
        (
            trellis_core::bundle::sign_entries(&trust.key, mesh, &d.record.name, v.version as u64, v.issued_at, &entries),
            trellis_core::bundle::entries_digest(&entries),
        )
    });
    let signed: Vec<_> = due
        .into_iter()
        .zip(heads)
        .map(|(d, (head, content))| {
            let signed = Signed { head, contents: d.files.iter().map(|f| f.content.clone()).collect() };
            let version = versions[&d.record.name].version;
            // The version before, to make a large file's edits from, when the node holds it
            // (was answered with it here): a node that does not could not use the edits, and
            // keeping every node's files before doubled the memory at 100,000 nodes.
            let previous = d
                .files
                .iter()
                .any(|f| f.content.len() >= EDITS_FROM)
                .then(|| p.current(&d.record.name))
                .flatten()
                .filter(|old| old.version < version && p.holds(&d.record.name, old.version));
            (d, signed, content, previous)
        })
        .collect();
    // Each large file that changed, by bundle and place: the version before's file, to make its
    // edits from when the node first asks (not here, on the run's path).
    let mut edits: HashMap<usize, Vec<(usize, super::body::EditsFrom)>> = HashMap::new();
    for (i, (d, _, _, previous)) in signed.iter().enumerate() {
        let Some(old) = previous else { continue };
        let before = trellis_core::bundle::signed_files(&old.signed.head);
        for (k, f) in d.files.iter().enumerate().filter(|(_, f)| f.content.len() >= EDITS_FROM) {
            if let Some(j) = before.iter().position(|(path, _, sha, _)| path == f.path && *sha != f.sha256) {
                edits.entry(i).or_default().push((k, super::body::EditsFrom::new(before[j].2, old.signed.contents[j].clone())));
            }
        }
    }
    signed
        .into_iter()
        .enumerate()
        .map(|(i, (d, signed, digest, _))| {
            let version = versions[&d.record.name].version;
            (d.record, d.digest, Published { version, digest, signed, edits: edits.remove(&i).unwrap_or_default() })
        })
        .collect()
}

/// Swaps the sealed bundles into the table the long-polls read, and drops those of nodes no
/// longer active (none when the active nodes are those the run before swapped in:
/// `active_unchanged`); returns each published node's version.
fn swap(p: &Publisher, run: &mut Run, sealed: Vec<Sealed>, (active, active_unchanged): (&[&NodeRecord], bool)) -> Vec<(String, i64)> {
    let mut published = Vec::with_capacity(sealed.len());
    let mut table = HashMap::with_capacity(sealed.len());
    for (record, digest, bundle) in sealed {
        published.push((record.name.clone(), bundle.version));
        run.published.insert(record.name.clone(), (digest, record.cert_serial.clone()));
        table.insert(record.name.clone(), Arc::new(bundle));
    }
    // Made before the table's lock is taken: the long-polls read the table meanwhile.
    let live: Option<trellis_core::FastSet<&str>> = (!active_unchanged).then(|| active.iter().map(|r| r.name.as_str()).collect());
    let mut t = p.table.write().expect("bundle table");
    t.extend(table);
    if let Some(live) = &live {
        t.retain(|n, _| live.contains(n.as_str()));
    }
    drop(t);
    if let Some(live) = &live {
        p.served.lock().expect("served").retain(|n, _| live.contains(n.as_str()));
        run.published.retain(|n, _| live.contains(n.as_str()));
    }
    published
}

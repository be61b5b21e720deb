//! What publish runs leave for the requests between them: the bundle table the long-polls read
//! and its change channel, the authentication table node endpoints fall back on, the long-polls
//! open per node, the contacts written in batches, the freshness stamp, and the counts and
//! channels through which decisions ask for runs and wait for them.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use base64::Engine;

use super::body::Published;
use super::plan::Run;
use crate::Controller;

/// What the node endpoints need to authenticate a certificate without the database.
#[derive(Clone, Debug)]
pub struct AuthEntry {
    pub state: trellis_proto::EnrolledState,
    pub serials: Vec<String>,
    /// The pool of a member whose name the current declaration gives a declared node: the
    /// record is no node of the mesh, and its certificate is refused.
    pub replaced: Option<String>,
}

pub(crate) struct Publisher {
    /// What the last run kept for the next; held through a run, so runs go one at a time.
    pub(super) run: tokio::sync::Mutex<Run>,
    /// Every active node's current bundle, as the long-polls read it.
    pub(super) table: RwLock<HashMap<String, Arc<Published>>>,
    auth: RwLock<HashMap<String, AuthEntry>>,
    /// Moves at the end of every run: long-polls look at the table again.
    pub(super) changes: tokio::sync::watch::Sender<u64>,
    /// The mesh's name, as the last run read it: the freshness stamp names it.
    pub(super) mesh: RwLock<String>,
    stamp: Mutex<(i64, Arc<str>)>,
    contacts: Mutex<HashMap<String, i64>>,
    /// Decisions made here, counted; each asks for a run.
    pub(super) asked: AtomicU64,
    /// The count of decisions that the newest finished run covers.
    pub(super) covered: tokio::sync::watch::Sender<u64>,
    /// Wakes the background task; a wake while it runs is kept, so it runs once more.
    pub(super) wake: tokio::sync::Notify,
    /// Whether a background task publishes (see `Controller::publishing`); without one,
    /// `settle` publishes in its caller.
    pub(super) background: AtomicBool,
    /// Runs finished, for figures and tests.
    pub(super) runs: AtomicU64,
    /// Reads of every stored version (`publish_if_moved`), for tests.
    pub(crate) version_reads: AtomicU64,
    /// The long-polls open per node, oldest first (see `polling`).
    polling: Mutex<HashMap<String, Polls>>,
    /// The pools' members, as the last run read them: only their long-polls count as contact at
    /// each batch (nothing else is removed for want of contact, and ten thousand agents would
    /// otherwise be written every five seconds).
    pub(super) members: RwLock<HashSet<String>>,
    /// Each node's last path report as kept (ADR 0032): a report the same as before is not
    /// written again, and asks for no run.
    pub(crate) path_reports: Mutex<HashMap<String, trellis_proto::PathReport>>,
    /// The version each node was last answered with here (its bundle or a delta to it, or told
    /// that it is current): the version it holds, as far as this replica knows. A publish run
    /// keeps a large file's version before to make edits from only for a node that holds that
    /// version (ADR 0035): a node that holds another could not use the edits.
    pub(crate) served: Mutex<HashMap<String, i64>>,
    /// The relayed pairs as the last run decided them, and every node's plan they were decided
    /// on: the ranked ones (every candidate among them) and a count of the others, whose
    /// reasons `relayed_pairs` makes from the plans when status asks.
    pub(crate) pairs: RwLock<Arc<Pairs>>,
    /// The pairs whose agents reported failed attempts, each until when it ranks last for a place
    /// under the cap (`paths::FAILED_HOLD_SECS`).
    pub(crate) failed_pairs: Mutex<HashMap<(String, String), i64>>,
    /// How many of the rest's bundles a run carries out at a time, and for how long before it
    /// puts off what is left while decisions wait (ADR 0042): `REST_SLICE` and `REST_BUDGET`,
    /// smaller in tests.
    pub(crate) rest: Mutex<(usize, std::time::Duration)>,
    /// For tests: the next run, once its first stage is swapped in, says so on the first and
    /// waits for the second before it goes on (`Controller::hold_after_first_stage`).
    pub(crate) hold: Mutex<Option<StageHold>>,
}

/// Where a test holds a run between its stages: told when it is there, and when to go on.
pub(crate) type StageHold = (tokio::sync::oneshot::Sender<()>, tokio::sync::oneshot::Receiver<()>);

/// The relayed pairs as a run decided them, with every node's plan (in name order) of the
/// compiled output it decided them on. The plans are shared with the compiled output: holding
/// them costs a pointer a node, and a status made from them holds up no run. A run lets go of
/// them while it compiles (`None`): a plan it changes in place that something else holds is
/// copied first, and at 100,000 nodes that was every plan of a storm's runs twice.
#[derive(Default)]
pub(crate) struct Pairs {
    pub relayed: trellis_core::paths::Relayed,
    pub plans: Option<Vec<Arc<trellis_core::plan::NodePlan>>>,
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
            version_reads: AtomicU64::new(0),
            polling: Default::default(),
            members: Default::default(),
            path_reports: Default::default(),
            served: Default::default(),
            pairs: Default::default(),
            failed_pairs: Default::default(),
            rest: Mutex::new((super::run::REST_SLICE, super::run::REST_BUDGET)),
            hold: Mutex::new(None),
        }
    }
}

impl Publisher {
    /// Every relayed pair, in (a, b, hub) order, as the last run decided it: the pairs it did
    /// not rank are made from the plans it kept (millions at 100,000 nodes, seconds of CPU: off
    /// the runtime's threads), holding no lock. While a run compiles, this waits for it to end;
    /// after a run that failed, until another succeeds, there are none.
    pub(crate) async fn relayed_pairs(&self) -> Vec<trellis_core::paths::Pair> {
        let pairs = self.kept_pairs().await;
        let Some(plans) = &pairs.plans else { return Vec::new() };
        super::run::off_runtime(|| pairs.relayed.all(plans.iter().map(|p| &**p)))
    }

    /// The pairs and plans the last run kept; while a run compiles, once it ended.
    pub(crate) async fn kept_pairs(&self) -> Arc<Pairs> {
        let pairs = self.pairs.read().expect("pairs").clone();
        if pairs.plans.is_some() {
            return pairs;
        }
        drop(self.run.lock().await);
        self.pairs.read().expect("pairs").clone()
    }

    /// Lets go of the plans kept for status while a run compiles (see `Pairs`).
    pub(super) fn release_plans(&self) {
        let mut pairs = self.pairs.write().expect("pairs");
        if pairs.plans.is_some() {
            *pairs = Arc::new(Pairs { relayed: pairs.relayed.clone(), plans: None });
        }
    }

    /// How many nodes' bundles the table holds: only active nodes' (`swap` drops the others).
    pub(crate) fn held_count(&self) -> usize {
        self.table.read().expect("bundle table").len()
    }

    pub fn current(&self, node: &str) -> Option<Arc<Published>> {
        self.table.read().expect("bundle table").get(node).cloned()
    }

    /// Notes that `node` was answered with (or told it holds) `version`.
    pub fn served(&self, node: &str, version: i64) {
        let mut s = self.served.lock().expect("served");
        match s.get_mut(node) {
            Some(v) => *v = version,
            None => {
                s.insert(node.to_string(), version);
            }
        }
    }

    /// Whether `node` was last answered here with `version`.
    pub fn holds(&self, node: &str, version: i64) -> bool {
        self.served.lock().expect("served").get(node) == Some(&version)
    }

    pub(crate) fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
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
    pub(super) fn set_auth(&self, records: &[trellis_store::NodeRecord], mesh: Option<&HashMap<&str, Option<&str>>>) {
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

    /// `set_auth` for the same records under another declaration: only a pool's member can be
    /// replaced by a declared node of its name, so only members' entries are made again (at
    /// 100,000 nodes the whole table was a quarter of a second of the publish run after every
    /// apply).
    pub(super) fn set_auth_replaced(&self, records: &[trellis_store::NodeRecord], mesh: &HashMap<&str, Option<&str>>) {
        let mut auth = self.auth.write().expect("auth table");
        for r in records.iter().filter(|r| r.pool.is_some()) {
            if let Some(e) = auth.get_mut(&r.name) {
                e.replaced = r.pool.clone().filter(|_| mesh.get(r.name.as_str()) == Some(&None));
            }
        }
    }

    /// Wakes the long-polls: the table holds new bundles.
    pub(super) fn tell_polls(&self) {
        self.changes.send_modify(|g| *g += 1);
    }

    /// A run is done: it covered every decision counted up to `upto`, at the audit head `head`;
    /// the long-polls look at the table again.
    pub(super) fn finish(&self, run: &mut Run, head: i64, upto: u64) {
        run.audit_head = head;
        self.runs.fetch_add(1, Ordering::SeqCst);
        self.covered.send_if_modified(|c| std::mem::replace(c, (*c).max(upto)) < upto);
        self.tell_polls();
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Status's pairs are made from the plans the last run kept, while a run holds the run's
    /// lock: before, status took that lock, so it waited for runs, and a status being made (the
    /// picture asks every second) held every run up.
    #[tokio::test]
    async fn relayed_pairs_are_made_while_a_run_is_in_progress() {
        let files: Vec<(String, String)> = trellis_testing::controller::lab_files("cgnat").into_iter().map(|f| (f.path, f.text)).collect();
        let decl = Arc::new(trellis_core::load_relative(&files, |p| p.to_string()).declaration.expect("lab/cgnat loads"));
        let mut keys = trellis_core::Keys::default();
        keys.replace(decl.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), trellis_core::decl::PublicKey([i as u8 + 1; 32]))));
        let compiled = trellis_core::compile(&decl, &keys, &Default::default(), None).expect("compiles");
        let decided = trellis_core::paths::decide(
            &compiled,
            &keys,
            &decl,
            &Default::default(),
            &|_, _| Default::default(),
            &HashMap::new(),
            &mut Default::default(),
        );
        assert!(decided.relayed.others > 0, "lab/cgnat relays pairs");
        let p = Arc::new(Publisher::default());
        let plans = compiled.nodes.values().map(|o| o.plan.clone()).collect();
        *p.pairs.write().unwrap() = Arc::new(Pairs { relayed: decided.relayed.clone(), plans: Some(plans) });
        let run = p.run.lock().await;
        let pairs = p.relayed_pairs().await;
        assert_eq!(pairs, decided.relayed.all(compiled.plans()));
        assert_eq!(pairs.len(), decided.relayed.len());
        // While the run compiles, status waits for it; a run that failed leaves none.
        p.release_plans();
        let q = p.clone();
        let waiting = tokio::spawn(async move { q.relayed_pairs().await });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "status waits for the run that let go of the plans");
        drop(run);
        assert!(waiting.await.unwrap().is_empty());
    }
}

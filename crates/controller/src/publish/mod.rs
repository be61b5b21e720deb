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
//!
//! A run reads (`run`), decides (`plan`, pure: which nodes are due), then in stages (the nodes
//! that hold no bundle first, then the rest in slices, ADR 0042) assembles their files, stores
//! the versions, seals (numbers, signs, makes deltas) and swaps the signed bundles into the
//! table the long-polls read (`tables`, sent as `body` says), and follows what it published
//! (revocations, withdrawals, rotations).

mod body;
mod plan;
mod run;
mod tables;

pub(crate) use run::off_runtime;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use body::{Body, EditsFrom, Part, Published, Signed, EDITS_FROM};
pub(crate) use tables::Publisher;
pub use tables::{AuthEntry, Polling, POLLS_PER_NODE};

use crate::{Controller, Error, Result};

/// A run that published fewer bundles than this gives back what it freed a little later
/// (`memory::release_freed_soon`, ADR 0041): giving back walks every free block of the heap, and
/// after an enrolment storm at 100,000 nodes that took 0.15-1 s of a core after each small run (a
/// group move's), while the agents fetched what the run published.
const GIVE_BACK_FROM: usize = 1024;

impl Controller {
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
        self.settle_for(None, within).await
    }

    /// `settle`, and for a node that just enrolled (`node`), also returned once the node's own
    /// bundle is in the table: a run swaps in the first bundles before the rest, and may put the
    /// rest off while decisions wait (ADR 0042). In an enrolment storm the run covering an
    /// enrolment can be seconds behind the node's first bundle.
    pub(crate) async fn settle_for(&self, node: Option<&str>, within: Duration) -> Result<()> {
        let p = &self.publisher;
        let target = p.asked.load(Ordering::SeqCst);
        let held = || node.is_some_and(|n| p.current(n).is_some());
        if *p.covered.borrow() >= target || held() {
            return Ok(());
        }
        if !p.background.load(Ordering::SeqCst) {
            self.publish().await?;
            return Ok(());
        }
        let (mut covered, mut changes) = (p.covered.subscribe(), p.subscribe());
        let settled = async {
            loop {
                if *covered.borrow_and_update() >= target || held() {
                    return;
                }
                // Either sender lives as long as the controller: an error is a controller gone.
                let moved = tokio::select! {
                    r = covered.changed() => r.is_ok(),
                    r = changes.changed() => r.is_ok(),
                };
                if !moved {
                    return;
                }
            }
        };
        match tokio::time::timeout(within, settled).await {
            Ok(()) => Ok(()),
            Err(_) => Err(Error::PublishingBehind(within.as_secs())),
        }
    }

    /// Publishes if another replica decided something since the last run, or if a stored
    /// version is not the one held here (another replica published that node again).
    pub async fn publish_if_moved(&self) -> Result<()> {
        // Read under the run's lock: read before it, while a run of this replica stored, they
        // were the store before that run, and were taken for another replica's publish (every
        // version read again, 100,000 rows at 100,000 nodes, and that stale sum kept as seen, so
        // the next look read them all once more).
        let mut run = self.publisher.run.lock().await;
        let head = self.store.audit_head().await?;
        let versions = self.store.bundle_versions().await?;
        let moved = head != run.audit_head;
        // Compared while no run is under way (this holds the run's lock): the table then holds
        // every version this replica published itself.
        if run.versions_seen != Some(versions) {
            tracing::debug!(seen = ?run.versions_seen, stored = ?versions, "reading every stored version");
            self.publisher.version_reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
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

    /// Sets how many of the rest's bundles a run carries out at a time and for how long before
    /// it puts off what is left while decisions wait (ADR 0042; for tests).
    #[doc(hidden)]
    pub fn set_rest_slices(&self, slice: usize, budget: Duration) {
        *self.publisher.rest.lock().expect("rest") = (slice, budget);
    }

    /// Counts a decision as made, asking for a run, as every decision does (for tests that
    /// make one arrive while a run is under way).
    #[doc(hidden)]
    pub fn ask_publish_now(&self) {
        self.ask_publish();
    }

    /// Holds the next run that has a first stage (ADR 0042) once that stage is in the table:
    /// the first receiver hears when it is there, and the run goes on when the sender is used or
    /// dropped (for tests that look at the table between the stages).
    #[doc(hidden)]
    pub fn hold_after_first_stage(&self) -> (tokio::sync::oneshot::Receiver<()>, tokio::sync::oneshot::Sender<()>) {
        let (there, told) = tokio::sync::oneshot::channel();
        let (go, gone) = tokio::sync::oneshot::channel();
        *self.publisher.hold.lock().expect("hold") = Some((there, gone));
        (told, go)
    }

    /// Runs `f` while no publish run can start (for tests that order a run among other work).
    #[doc(hidden)]
    pub async fn while_no_run<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        let _run = self.publisher.run.lock().await;
        f.await
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
            // What a large run freed goes back to the system, off the runtime's threads (ADR 0041).
            if *bundles >= GIVE_BACK_FROM {
                crate::memory::give_back().await;
            } else {
                crate::memory::release_freed_soon();
            }
            // A run can complete a revocation (a holder left the mesh); evidence completes the
            // others.
            if let Err(e) = self.settle_revocations().await {
                tracing::error!("following revocations failed: {e}");
            }
        }
        result.map(|(n, _)| n)
    }
}

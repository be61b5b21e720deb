//! What a node asking for its bundle is answered, decided here and returned as a value (as
//! boringtun's `Tunn` returns a `TunnResult`): the edits from the version it holds, the whole
//! bundle, or that what it holds is current. The server writes the answer to the response and
//! decides nothing.

use std::sync::Arc;
use std::time::Duration;

use trellis_proto::etag::BundleTag;

use crate::publish::Body;
use crate::{Controller, Error, NodeIdentity, Result};

/// The longest a node's request waits for a newer bundle than the one it holds.
pub const MAX_WAIT: Duration = Duration::from_secs(60);

/// How long a request that needs the decisions before it published (a node's first bundle, the
/// audit checkpoint) waits for the publish run that covers them.
pub const SETTLE: Duration = Duration::from_secs(20);

/// A node's request for its bundle.
#[derive(Clone, Debug, Default)]
pub struct BundleRequest {
    /// The version it holds, if any, and (from a current agent) the start of its content digest.
    pub held: Option<trellis_proto::etag::BundleTag>,
    /// Whether it takes a delta from the bundle it holds (ADR 0033).
    pub takes_delta: bool,
    /// The files it holds, by the first 8 bytes of their SHA-256: a delta keeps or edits only
    /// these.
    pub held_files: Vec<[u8; 8]>,
    /// How long to wait for a newer bundle than the one held (at most [`MAX_WAIT`]).
    pub wait: Duration,
}

/// Resolves when the long-poll `open` holds was pushed out by newer ones of its node (never
/// when there is none, or once it has fired).
async fn displaced(open: &mut Option<(crate::metrics::LongPoll, crate::publish::Polling<'_>)>) {
    match open {
        Some((_, polling)) if !polling.displaced.is_terminated() => {
            // A sender dropped without a word is a long-poll answered: nothing to do.
            if (&mut polling.displaced).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        _ => std::future::pending().await,
    }
}

/// The answer to a [`BundleRequest`]. Each carries the tag of the bundle it names (its ETag) and
/// a signed freshness stamp (base64).
pub enum BundleAnswer {
    /// The delta from the bundle held to the one `tag` names (`proto::DELTA_TYPE`, ADR 0033).
    Delta { tag: BundleTag, body: Body, stamp: Arc<str> },
    /// The whole signed bundle `tag` names, to be sent as it is held.
    Whole { tag: BundleTag, body: Body, stamp: Arc<str> },
    /// The bundle held, which `tag` names, is current (`304`).
    Current { tag: BundleTag, stamp: Arc<str> },
}

/// The delta from the bundle `held` names, whose files are `files` (by the start of their
/// digests), to `p`: each file kept when held, its edits when their base is held, else whole
/// (ADR 0033), sent as a body whose whole files come from where the bundle holds them. `None`
/// when nothing of it is held (the whole bundle is sent) or the tag does not say its content.
fn delta_from(p: &Arc<crate::Published>, held: BundleTag, files: &[[u8; 8]]) -> Option<Body> {
    use crate::publish::Part;
    use trellis_core::delta::{frame, op, op_head, Base, Op};
    let digest = held.digest?;
    let entries = trellis_core::bundle::signed_files(&p.signed.head);
    let is_held = |d: &[u8; 32]| files.iter().any(|f| f[..] == d[..8]);
    let ops: Vec<Op<'_, trellis_core::Text>> = entries
        .iter()
        .zip(&p.signed.contents)
        .enumerate()
        .map(|(i, ((_, _, sha, _), content))| {
            // Edits are made only for a node that holds their base and not the file itself.
            let edits = p.edits.iter().find(|(k, e)| *k == i && is_held(&e.base) && !is_held(sha)).and_then(|(_, e)| e.edits(content));
            op(sha, content, edits, &is_held)
        })
        .collect();
    if ops.iter().all(|o| matches!(o, Op::Whole(_))) {
        return None;
    }
    let mut parts = vec![Part::Small(frame(&p.signed.head, Base { version: held.version as u64, digest }).into())];
    for (i, o) in ops.iter().enumerate() {
        parts.push(Part::Small(op_head(o).into()));
        if let Op::Whole(_) = o {
            parts.push(Part::Content(i));
        }
    }
    Some(Body::of_parts(p.clone(), parts))
}

fn tag_of(p: &crate::Published) -> BundleTag {
    BundleTag::new(p.version, &p.digest)
}

impl Controller {
    /// Answers a node's request for its bundle: a newer one than it holds, as the edits from the
    /// one it holds when it takes them and one was made, or whole; otherwise, once `wait` is
    /// over (or at once when the controller stops), that it is current. A node that just enrolled
    /// first waits for the publish run that covers its enrolment. A node pending approval gets
    /// none, and a node with no bundle when the wait is over is told so.
    pub async fn bundle_answer(&self, who: &NodeIdentity, ask: BundleRequest) -> Result<BundleAnswer> {
        self.require_approved(who)?;
        let deadline = tokio::time::Instant::now() + ask.wait.min(MAX_WAIT);
        let mut changes = self.publisher.subscribe();
        if self.publisher.current(&who.name).is_none() {
            // A node that just enrolled: its first bundle follows the publish run that covers the
            // enrolment, which has not put it in the table yet.
            self.settle_for(Some(&who.name), SETTLE).await?;
        }
        let mut open = (!ask.wait.is_zero()).then(|| (self.metrics.long_poll(), self.publisher.polling(&who.name)));
        let mut witnessed = false;
        loop {
            let current = self.publisher.current(&who.name);
            let stamp = self.stamp();
            if let Some(p) = &current {
                if let Some(held) = ask.held.filter(|held| !witnessed && is_ahead(*held, p)) {
                    // The node holds a bundle this controller did not number so: the database
                    // was restored from before it. Its bundle is numbered above what it holds
                    // (so it is not refused as a rollback) and published again, if what it says
                    // can be true.
                    witnessed = true;
                    if self.believe_witness(&who.name, held.version, p.version) {
                        self.renumber_above(&who.name, held.version, p.version).await?;
                        continue;
                    }
                }
                let behind = !ask.held.is_some_and(|h| h.names(p.version, &p.digest));
                // What the node holds once answered (or holds already): edits from it are kept
                // for its next version (ADR 0035).
                self.publisher.served(&who.name, p.version);
                let asks_delta = ask.held.filter(|_| behind && ask.takes_delta);
                let delta = match asks_delta {
                    // Making a large file's edits takes milliseconds: not on the runtime's threads.
                    Some(held) => {
                        let (p, files) = (p.clone(), ask.held_files.clone());
                        tokio::task::spawn_blocking(move || delta_from(&p, held, &files))
                            .await
                            .map_err(|e| Error::internal("making a delta", e.to_string()))?
                    }
                    None => None,
                };
                if let Some(body) = delta {
                    self.metrics.bundle_answer("delta", body.remaining());
                    return Ok(BundleAnswer::Delta { tag: tag_of(p), body, stamp });
                }
                if behind {
                    let body = Body::new(p.clone());
                    self.metrics.bundle_answer("200", body.remaining());
                    return Ok(BundleAnswer::Whole { tag: tag_of(p), body, stamp });
                }
            }
            let changed = tokio::select! {
                r = tokio::time::timeout_at(deadline, changes.changed()) => matches!(r, Ok(Ok(()))),
                // The controller is stopping: the node hears now that what it holds is current, and
                // asks again (another replica, or this one once it is back).
                _ = self.stopped() => false,
                // Newer long-polls of the same node pushed this one out: it answers now, as when
                // the wait is over.
                _ = displaced(&mut open) => false,
            };
            if !changed {
                return match current {
                    Some(p) => {
                        self.metrics.bundle_answer("304", 0);
                        Ok(BundleAnswer::Current { tag: tag_of(&p), stamp })
                    }
                    None => Err(Error::NoBundleYet(who.name.clone())),
                };
            }
        }
    }

    /// Whether `node`, saying it holds version `held` where this controller serves `ours`, is
    /// believed: only up to what can have been published (the high-water mark of this state
    /// directory, or, where the state directory was restored with the database, a margin of
    /// [`WITNESS_MARGIN`] versions above the stored one), never to the tag's ceiling, and once in
    /// [`WITNESS_INTERVAL_SECS`] per node. One request naming a version near the ceiling pushed
    /// every later version past it, where tags are not tags and every long-poll answered at once
    /// (the review of 2026-12-02, finding 3).
    fn believe_witness(&self, node: &str, held: i64, ours: i64) -> bool {
        let mark = self.high_water_mark();
        let bound = mark.max(ours).saturating_add(WITNESS_MARGIN).min(trellis_proto::etag::MAX_VERSION - 1);
        if held > bound {
            tracing::warn!(
                node,
                held,
                ours,
                "node `{node}` says it holds version {held}, above any this controller can have published ({bound}); not believed"
            );
            return false;
        }
        let now = self.now();
        let mut witnessed = self.witnessed.lock().expect("witnessed");
        if witnessed.get(node).is_some_and(|&at| now - at < WITNESS_INTERVAL_SECS) {
            tracing::warn!(node, held, ours, "node `{node}` says again that it holds version {held}; its bundle was renumbered less than {WITNESS_INTERVAL_SECS} s ago, so not again now");
            return false;
        }
        witnessed.insert(node.to_string(), now);
        if held > mark && mark > 0 {
            tracing::warn!(
                node,
                held,
                mark,
                "node `{node}` holds version {held}, above this state directory's high-water mark {mark}: the state directory was restored with the database (a snapshot)"
            );
        }
        true
    }

    /// Numbers `node`'s bundle above `held` in the database and publishes it again at that
    /// version (every replica serves the stored version, `publish_if_moved`).
    async fn renumber_above(&self, node: &str, held: i64, ours: i64) -> Result<()> {
        if self.store.raise_version(node, held).await? {
            tracing::warn!(
                node,
                held,
                ours,
                "the node holds version {held} (or other content at {ours}): the database was restored from an older backup; its bundle is numbered {} and published again",
                held + 1
            );
            self.metrics.renumbered();
        }
        self.publish_if_moved().await
    }

    /// A node's current bundle, as held in memory.
    pub fn bundle(&self, node: &str) -> Option<Arc<crate::Published>> {
        self.publisher.current(node)
    }

    /// How many publish runs have finished.
    pub fn publish_runs(&self) -> u64 {
        self.publisher.runs()
    }

    /// How many times every stored version was read to see whether another replica published.
    pub fn version_reads(&self) -> u64 {
        self.publisher.version_reads.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Counts `node` as long-polling until the guard drops, as a request waiting in
    /// [`Controller::bundle_answer`] is.
    #[cfg(feature = "testing")]
    pub fn polling(&self, node: &str) -> crate::publish::Polling<'_> {
        self.publisher.polling(node)
    }
}

/// How far above the stored version a node's word on what it holds is believed when the state
/// directory's high-water mark is below it (a whole-machine snapshot restored): as many
/// publishing runs that changed the node since the snapshot as a mesh makes in years.
pub const WITNESS_MARGIN: i64 = 1 << 20;

/// How long after a node's word renumbered its bundle it is not believed again.
pub const WITNESS_INTERVAL_SECS: i64 = 600;

/// Whether a node holding `held` holds what this controller did not publish so: a version above
/// the current one, or the current number with other content. Either comes only from a database
/// restored from before the node got its bundle (versions only rise otherwise).
fn is_ahead(held: BundleTag, current: &crate::Published) -> bool {
    held.version > current.version || (held.version == current.version && !held.names(current.version, &current.digest))
}

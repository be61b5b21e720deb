//! What a node asking for its bundle is answered, decided here and returned as a value (as
//! boringtun's `Tunn` returns a `TunnResult`): the edits from the version it holds, the whole
//! bundle, or that what it holds is current. The server writes the answer to the response and
//! decides nothing.

use std::sync::Arc;
use std::time::Duration;

use crate::publish::Body;
use crate::{Controller, Error, NodeIdentity, Result};

/// The longest a node's request waits for a newer bundle than the one it holds.
pub const MAX_WAIT: Duration = Duration::from_secs(60);

/// How long a request that needs the decisions before it published (a node's first bundle, the
/// audit checkpoint) waits for the publish run that covers them.
pub const SETTLE: Duration = Duration::from_secs(20);

/// A node's request for its bundle.
#[derive(Clone, Copy, Debug, Default)]
pub struct BundleRequest {
    /// The version it holds, if any.
    pub held: Option<i64>,
    /// Whether it can rebuild a bundle from the one it holds, and so takes the edits instead.
    pub takes_delta: bool,
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

/// The answer to a [`BundleRequest`]. Each carries the version it names and a signed freshness
/// stamp (base64).
pub enum BundleAnswer {
    /// The edits from the version held to `version` (`proto::DELTA_TYPE`).
    Delta { version: i64, delta: bytes::Bytes, stamp: Arc<str> },
    /// The whole signed bundle at `version`, to be sent as it is held.
    Whole { version: i64, body: Body, stamp: Arc<str> },
    /// The version held, `version`, is current (`304`).
    Current { version: i64, stamp: Arc<str> },
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
            // enrolment, which has not finished yet.
            self.settle(SETTLE).await?;
        }
        let mut open = (!ask.wait.is_zero()).then(|| (self.metrics.long_poll(), self.publisher.polling(&who.name)));
        loop {
            let current = self.publisher.current(&who.name);
            let stamp = self.stamp();
            if let Some(p) = &current {
                if let Some((_, delta)) = p.delta.as_ref().filter(|(base, _)| ask.takes_delta && ask.held == Some(*base)) {
                    self.metrics.bundle_answer("delta", delta.len());
                    return Ok(BundleAnswer::Delta { version: p.version, delta: delta.clone(), stamp });
                }
                if ask.held != Some(p.version) {
                    let body = Body::new(p.clone());
                    self.metrics.bundle_answer("200", body.remaining());
                    return Ok(BundleAnswer::Whole { version: p.version, body, stamp });
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
                        Ok(BundleAnswer::Current { version: p.version, stamp })
                    }
                    None => Err(Error::NoBundleYet(who.name.clone())),
                };
            }
        }
    }

    /// A node's current bundle, as held in memory.
    pub fn bundle(&self, node: &str) -> Option<Arc<crate::Published>> {
        self.publisher.current(node)
    }

    /// How many publish runs have finished.
    pub fn publish_runs(&self) -> u64 {
        self.publisher.runs()
    }

    /// Counts `node` as long-polling until the guard drops, as a request waiting in
    /// [`Controller::bundle_answer`] is.
    #[cfg(feature = "testing")]
    pub fn polling(&self, node: &str) -> crate::publish::Polling<'_> {
        self.publisher.polling(node)
    }
}

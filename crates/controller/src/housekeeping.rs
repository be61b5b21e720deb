//! The controller's periodic duties, in one task of its own that the server only starts
//! (`Controller::housekeeping`): each changes state the controller owns. Every half second:
//! publishing what other replicas decided (or published again), and completing a revocation or a
//! rotation that evidence arrived for. Every 5 s besides: a rotation's overlap, the server
//! certificate's renewal at two thirds of its lifetime, the contacts held in memory written, the
//! pools' members out of contact swept, the refusals of closed windows written, and revocations
//! completed by evidence another replica received.

use std::sync::Arc;
use std::time::Duration;

use crate::Controller;

/// How often the quick duties run.
pub const TICK: Duration = Duration::from_millis(500);

/// The slower duties run every this many ticks (5 s).
const SLOW: u64 = 10;

impl Controller {
    /// Runs the periodic duties until the task is aborted. A duty that fails says so and is
    /// tried again at its next turn.
    pub async fn housekeeping(self: Arc<Self>) {
        let mut tick = tokio::time::interval(TICK);
        let mut n = 0u64;
        loop {
            tick.tick().await;
            self.quick_duties(n.is_multiple_of(SLOW)).await;
            n += 1;
            if n.is_multiple_of(SLOW) {
                self.slow_duties().await;
            }
        }
    }

    /// Every tick: publishing what moved, and what evidence may have completed (`overlap`: a
    /// rotation's overlap is looked at too).
    async fn quick_duties(&self, overlap: bool) {
        if let Err(e) = self.publish_if_moved().await {
            tracing::error!("publishing failed: {e}");
        }
        // Evidence that arrived while a revocation was open may have completed it.
        if let Err(e) = self.settle_revocations_if_due().await {
            tracing::error!("following revocations failed: {e}");
        }
        // Likewise a rotation of the signing key (ADR 0027); every 5 s its overlap.
        if let Err(e) = self.settle_rotation(overlap).await {
            tracing::error!("following the rotation of the signing key failed: {e}");
        }
    }

    /// Every 5 s.
    async fn slow_duties(&self) {
        // The server certificate, renewed at two thirds of its lifetime.
        if let Err(e) = self.renew_server_cert_if_due().await {
            tracing::error!("renewing the server certificate failed: {e}");
        }
        self.flush_contacts().await;
        // Pools' members out of contact for their pool's ephemeral_after.
        if let Err(e) = self.sweep_members().await {
            tracing::error!("sweeping pool members failed: {e}");
        }
        // Refusals counted in windows that have closed, one record each.
        self.write_refusals().await;
        // A revocation completed by evidence another replica received is recorded here too, if
        // no look has recorded it yet (one query when none is open).
        if let Err(e) = self.settle_revocations().await {
            tracing::error!("following revocations failed: {e}");
        }
    }

    /// What a stopping controller writes last: the contacts and refusals held in memory.
    pub async fn flush(&self) {
        self.flush_contacts().await;
        self.write_refusals().await;
    }
}

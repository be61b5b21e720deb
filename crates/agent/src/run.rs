//! `trellis-agent run`: long-poll the bundle, verify it, install it (`install`), report evidence.
//! With the controller away the last verified bundle stays applied and the overlay keeps
//! running; the agent retries with backoff and jitter and shows its staleness.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use trellis_client::NodeClient;
use trellis_core::bundle::{Applied, Bundle};
use trellis_proto as proto;

use crate::exec::{Backends, Executor};
use crate::identity;
use crate::install::Installer;
use crate::plan::Scope;
use crate::state::{self, EvidenceBuffer, Identity, Manifest, SigningKeys};
use crate::statedir::{self, HELD_HEAD, HELD_HEAD_NEXT, LAST_BUNDLE};
use crate::status::{AgentStatus, IngressStatus};
use crate::unix_now;
use trellis_core::trust::TrustFile;

pub struct Options {
    pub state_dir: PathBuf,
    pub root: PathBuf,
    /// Write files only; touch no interface and no ruleset.
    pub files_only: bool,
    /// Long-poll wait, seconds.
    pub wait: u64,
    /// Stop after this many applied bundles (for tests); 0 runs for ever.
    pub max_applies: u64,
    /// The longest wait between retries while the controller is unreachable, seconds.
    pub max_backoff: u64,
    pub dns_port: u16,
    /// Where to serve the metrics (`run` only).
    pub metrics_listen: Option<String>,
    /// Whether the agent runs Traefik on an ingress node, and where its API is (ADR 0026).
    pub ingress: crate::ingress::IngressMode,
    pub ingress_api: std::net::SocketAddr,
}

struct Polled {
    body: Result<Option<Received>>,
    answered: bool,
    fresh_at: Option<i64>,
    /// The freshness stamp was refused: the controller's clock is too far from this node's.
    skew: Option<String>,
}

/// A newer bundle, as it came: whole (verified when taken), or a delta already verified and
/// built against the bundle held (ADR 0033), with whether the next key signed it.
enum Received {
    Whole(Vec<u8>),
    Built(trellis_core::bundle::Verified, bool),
    /// A delta whose head is refused as a whole bundle's would be (signature, node, version).
    Refused(String),
}

/// Whether a delta's refusal is one the whole bundle would get too (its head is the whole
/// bundle's): then it is not fetched again.
fn is_refusal(e: &trellis_core::bundle::BundleError) -> bool {
    use trellis_core::bundle::BundleError as E;
    matches!(
        e,
        E::BadSignature
            | E::WrongMesh { .. }
            | E::WrongNode { .. }
            | E::NotNewer { .. }
            | E::EqualVersionOtherContent { .. }
            | E::UnsafePath { .. }
    )
}

/// A freshness stamp's time `at`, as taken when it has just arrived at `now` (the controller
/// signs it as it answers): within the tolerated skew it is the controller's newest word; further
/// from this node's clock, ahead or behind, it is refused with a sentence naming the skew (a
/// controller's clock that far off, or a stamp replayed from long ago, says nothing fresh).
fn fresh(at: i64, now: i64) -> Result<i64, String> {
    use trellis_proto::version::{skew_words, MAX_SKEW_SECS};
    if (at - now).abs() > MAX_SKEW_SECS {
        return Err(format!(
            "the controller's freshness stamp is {} this node's clock, more than the {MAX_SKEW_SECS} s tolerated: set the clocks (NTP)",
            skew_words(at, now)
        ));
    }
    Ok(at)
}

pub struct Agent {
    opts: Options,
    id: Identity,
    /// The keys bundles may be signed with: the current one and the one announced next.
    keys: SigningKeys,
    installer: Installer,
    evidence: EvidenceBuffer,
    status: AgentStatus,
    client: NodeClient,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// The node's service certificates (ADR 0023).
    certs: crate::certs::Certs,
    /// Traefik on an ingress node; tended while a long-poll waits, so behind a lock.
    ingress: std::sync::Mutex<crate::ingress::Ingress>,
    /// The ingress status the controller last acknowledged: reported again only when it changes.
    ingress_reported: Option<IngressStatus>,
    /// The direct paths as last reported to the controller (ADR 0032).
    paths_reported: Option<trellis_proto::PathReport>,
    /// The state directory's lock, held while the agent lives: `run` and `apply` take turns.
    _lock: std::fs::File,
}

/// Gives the heap's free pages back to the system after an apply: reading and applying a bundle
/// of ten thousand peers peaks far above what the agent keeps, and glibc keeps what was freed
/// (`trellis-dev bench agent`: the agent's resident memory after the first apply).
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointer and only returns free heap pages to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The bundle last applied, verified again: its signed head (`bundle.head`) and the files it
/// names, read from under the root (ADR 0033), or, from an agent before it, the whole bundle
/// (`bundle.last`). `None` when there is none; an error when a file is not as the head says (a
/// file changed by hand): then the next bundle is fetched whole and written whole.
fn last_bundle(dir: &Path, root: &Path, keys: &SigningKeys, id: &Identity) -> Result<Option<Bundle>> {
    let held = |name: &str| -> Result<Option<Bundle>> {
        let head = match std::fs::read(dir.join(name)) {
            Ok(head) => head,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", dir.join(name).display())),
        };
        let bytes = trellis_core::bundle::held_bytes(head, |path, mode, len| crate::bundle::read_held(root, path, mode, len))
            .map_err(anyhow::Error::msg)?;
        let (v, _) = keys.verify(&bytes, id, None).map_err(|e| anyhow::anyhow!("the bundle held: {e}"))?;
        Ok(Some(v.bundle))
    };
    match held(HELD_HEAD) {
        Ok(Some(b)) => return Ok(Some(b)),
        // The agent stopped after writing the files of the bundle it was applying, before taking
        // its head: the files are that bundle's.
        first => match (first, held(HELD_HEAD_NEXT)) {
            (_, Ok(Some(b))) => return Ok(Some(b)),
            (Err(e), _) => return Err(e),
            (Ok(_), _) => {}
        },
    }
    match std::fs::read(dir.join(LAST_BUNDLE)) {
        Ok(bytes) => {
            let (v, _) = keys.verify(&bytes, id, None).map_err(|e| anyhow::anyhow!("the last applied bundle: {e}"))?;
            Ok(Some(v.bundle))
        }
        Err(_) => Ok(None),
    }
}

/// What a bundle's `trust.toml` says (none from a controller older than it, or unreadable:
/// then what the node trusts stays as it is).
fn trust_of(bundle: &Bundle) -> Option<TrustFile> {
    let file = bundle.files.iter().find(|f| f.path == trellis_core::compile::TRUST_TOML)?;
    match std::str::from_utf8(&file.content).map_err(|e| e.to_string()).and_then(|t| TrustFile::parse(t).map_err(|e| e.to_string())) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::error!("the bundle's trust.toml is refused, what this node trusts stays as it was: {e}");
            None
        }
    }
}

impl Agent {
    /// An agent for the node enrolled in `opts.state_dir`, acting on the host through `backends`.
    pub fn new(opts: Options, mut backends: Backends) -> Result<Agent> {
        let certs = crate::certs::Certs::new(&opts.root, backends.reloader.take());
        let id = Identity::load(&opts.state_dir)?;
        // Taken before the manifest and the last bundle are read: a second agent would apply
        // against a view of the host that the first one changes under it.
        let lock = state::lock(&opts.state_dir)?;
        let keys = id.signing_keys()?;
        let manifest = Manifest::load(&opts.state_dir);
        let scope = Scope { files_only: opts.files_only, wireguard: backends.wireguard.is_some(), dns_port: opts.dns_port };
        let exec = Executor::new(backends, opts.state_dir.join(statedir::WIREGUARD_KEY));
        // What an apply that fails falls back to.
        let previous = match last_bundle(&opts.state_dir, &opts.root, &keys, &id) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("{e:#}; the next bundle is fetched and written whole");
                None
            }
        };
        let client = identity::node_client(&opts.state_dir, &id)?;
        let ingress = crate::ingress::Ingress::new(&id.node, opts.ingress, &opts.root, &opts.state_dir, opts.ingress_api);
        Ok(Agent {
            _lock: lock,
            ingress: std::sync::Mutex::new(ingress),
            ingress_reported: None,
            paths_reported: None,
            evidence: EvidenceBuffer::new(&opts.state_dir),
            status: AgentStatus {
                pid: std::process::id(),
                version: manifest.version,
                public_key: identity::wireguard_key(&opts.state_dir).ok(),
                ..Default::default()
            },
            installer: Installer::new(exec, scope, &opts.state_dir, manifest, previous),
            id,
            keys,
            client,
            opts,
            metrics: Default::default(),
            certs,
        })
    }

    fn save_status(&mut self) {
        self.status = self.snapshot();
    }

    /// Applies the bundle the manifest names again after a restart: the files are in place, the
    /// interface and ruleset are not (they lived in the previous process or were flushed).
    async fn resume(&mut self) -> Result<()> {
        if self.installer.manifest().version == 0 || self.opts.files_only {
            return Ok(());
        }
        let Some(bundle) = self.installer.previous().cloned() else { return Ok(()) };
        let result = self.installer.resume(&bundle).await;
        self.host_status();
        result
    }

    /// Copies what the host shows after an apply into the status.
    fn host_status(&mut self) {
        let report = self.installer.executor().report().clone();
        self.status.interface = report.interface;
        self.status.ruleset_loaded = report.ruleset_loaded;
        self.status.dns_serving = report.dns_serving;
        self.status.last_apply_phases_ms = report.phases_ms;
        self.tend_ingress();
    }

    /// Tells the controller what this ingress node's Traefik shows (running, its routers, its
    /// certificates), when that changed since it last acknowledged: `trellis status` and the
    /// controller's metrics show it (ADR 0026). A node that is no ingress reports nothing; a
    /// controller that takes no report (an older one) is not asked again for the same status.
    async fn report_ingress(&mut self) {
        let Some(now) = self.ingress.lock().expect("ingress").status().cloned() else { return };
        if self.ingress_reported.as_ref() == Some(&now) {
            return;
        }
        let report = trellis_proto::IngressReport {
            traefik: now.traefik.clone(),
            error: now.error.clone(),
            routers: now
                .routers
                .iter()
                .map(|r| trellis_proto::IngressRouter { name: r.name.clone(), status: r.status.clone(), errors: r.errors.clone() })
                .collect(),
            certificates: now
                .certificates
                .iter()
                .map(|c| trellis_proto::IngressCertificate { hostname: c.hostname.clone(), not_after: c.not_after })
                .collect(),
        };
        match self.client.report_ingress(&report).await {
            Ok(_) => self.ingress_reported = Some(now),
            Err(e) if e.refused().is_some_and(|r| r.status < 500) => {
                tracing::debug!("the controller takes no ingress report: {e}");
                self.ingress_reported = Some(now);
            }
            Err(e) => tracing::debug!("reporting the ingress: {e}"),
        }
    }

    /// Whether the ingress shows something the controller has not acknowledged.
    /// Reports the direct paths (and on a hub the endpoints its peers send from) when they moved
    /// since the last report the controller took (ADR 0032).
    async fn report_paths(&mut self) {
        let now = self.installer.executor().path_report();
        let empty = now.paths.is_empty() && now.observed.is_empty();
        if self.paths_reported.as_ref() == Some(&now) || (empty && self.paths_reported.is_none()) {
            return;
        }
        match self.client.report_paths(&now).await {
            Ok(_) => self.paths_reported = Some(now),
            Err(e) if e.refused().is_some_and(|r| r.status < 500) => {
                tracing::debug!("the controller takes no path report: {e}");
                self.paths_reported = Some(now);
            }
            Err(e) => tracing::debug!("reporting the paths: {e}"),
        }
    }

    fn ingress_changed(&self) -> bool {
        let now = self.ingress.lock().expect("ingress").status().cloned();
        now.is_some() && now != self.ingress_reported
    }

    /// Brings Traefik to the files written and reads its state (ADR 0026).
    fn tend_ingress(&self) {
        self.ingress.lock().expect("ingress").tend();
    }

    /// Applies a verified bundle; `None` when it is already applied.
    async fn apply(&mut self, verified: trellis_core::bundle::Verified, again: bool, by_next: bool) -> Option<proto::Evidence> {
        let trellis_core::bundle::Verified { head, bundle, edited, .. } = verified;
        let trust = trust_of(&bundle);
        let started = std::time::Instant::now();
        let evidence = self.installer.apply(&head, bundle, unix_now(), again, &edited).await?;
        let took = started.elapsed();
        release_free_memory();
        self.metrics.apply(evidence.result == proto::EvidenceResult::Applied, took);
        match &evidence.error {
            None => tracing::info!(version = evidence.version, ms = took.as_millis() as u64, "applied"),
            Some(e) => tracing::error!(version = evidence.version, "apply failed, the previous configuration restored: {e}"),
        }
        self.status.last_apply_ms = self.installer.last_apply_ms;
        self.host_status();
        match evidence.result {
            proto::EvidenceResult::Applied => {
                self.status.version = self.installer.manifest().version;
                self.status.last_error = None;
                self.adopt(trust.as_ref(), by_next);
            }
            _ => self.status.last_error = evidence.error.clone(),
        }
        Some(evidence)
    }

    /// Takes what an applied bundle says the node trusts (ADR 0027, 0028): its controller list,
    /// the signing key announced next, and, when the next key signed it, that key as the only
    /// one (the old key is refused from then on). Kept in `identity.toml`.
    fn adopt(&mut self, trust: Option<&TrustFile>, by_next: bool) {
        if let Some(t) = trust {
            self.adopt_ca(t);
        }
        let id = self.id.adopting(trust, by_next);
        let (keys_moved, list_moved) = (
            id.signing_public_key != self.id.signing_public_key || id.next_signing_public_key != self.id.next_signing_public_key,
            id.controllers != self.id.controllers,
        );
        if !keys_moved && !list_moved && id.revocations == self.id.revocations {
            return;
        }
        let keys = match id.signing_keys() {
            Ok(k) => k,
            Err(e) => {
                tracing::error!("the keys the bundle announces are refused: {e:#}");
                return;
            }
        };
        if let Err(e) = id.save(&self.opts.state_dir) {
            tracing::error!("cannot keep what the bundle says this node trusts: {e:#}");
            return;
        }
        if by_next {
            tracing::info!("bundles are signed with the rotated key from now on; the old key is refused");
        } else if keys_moved {
            tracing::info!(next = ?id.next_signing_public_key, "the controller announced its next signing key");
        }
        if list_moved {
            tracing::info!(controllers = ?id.controllers, "the controller list changed");
            self.client.set_controllers(id.controllers.clone());
        }
        self.keys = keys;
        self.id = id;
    }

    /// Takes what an applied bundle says of the mesh CA (ADR 0029): a next CA announced is
    /// trusted beside the current one (and the node's certificates are renewed under it); the
    /// CA the bundle names, once it is the next one, replaces the current one.
    fn adopt_ca(&mut self, trust: &TrustFile) {
        match identity::adopt_ca(&self.opts.state_dir, trust.ca, trust.next_ca.as_deref()) {
            Ok(identity::CaChange::None) => return,
            Ok(identity::CaChange::Announced(fp)) => {
                tracing::info!(
                    "the controller announced its next mesh CA {fp}: trusted beside the current one; certificates are renewed under it"
                );
                self.certs.reissue_all();
            }
            Ok(identity::CaChange::Completed(fp)) => {
                tracing::info!("the mesh CA is {fp} from now on; the old one is no longer trusted")
            }
            Err(e) => {
                tracing::error!("{e:#}");
                return;
            }
        }
        match identity::node_client(&self.opts.state_dir, &self.id) {
            Ok(c) => self.client = c,
            Err(e) => tracing::error!("loading the mesh CAs: {e:#}"),
        }
    }

    /// Sends again the last record of an applied bundle the controller acknowledged, with its own
    /// number: a controller that holds it counts a duplicate, one that lost it (restored from a
    /// snapshot) takes it, and shows this node current again without waiting for a new bundle.
    /// Whether it was settled (sent, refused for good, or nothing to send).
    async fn reassure(&mut self) -> bool {
        if !self.evidence.pending().is_empty() {
            // The records waiting go first; the last of them is kept when they are acknowledged.
            return false;
        }
        let Some(last) = self.evidence.last_applied() else { return true };
        match self.client.post_evidence(&proto::EvidenceBatch { records: vec![last] }).await {
            Ok(()) => true,
            Err(e) if refused_for_good(&e) => true,
            Err(e) => {
                tracing::debug!("telling the controller again what was applied: {e}");
                false
            }
        }
    }

    async fn flush_evidence(&mut self) -> Result<()> {
        let pending = self.evidence.pending();
        if pending.is_empty() {
            return Ok(());
        }
        for chunk in pending.chunks(proto::MAX_EVIDENCE_BATCH) {
            match self.client.post_evidence(&proto::EvidenceBatch { records: chunk.to_vec() }).await {
                Ok(()) => self.evidence.ack(chunk.len())?,
                // The controller refuses the batch for good (a record it will never take, such
                // as one for a version it never published): sent one by one, the records it
                // refuses are dropped (their numbers stay a visible gap), so one bad record
                // cannot hold back every later one.
                Err(e) if refused_for_good(&e) => {
                    // Acknowledged once for the records settled, whether or not all were.
                    let mut settled = 0;
                    let mut failure = None;
                    for record in chunk {
                        match self.client.post_evidence(&proto::EvidenceBatch { records: vec![record.clone()] }).await {
                            Ok(()) => {}
                            Err(e) if refused_for_good(&e) => {
                                tracing::warn!(seq = record.seq, "the controller refused an evidence record for good, dropped: {e}");
                                self.status.dropped_evidence += 1;
                            }
                            Err(e) => {
                                failure = Some(evidence_error(e));
                                break;
                            }
                        }
                        settled += 1;
                    }
                    self.evidence.ack(settled)?;
                    if let Some(e) = failure {
                        return Err(e);
                    }
                }
                Err(e) => return Err(evidence_error(e)),
            }
        }
        Ok(())
    }

    /// One long-poll. The bundle bytes when there is a newer one; also whether the controller
    /// answered and the time in its signed freshness stamp. Takes `&self` so that the status
    /// can be refreshed while it waits.
    async fn poll(&self) -> Polled {
        // What is held, by its tag: the version and the start of the content digest, so that a
        // controller restored from a backup, which numbered other content so, knows (ADR 0024).
        // Files not as the manifest says (changed by hand) name nothing: the bundle comes whole.
        let m = self.installer.manifest();
        let held = (m.version > 0 && self.installer.intact()).then(|| match m.digest() {
            Some(d) => trellis_proto::etag::BundleTag::new(m.version as i64, &d),
            None => trellis_proto::etag::BundleTag { version: m.version as i64, digest: None },
        });
        // The files held, for a delta from them (ADR 0033).
        let files: Option<Vec<[u8; 32]>> = self.installer.previous().map(|b| b.files.iter().map(|f| f.sha256).collect());
        match self.client.bundle_or_delta(self.opts.wait, held, files.as_deref()).await {
            Ok(answer) => {
                let stamp = answer.freshness.and_then(|stamp| self.keys.verify_stamp(&stamp, &self.id.mesh).ok());
                let (fresh_at, skew) = match stamp.map(|at| fresh(at, unix_now())) {
                    Some(Ok(at)) => (Some(at), None),
                    Some(Err(sentence)) => (None, Some(sentence)),
                    None => (None, None),
                };
                let body = match answer.body {
                    Ok(Some(delta)) if answer.delta => self.build(&delta, held).await,
                    other => other.map(|b| b.map(Received::Whole)).map_err(answered),
                };
                Polled { fresh_at, skew, body, answered: true }
            }
            Err(e) => Polled { body: Err(e.into()), answered: false, fresh_at: None, skew: None },
        }
    }

    /// The new bundle from a delta and the bundle held, verified (ADR 0033); when the delta does
    /// not build it (the files held are not the ones it was made for), the whole bundle is
    /// fetched instead and verified as any is, after this.
    async fn build(&self, delta: &[u8], held: Option<trellis_proto::etag::BundleTag>) -> Result<Option<Received>> {
        let Some(base) = self.installer.previous() else {
            tracing::warn!("a delta came, and no bundle is held to build it from; fetching the whole bundle");
            return Ok(self.client.bundle(0, held).await?.body.map_err(answered)?.map(Received::Whole));
        };
        let started = std::time::Instant::now();
        match self.keys.verify_delta(delta, &self.id, self.applied(), base) {
            Ok((v, by_next)) => {
                let changed = v.changed.as_ref().map_or(0, Vec::len);
                let us = started.elapsed().as_micros() as u64;
                tracing::info!(version = v.bundle.version, delta = delta.len(), files = changed, us, "built a bundle from a delta");
                Ok(Some(Received::Built(v, by_next)))
            }
            // A signature or a version refused is refused whole as well: not fetched again.
            Err(e) if is_refusal(&e) => Ok(Some(Received::Refused(e.to_string()))),
            Err(e) => {
                tracing::warn!("{e}; fetching the whole bundle");
                Ok(self.client.bundle(0, held).await?.body.map_err(answered)?.map(Received::Whole))
            }
        }
    }

    /// The status with the live fields filled in (time, peers and handshakes, buffered
    /// evidence), written to disk. Needs only `&self`, so it also runs while a long-poll waits.
    fn snapshot(&self) -> AgentStatus {
        let mut status = self.status.clone();
        status.updated_at = unix_now();
        status.peers = self.installer.executor().peers();
        status.paths = self.installer.executor().path_status();
        status.buffered_evidence = self.evidence.pending().len();
        status.certificates = self.certs.status().to_vec();
        status.ingress = self.ingress.lock().expect("ingress").status().cloned();
        let _ = status.save(&self.opts.state_dir);
        self.metrics.status(&status);
        status
    }

    /// A bundle verified against what this node holds, and whether the next key signed it; one
    /// from a restored controller that forgot a revocation is refused as one that fails
    /// verification is, before anything is written (ADR 0024).
    fn verify(&self, bytes: &[u8]) -> Result<(trellis_core::bundle::Verified, bool), String> {
        let (v, by_next) = self.keys.verify(bytes, &self.id, self.applied()).map_err(|e| e.to_string())?;
        self.counts_revocations(v, by_next)
    }

    /// A verified bundle, unless it counts fewer revocations than this node applied (ADR 0024).
    fn counts_revocations(
        &self,
        v: trellis_core::bundle::Verified,
        by_next: bool,
    ) -> Result<(trellis_core::bundle::Verified, bool), String> {
        match self.id.refuses_revocations(trust_of(&v.bundle).as_ref()) {
            Some(why) => Err(why),
            None => Ok((v, by_next)),
        }
    }

    /// The last applied version and digest, for verifying what arrives next.
    fn applied(&self) -> Option<Applied> {
        let m = self.installer.manifest();
        (m.version > 0).then(|| Applied { version: m.version, digest: m.digest() })
    }

    /// Applies one saved bundle (as `fetch` saved it) the way `run` applies what it pulls, and
    /// reports the outcome as evidence; a bundle already held is written and applied again.
    /// Returns the evidence record.
    pub async fn apply_file(mut self, file: &Path) -> Result<Option<proto::Evidence>> {
        let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
        let (v, by_next) = self.verify(&bytes).map_err(|e| anyhow::anyhow!("{}: refused: {e}", file.display()))?;
        if let Err(e) = self.resume().await {
            tracing::error!("re-applying the running bundle first failed: {e:#}");
        }
        // Applied even when it is the bundle held: `apply` also repairs files changed by hand.
        let ev = self.apply(v, true, by_next).await;
        if let Some(ev) = &ev {
            self.evidence.push(ev.clone())?;
        }
        if let Err(e) = self.flush_evidence().await {
            tracing::warn!("evidence kept for later: {e:#}");
        }
        self.save_status();
        Ok(ev)
    }

    /// Pulls and applies until stopped (or `max_applies`), in a span that names the node.
    pub async fn run(self) -> Result<()> {
        use tracing::Instrument;
        let span = tracing::info_span!("agent", node = %self.id.node, mesh = %self.id.mesh);
        self.run_loop().instrument(span).await
    }

    /// A certificate renewal when one is due (under the next CA during a CA rotation); a new
    /// certificate makes a new client.
    async fn renew_certificate(&mut self) {
        // During a CA rotation the certificate is renewed under the next CA at once.
        let onto_next_ca = identity::needs_next_ca_certificate(&self.opts.state_dir);
        match identity::renew_if_due(&self.opts.state_dir, &self.client, onto_next_ca).await {
            // Only a new certificate needs a new client; otherwise the connection is reused.
            Ok(true) => match identity::node_client(&self.opts.state_dir, &self.id) {
                Ok(c) => self.client = c,
                Err(e) => tracing::error!("loading the renewed certificate: {e:#}"),
            },
            Ok(false) => {}
            Err(e) => tracing::warn!("certificate renewal: {e:#}"),
        }
    }

    /// The long-poll, and meanwhile the status refreshed every ten seconds (so `trellis-agent
    /// status` shows live peers and handshakes), prompted peers followed up, direct paths tended
    /// (ADR 0032) and the ingress tended. `None` when the poll was cut short: a service
    /// certificate due, a path or the ingress to report now (the poll only reads, so dropping it
    /// loses nothing).
    async fn wait_for_answer(&self, certs_due: Option<i64>) -> Option<Polled> {
        let certs_wake = tokio::time::sleep(Duration::from_secs(certs_due.map_or(0, |at| (at - unix_now()).max(0) as u64)));
        tokio::pin!(certs_wake);
        {
            // While the long-poll waits, the status file is refreshed every ten seconds so
            // that `trellis-agent status` shows live peers and handshakes, and peers prompted
            // without a handshake yet are followed up (`Executor::follow_up`).
            let poll = self.poll();
            tokio::pin!(poll);
            let mut tick = tokio::time::interval(Duration::from_secs(10));
            tick.tick().await;
            loop {
                let follow_up = self.installer.executor().next_follow_up();
                let due = tokio::time::sleep_until(follow_up.unwrap_or_else(std::time::Instant::now).into());
                let paths_check = self.installer.executor().next_path_check();
                let paths_due = tokio::time::sleep_until(paths_check.unwrap_or_else(std::time::Instant::now).into());
                tokio::select! {
                    p = &mut poll => break Some(p),
                    // A direct path moved (or a hub's peers' endpoints): shown and reported
                    // now, not when the poll returns (ADR 0032).
                    _ = paths_due, if paths_check.is_some() => {
                        if self.installer.executor().tend_paths() {
                            self.snapshot();
                            break None;
                        }
                    }
                    _ = &mut certs_wake, if certs_due.is_some() => break None,
                    _ = tick.tick() => {
                        // A ruleset flushed behind the agent's back (a restart of Debian's
                        // nftables) is back within a tick, not at the next bundle.
                        self.installer.executor().reconcile();
                        self.tend_ingress();
                        self.snapshot();
                        // A router or certificate changed: reported now, not when the poll returns.
                        if self.ingress_changed() {
                            break None;
                        }
                    }
                    _ = due, if follow_up.is_some() => { self.installer.executor().follow_up(); }
                }
            }
        }
    }

    /// What the controller answered, taken: a bundle verified and applied (whether it was a
    /// redelivery of what is held, or refused: then the rest of the poll is waited out), contact
    /// and freshness noted, failures counted for the backoff.
    async fn take_answer(&mut self, polled: Polled, failures: &mut u32, applies: &mut u64) -> Result<bool> {
        let mut redelivered = false;
        if polled.answered {
            self.status.last_contact = Some(unix_now());
        }
        if let Some(at) = polled.fresh_at {
            self.status.fresh_at = Some(self.status.fresh_at.map_or(at, |f| f.max(at)));
        }
        if let Some(skew) = polled.skew {
            tracing::warn!("{skew}");
            self.status.last_error = Some(skew);
        }
        match polled.body {
            Ok(Some(received)) => {
                *failures = 0;
                let checked = match received {
                    Received::Whole(bytes) => self.verify(&bytes),
                    Received::Built(v, by_next) => self.counts_revocations(v, by_next),
                    Received::Refused(e) => Err(e),
                };
                match checked {
                    Ok((v, _)) if v.redelivery && self.installer.intact() => redelivered = true,
                    // What is held, again, when its files are not as it says: written whole.
                    Ok((v, by_next)) => {
                        let again = v.redelivery || !self.installer.intact();
                        if let Some(ev) = self.apply(v, again, by_next).await {
                            let dropped = self.evidence.push(ev)?;
                            self.status.dropped_evidence += dropped;
                            *applies += 1;
                        }
                    }
                    Err(e) => {
                        // Refused before anything was written: the previous files stay.
                        // Asked again at once, the controller would answer the same
                        // bundle at once (a witness it does not believe, say): the rest
                        // of the poll is waited out, as for a redelivery.
                        tracing::error!("refused a bundle: {e}");
                        self.status.last_error = Some(format!("refused a bundle: {e}"));
                        redelivered = true;
                    }
                }
            }
            Ok(None) => *failures = 0,
            Err(e) => {
                *failures += 1;
                self.status.last_error = Some(format!("{e:#}"));
            }
        }
        Ok(redelivered)
    }

    async fn run_loop(mut self) -> Result<()> {
        // Aborted when the loop returns.
        let _metrics = match &self.opts.metrics_listen {
            Some(listen) => {
                let listener = crate::metrics::bind(listen).await?;
                Some(AbortOnDrop(tokio::spawn(crate::metrics::serve(listener, self.metrics.clone()))))
            }
            None => None,
        };
        if let Err(e) = self.resume().await {
            self.status.last_error = Some(format!("resuming: {e:#}"));
            tracing::error!("resuming the last bundle failed: {e:#}");
        }
        self.save_status();
        let mut failures: u32 = 0;
        // Whether to tell the controller again what this node applied last: at the start, and
        // after every outage, since a controller restored from a snapshot lost what it had
        // acknowledged (and would show this node stale until its next bundle).
        let mut reassure = true;
        let mut applies = 0u64;
        loop {
            self.renew_certificate().await;
            // Evidence waiting from before (an outage, a restart) goes out before the next long
            // poll, which may hold the connection for most of a minute.
            let _ = self.flush_evidence().await;
            if reassure {
                reassure = !self.reassure().await;
            }
            let applied_before = applies;
            // A service certificate due while the long-poll waits cuts it short (it only reads,
            // so dropping it loses nothing): a short-lived certificate is renewed at its time,
            // not up to a minute late, when the poll would have returned.
            let certs_due = (self.installer.manifest().version > 0).then(|| self.certs.next_due());
            let asked = std::time::Instant::now();
            let mut redelivered = false;
            let polled = self.wait_for_answer(certs_due).await;
            if let Some(polled) = polled {
                redelivered = self.take_answer(polled, &mut failures, &mut applies).await?;
            }
            // Service certificates: at once after a new bundle (a module may have come or gone),
            // else when one is due or the list is to be asked for again.
            if self.installer.manifest().version > 0 {
                let applied = applies > applied_before;
                self.certs.tend(&self.client, unix_now(), applied).await;
                self.certs.report(&self.client).await;
            }
            self.report_ingress().await;
            self.report_paths().await;
            reassure |= failures > 0;
            if let Err(e) = self.flush_evidence().await {
                if failures == 0 {
                    self.status.last_error = Some(format!("evidence: {e:#}"));
                }
            }
            self.save_status();
            // Also when no tick came: a poll refused at once (the controller away) waits out its
            // backoff without ticking.
            self.installer.executor().reconcile();
            if self.opts.max_applies > 0 && applies >= self.opts.max_applies {
                return Ok(());
            }
            if failures > 0 {
                self.installer.executor().rest(crate::backoff::delay(failures, self.opts.max_backoff, rand::random::<f64>())).await;
            } else if redelivered {
                // Answered at once with what it holds: whatever made the controller do so (a
                // fault, a tag it cannot read), asking again at once would do it again, in a
                // loop; the rest of the poll's wait is waited out here.
                self.installer.executor().rest(rest_of_wait(Duration::from_secs(self.opts.wait), asked.elapsed())).await;
            }
        }
    }
}

/// What is left of a long-poll's `wait` after `elapsed`, at least a second (a poll that asks
/// for no wait is not made to spin either).
fn rest_of_wait(wait: Duration, elapsed: Duration) -> Duration {
    wait.saturating_sub(elapsed).max(Duration::from_secs(1))
}

/// A background task that ends with its owner.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A refusal that sending again will not change: the request itself is wrong.
fn refused_for_good(e: &trellis_client::Error) -> bool {
    e.refused().is_some_and(|r| matches!(r.status, 400 | 413 | 422))
}

fn evidence_error(e: trellis_client::Error) -> anyhow::Error {
    match e {
        trellis_client::Error::Refused(_) | trellis_client::Error::Answered { .. } => {
            anyhow::anyhow!("the controller refused evidence: {e}")
        }
        e => e.into(),
    }
}

/// A refused bundle request, as the agent reports it.
fn answered(e: trellis_client::Error) -> anyhow::Error {
    match e {
        trellis_client::Error::Refused(r) => anyhow::anyhow!("the controller answered {}: {r}", r.status),
        trellis_client::Error::Answered { status, text } => anyhow::anyhow!("the controller answered {}: {text}", status.as_u16()),
        e => e.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::{fresh, rest_of_wait};
    use std::time::Duration;

    /// The review of ADR 0033: the agent keeps a bundle's head, not its bytes, and reads the files
    /// back at start. One stopped after writing the files of the bundle it applied and before
    /// taking its head holds that bundle (its head was written first, as `bundle.head.next`); a
    /// file changed by hand, through a link, or of another mode holds none, in a sentence naming it.
    #[test]
    fn the_bundle_held_is_its_head_and_the_files_and_a_stop_between_them_holds_the_new_one() {
        use base64::Engine;
        use trellis_core::bundle::{Bundle, BundleFile};
        let dir = trellis_testing::TempDir::new("agent-held");
        let (state, root) = (dir.path().join("state"), dir.path().join("root"));
        std::fs::create_dir_all(root.join("etc/trellis")).unwrap();
        std::fs::create_dir_all(&state).unwrap();
        let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]);
        let id = crate::state::Identity {
            node: "db-1".into(),
            mesh: "basic".into(),
            controllers: vec!["https://192.0.2.1:8443".into()],
            signing_public_key: base64::engine::general_purpose::STANDARD.encode(key.verifying_key().as_bytes()),
            next_signing_public_key: None,
            state: trellis_proto::EnrolledState::Active,
            revocations: 0,
        };
        let keys = id.signing_keys().unwrap();
        let bundle = |version: u64, conf: &str| Bundle {
            mesh: "basic".into(),
            node: "db-1".into(),
            version,
            issued_at: 1,
            files: vec![
                BundleFile::new("etc/trellis/node.toml", 0o644, &b"node = 1\n"[..]),
                BundleFile::new("etc/trellis/wireguard.conf", 0o600, conf.as_bytes().to_vec()),
            ],
        };
        let write = |b: &Bundle| {
            for f in &b.files {
                let p = root.join(&f.path);
                let _ = std::fs::remove_file(&p);
                std::fs::write(&p, &f.content).unwrap();
                std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(f.mode)).unwrap();
            }
        };
        let (v1, v2) = (bundle(1, "[Interface]\n"), bundle(2, "[Interface]\nListenPort = 1\n"));
        std::fs::write(state.join(super::HELD_HEAD), &v1.sign(&key).head).unwrap();
        write(&v1);
        let held = || super::last_bundle(&state, &root, &keys, &id);
        assert_eq!(held().unwrap(), Some(v1.clone()));
        // Stopped between the files and the head.
        std::fs::write(state.join(super::HELD_HEAD_NEXT), &v2.sign(&key).head).unwrap();
        write(&v2);
        assert_eq!(held().unwrap(), Some(v2.clone()), "the files are the new bundle's");
        // Stopped before the files: the old ones, the old head.
        write(&v1);
        assert_eq!(held().unwrap(), Some(v1.clone()));
        std::fs::remove_file(state.join(super::HELD_HEAD_NEXT)).unwrap();
        // A file changed by hand, another mode, a link to a device that never ends: none held,
        // in a sentence naming the file, at once.
        let conf = root.join("etc/trellis/wireguard.conf");
        std::fs::write(&conf, "[Interface]\nListenPort = 9\n").unwrap();
        let e = held().unwrap_err().to_string();
        assert!(e.contains("etc/trellis/wireguard.conf"), "{e}");
        write(&v1);
        std::fs::set_permissions(&conf, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        let e = held().unwrap_err().to_string();
        assert!(e.contains("has mode 644, not 600"), "{e}");
        std::fs::remove_file(&conf).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &conf).unwrap();
        let e = held().unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        std::fs::remove_file(&conf).unwrap();
        let fifo = std::ffi::CString::new(conf.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let e = held().unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
    }

    /// Review finding 10: `trellis-agent apply` run while `trellis-agent run` works on the same
    /// state directory raced it (two loads of the ruleset, each process's view of the table
    /// wrong after the other's). The second is refused in one sentence before it reads anything
    /// more; once the first is gone, the next goes on.
    #[test]
    fn a_second_agent_on_the_same_state_directory_is_refused_in_one_sentence() {
        use base64::Engine;
        use std::os::fd::AsRawFd;
        let dir = trellis_testing::TempDir::new("agent-lock");
        let (state, root) = (dir.path().join("state"), dir.path().join("root"));
        std::fs::create_dir_all(&state).unwrap();
        std::fs::create_dir_all(&root).unwrap();
        let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]).verifying_key();
        crate::state::Identity {
            node: "db-1".into(),
            mesh: "basic".into(),
            controllers: vec!["https://192.0.2.1:8443".into()],
            signing_public_key: base64::engine::general_purpose::STANDARD.encode(key.as_bytes()),
            next_signing_public_key: None,
            state: trellis_proto::EnrolledState::Active,
            revocations: 0,
        }
        .save(&state)
        .unwrap();
        let agent = || {
            let opts = super::Options {
                state_dir: state.clone(),
                root: root.clone(),
                files_only: true,
                wait: 0,
                max_applies: 0,
                max_backoff: 1,
                dns_port: 53,
                metrics_listen: None,
                ingress: crate::ingress::IngressMode::None,
                ingress_api: "127.0.0.1:9180".parse().unwrap(),
            };
            let backends = crate::exec::Backends::host(&root, &state, crate::host::WgMode::None, true);
            super::Agent::new(opts, backends).err().map(|e| e.to_string()).unwrap_or_default()
        };
        // The lock a running agent holds, taken as any process takes it.
        let held = std::fs::File::create(state.join("agent.lock")).unwrap();
        // SAFETY: flock on a descriptor this test holds open.
        assert_eq!(unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) }, 0);
        assert_eq!(
            agent(),
            format!("another trellis-agent holds the state directory {}: stop it, or wait for its apply to end", state.display())
        );
        drop(held);
        // This directory has no certificate, which is as far as the next gets.
        let e = agent();
        assert!(!e.contains("another trellis-agent"), "{e}");
    }

    #[test]
    fn a_redelivery_waits_out_the_rest_of_the_poll() {
        assert_eq!(rest_of_wait(Duration::from_secs(55), Duration::from_millis(10)), Duration::from_millis(54_990));
        assert_eq!(rest_of_wait(Duration::from_secs(55), Duration::from_secs(60)), Duration::from_secs(1));
        assert_eq!(rest_of_wait(Duration::ZERO, Duration::ZERO), Duration::from_secs(1));
    }

    /// Clock skew (issue 21, item 3): a stamp up to five minutes from this node's clock is the
    /// controller's newest word; further, either way, is refused with a sentence naming the skew.
    #[test]
    fn a_freshness_stamp_further_than_five_minutes_from_this_clock_is_refused_naming_the_skew() {
        let now = 1_900_000_000;
        for within in [0, 300, -300, 299, -1] {
            assert_eq!(fresh(now + within, now), Ok(now + within), "{within} s");
        }
        assert_eq!(
            fresh(now + 432, now),
            Err("the controller's freshness stamp is 7 min 12 s ahead of this node's clock, more than the 300 s tolerated: set the clocks (NTP)"
                .into())
        );
        assert!(
            fresh(now - 301, now).is_err_and(|e| e.starts_with("the controller's freshness stamp is 5 min 1 s behind this node's clock"))
        );
    }
}

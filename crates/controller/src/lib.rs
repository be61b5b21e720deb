//! The controller's decisions, with no HTTP in them: apply a declaration, issue and redeem
//! tokens, enrol and renew nodes, approve and revoke them (following a revocation until every
//! peer dropped the key), the roster and status, evidence, and
//! publishing signed bundles. Records live in `trellis-store`; policy is computed by
//! `trellis-core`; `trellis-server` adapts HTTP requests to the functions here. The clock and the
//! randomness are injected, so every decision can be tested in process with fixed values.

pub mod audit;
pub mod authority;
pub mod bundle;
pub mod certs;
mod declarations;
mod enrolment;
mod error;
mod housekeeping;
mod ingress;
pub mod layout;
mod ledger;
pub mod memory;
pub mod metrics;
mod nodes;
mod paths;
pub mod pools;
pub mod publish;
mod refusals;
mod restore;
mod revocations;
mod rotation;
pub mod state;
mod tokens;
mod trust;
pub mod view;

use std::sync::Arc;

use trellis_store::Store;

pub use bundle::{BundleAnswer, BundleRequest};
pub use certs::ServiceCertRefusal;
pub use enrolment::NodeIdentity;
pub use error::{Error, NodeRefusal, Redemption, Result};
pub use publish::Published;

/// The time, in Unix seconds. Injected so that expiry and renewal are tested without waiting.
pub trait Clock: Send + Sync {
    fn now(&self) -> i64;
}

/// The system's clock.
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> i64 {
        unix_now()
    }
}

pub use trellis_files::unix_now;

/// How many certificates a node may be issued (its own, or one service's) in a third of their
/// lifetime: a renewal, one under a CA announced, one for names changed, one for files lost; the
/// next waits for the window (each issuance is audited).
pub const ISSUES_PER_THIRD: u32 = 4;

/// The window of [`ISSUES_PER_THIRD`] for certificates living `lifetime_secs`.
pub(crate) fn issue_window(lifetime_secs: u64) -> i64 {
    (lifetime_secs / 3).max(60) as i64
}

/// Where token ids and secrets come from. Injected so that tests can name what they expect.
pub trait Entropy: Send + Sync {
    fn fill(&self, buf: &mut [u8]);
}

/// The operating system's random number generator.
pub struct OsEntropy;

impl Entropy for OsEntropy {
    fn fill(&self, buf: &mut [u8]) {
        use rand::RngCore;
        rand::rngs::OsRng.fill_bytes(buf);
    }
}

/// The keys a controller decides with.
pub struct Keys {
    pub ca: trellis_pki::Ca,
    /// Signs service certificates (ADR 0023); none in a state directory made before them.
    pub services: Option<trellis_pki::ServicesCa>,
    /// Signs every bundle and freshness stamp.
    pub signing_key: ed25519_dalek::SigningKey,
    /// SHA-256 of the admin credential.
    pub admin_sha256: [u8; 32],
}

/// One controller: its records, keys, configuration, the bundles it publishes, and its clock.
/// Callers reach all of them through its methods.
pub struct Controller {
    store: Store,
    config: state::Config,
    /// SHA-256 of the admin credential.
    admin_sha256: [u8; 32],
    /// The mesh CA (and the next one during a rotation), the services CA and the server
    /// certificate (see `authority`).
    authority: std::sync::RwLock<authority::Authority>,
    /// Moves when what the server presents or accepts changes.
    tls_generation: std::sync::atomic::AtomicU64,
    /// Held while the CAs or the server certificate change (a rotation's request, a publish
    /// run, the renewal), so that no two change them, or their files, at once.
    cert_changes: std::sync::Mutex<()>,
    publisher: publish::Publisher,
    /// The parsed declaration of the newest revision seen, with its nodes indexed, keyed by its
    /// number. A cache only: the database says which revision is current.
    declaration: tokio::sync::Mutex<Option<(i64, Arc<trellis_core::decl::Indexed>)>>,
    /// The declaration an apply is storing, by the digest of its files: a publish run (or any
    /// request) that finds that revision current before the apply has put it in `declaration`
    /// takes it from here instead of reading and parsing the stored files again.
    applying: std::sync::Mutex<Option<(String, Arc<trellis_core::decl::Indexed>)>>,
    /// The address allocation stored with a revision, keyed by its number and digest: an apply
    /// allocates from it and writes the rows by difference, a pool member is placed around it,
    /// neither reading the whole addresses table. A cache only, like `declaration`.
    allocation: tokio::sync::Mutex<Option<(i64, String, Arc<trellis_core::Allocation>)>>,
    /// `mesh.toml`'s node tables as last loaded, parsed, by their text: a load parses only the
    /// ones whose text changed (ADR 0034).
    load_cache: std::sync::Mutex<trellis_core::load::LoadCache>,
    /// What the last apply's check held of its topology, with the allocation it was made with:
    /// the next check edits it where the declaration changed (ADR 0034).
    check_held: std::sync::Mutex<Option<(Arc<trellis_core::Allocation>, trellis_core::topology::Held)>>,
    clock: Arc<dyn Clock>,
    entropy: Arc<dyn Entropy>,
    /// Where the signed checkpoint of the audit head is kept, outside the database.
    checkpoint: Option<std::path::PathBuf>,
    /// The sequence number last signed into it, once known; one signer at a time.
    checkpoint_seq: tokio::sync::Mutex<Option<i64>>,
    /// The highest bundle version this state directory published, kept outside the database
    /// beside the checkpoint (see `restore`), and the value last written there.
    high_water: Option<(std::path::PathBuf, std::sync::atomic::AtomicI64)>,
    /// Refused redemptions per source (audited, counted, or turned away).
    refusals: refusals::Refusals,
    /// Set once when the controller stops serving: long-polls answer at once.
    stopping: tokio::sync::watch::Sender<bool>,
    /// What decisions, publish runs and the HTTP edge count (see `metrics`).
    metrics: metrics::Metrics,
    /// The current declaration with its pools' members (see `pools`).
    members_cache: pools::MembersCache,
    /// Whether evidence may have completed a revocation (see `revocations`).
    revocations: revocations::Tracking,
    /// The protocol and release each node's agent last said here (`Controller::hello`): only a
    /// change is written to the database.
    agents: std::sync::Mutex<std::collections::HashMap<String, (String, String)>>,
    /// How far ahead (positive) or behind each node's clock is, for the nodes whose clock is
    /// further from the controller's than tolerated (`Controller::hello`): shown, never refused.
    skews: std::sync::Mutex<std::collections::HashMap<String, i64>>,
    /// When each node's word on what it holds last renumbered its bundle (`bundle_answer`): one
    /// node is believed once in [`bundle::WITNESS_INTERVAL_SECS`].
    witnessed: std::sync::Mutex<std::collections::HashMap<String, i64>>,
    /// Refused service certificates, counted by node as refused enrolments are by source.
    cert_refusals: refusals::Refusals<String>,
    /// The services CA's certificate last looked at, with the name constraints it carries
    /// (`authority`).
    services_scope: std::sync::Mutex<Option<(String, Vec<u8>)>>,
    /// Held while the services CA is scoped: an apply and a publish run both ask, and two that
    /// found it unscoped at once would each certify it, write it and audit it.
    scoping: tokio::sync::Mutex<()>,
    /// Service certificates issued, by node and module, and node certificates renewed, by node:
    /// each is audited, so each is held to a rate.
    cert_issues: refusals::Budget,
    renewals: refusals::Budget,
    /// The keys bundles are signed with now and next (see `trust`).
    signing: std::sync::RwLock<trust::Signing>,
    /// Evidence arrived while a rotation was open: it may have completed it.
    rotation_due: std::sync::atomic::AtomicBool,
    /// The state directory, where the next and retired signing keys are kept (none in process).
    state_dir: Option<std::path::PathBuf>,
    /// The names the server certificate carries, given to nodes with the controller list.
    server_names: Vec<String>,
}

impl Controller {
    pub fn new(store: Store, config: state::Config, keys: Keys, clock: Arc<dyn Clock>, entropy: Arc<dyn Entropy>) -> Controller {
        let Keys { ca, services, signing_key, admin_sha256 } = keys;
        Controller {
            authority: std::sync::RwLock::new(authority::Authority::new(ca, services)),
            admin_sha256,
            tls_generation: Default::default(),
            cert_changes: Default::default(),
            store,
            config,
            signing: std::sync::RwLock::new(trust::Signing { current: signing_key, next: None }),
            rotation_due: Default::default(),
            state_dir: None,
            server_names: Vec::new(),
            publisher: publish::Publisher::default(),
            declaration: Default::default(),
            applying: Default::default(),
            allocation: Default::default(),
            load_cache: Default::default(),
            check_held: Default::default(),
            clock,
            entropy,
            checkpoint: None,
            checkpoint_seq: Default::default(),
            high_water: None,
            refusals: refusals::Refusals::new(refusals::RefusalLimits::default()),
            stopping: tokio::sync::watch::Sender::new(false),
            metrics: metrics::Metrics::new(),
            members_cache: Default::default(),
            revocations: Default::default(),
            agents: Default::default(),
            skews: Default::default(),
            witnessed: Default::default(),
            cert_refusals: refusals::Refusals::new(refusals::RefusalLimits {
                window_secs: 600,
                audited: 5,
                turn_away_after: 30,
                sources: 100_000,
            }),
            services_scope: Default::default(),
            scoping: Default::default(),
            cert_issues: refusals::Budget::new(ISSUES_PER_THIRD),
            renewals: refusals::Budget::new(ISSUES_PER_THIRD),
        }
    }

    /// The controller is stopping: whatever waits on [`Controller::stopping`] stops waiting.
    pub fn stop(&self) {
        self.stopping.send_replace(true);
    }

    /// Resolves when the controller stops (at once if it has).
    pub fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut r = self.stopping.subscribe();
        async move {
            let _ = r.wait_for(|s| *s).await;
        }
    }

    /// Keeps a signed checkpoint of the audit head in this file (see `audit`).
    fn with_checkpoint(mut self, path: std::path::PathBuf) -> Controller {
        self.checkpoint = Some(path);
        self
    }

    /// Keeps the highest bundle version published in this file (see `restore`).
    fn with_high_water(mut self, path: std::path::PathBuf) -> Controller {
        let mark = restore::read_high_water(&path);
        self.high_water = Some((path, std::sync::atomic::AtomicI64::new(mark)));
        self
    }

    /// The controller a state directory describes, on the system clock and randomness. Opens the
    /// store (running migrations); `database_url` overrides the configured one. A database
    /// behind the controller's own signed audit checkpoint (restored from an older backup) is
    /// refused with what to do, unless `restored` says the operator restored it: then every
    /// version moves past the high-water mark and the restore is audited (ADR 0024).
    pub async fn open(state: &state::StateDir, database_url: Option<&str>, restored: bool) -> anyhow::Result<Controller> {
        use anyhow::Context;
        let url = database_url.unwrap_or(&state.config.database_url);
        let store = Store::open(url).await.with_context(|| format!("cannot open the database {}", state::redact(url)))?;
        authority::finish_promotion(&state.dir).context("completing the promotion of the next CA")?;
        let ca = trellis_pki::Ca::load(&state.read(layout::CA_CERT)?, &state.read(layout::CA_KEY)?)
            .with_context(|| format!("{} and {} do not hold the mesh CA", state.path(layout::CA_CERT).display(), layout::CA_KEY))?;
        authority::repair_services(&state.dir, &ca).context("checking the services CA")?;
        let admin_sha256: [u8; 32] = hex::decode(&state.config.admin_token_sha256)
            .ok()
            .and_then(|b| b.try_into().ok())
            .context("admin_token_sha256 in controller.toml is not 64 hex digits")?;
        let keys = Keys { ca, services: state.services_ca()?, signing_key: state.signing_key()?, admin_sha256 };
        let mut c = Controller::new(store, state.config.clone(), keys, Arc::new(SystemClock), Arc::new(OsEntropy))
            .with_checkpoint(state.path(layout::CHECKPOINT))
            .with_high_water(state.path(layout::HIGH_WATER));
        c.state_dir = Some(state.dir.clone());
        let mut server = trellis_pki::Pair { cert_pem: state.read(layout::SERVER_CERT)?, key_pem: state.read(layout::SERVER_KEY)? };
        if !trellis_pki::key_matches_cert(&server.key_pem, &server.cert_pem) {
            // Stopped between writing a renewed key and its certificate: made again.
            tracing::warn!("{} is not the key of {}; the server certificate is made again", layout::SERVER_KEY, layout::SERVER_CERT);
            let hosts: Vec<String> = state.config.advertise.iter().filter_map(|a| state::split_host_port(a).ok().map(|(h, _)| h)).collect();
            let ca = trellis_pki::Ca::load(&state.read(layout::CA_CERT)?, &state.read(layout::CA_KEY)?)?;
            let now = std::time::SystemTime::now();
            server = ca.server_cert(&hosts, now, std::time::Duration::from_secs(state.config.server_cert_secs), rand::random())?;
            trellis_files::replace(&state.path(layout::SERVER_KEY), server.key_pem.as_bytes(), 0o600)?;
            trellis_files::replace(&state.path(layout::SERVER_CERT), server.cert_pem.as_bytes(), 0o644)?;
        }
        if let Ok(info) = trellis_pki::services::inspect_service(&server.cert_pem) {
            c.server_names = info.dns.into_iter().chain(info.ips.iter().map(|ip| ip.to_string())).collect();
        }
        c.set_server(server);
        c.start_after_restore(restored).await?;
        let reapplied = c.reapply_ledger().await?;
        if reapplied > 0 {
            tracing::warn!("{reapplied} revocation(s) the database had lost were made again from {}", state.path(layout::LEDGER).display());
        }
        c.resume_ca_rotation().await?;
        Ok(c)
    }

    /// The time on the controller's clock.
    pub(crate) fn now(&self) -> i64 {
        self.clock.now()
    }

    /// The newest audit sequence number (see `Store::audit_head`).
    pub async fn audit_head(&self) -> Result<i64> {
        Ok(self.store.audit_head().await?)
    }

    /// The store, for tests that look at or change the records underneath the decisions.
    #[cfg(feature = "testing")]
    pub fn store(&self) -> &Store {
        &self.store
    }

    fn random<const N: usize>(&self) -> [u8; N] {
        let mut b = [0u8; N];
        self.entropy.fill(&mut b);
        b
    }

    /// Checks the admin credential, in constant time.
    pub fn authenticate_admin(&self, given: Option<&str>) -> Result<()> {
        use sha2::{Digest, Sha256};
        use subtle::ConstantTimeEq;
        let given = given.ok_or(Error::AdminRequired)?;
        let digest: [u8; 32] = Sha256::digest(given.trim().as_bytes()).into();
        if bool::from(digest.ct_eq(&self.admin_sha256)) {
            Ok(())
        } else {
            Err(Error::AdminDenied)
        }
    }
}

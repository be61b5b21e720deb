//! Installing one verified bundle: plan it against what is held and observed, have the executor
//! carry the plan out, then either remember the bundle (its bytes and the manifest) or, on
//! failure, put the previous bundle's files back and apply its configuration again. Reports
//! evidence.

use std::path::{Path, PathBuf};

use anyhow::Result;
use trellis_core::bundle::{Bundle, Edited};
use trellis_proto as proto;

use crate::exec::Executor;
use crate::plan::{plan, text_changes, Action, Changes, ConfRead, Held, Observed, Scope};
use crate::state::Manifest;
use crate::statedir::{HELD_HEAD, HELD_HEAD_NEXT, LAST_BUNDLE};

/// Writes `bytes` to `path`, created with mode 0600, not synced.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path)?;
    f.write_all(bytes)
}

/// What the manifest says is held, for the plan.
fn held(m: &Manifest) -> Held {
    let digest = |hex: &str| <[u8; 32]>::try_from(hex::decode(hex).unwrap_or_default()).unwrap_or_default();
    Held {
        version: m.version,
        digest: m.digest().unwrap_or_default(),
        files: m.files.iter().map(|f| (f.path.clone(), digest(&f.sha256), f.mode)).collect(),
    }
}

pub struct Installer {
    exec: Executor,
    scope: Scope,
    state_dir: PathBuf,
    manifest: Manifest,
    /// The bundle last applied, verified, to fall back to.
    previous: Option<Bundle>,
    /// The version and digest whose network configuration is in place, as far as this process knows.
    network: Option<(u64, [u8; 32])>,
    /// Milliseconds from the start of the last apply to its files written and network updated.
    pub last_apply_ms: Option<u64>,
    /// The last `wireguard.conf` a plan read (ADR 0037).
    read: Option<ConfRead>,
}

impl Installer {
    pub fn new(exec: Executor, scope: Scope, state_dir: &Path, manifest: Manifest, previous: Option<Bundle>) -> Installer {
        Installer { exec, scope, state_dir: state_dir.to_path_buf(), manifest, previous, network: None, last_apply_ms: None, read: None }
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The bundle held, verified, whose files are on disk: what a delta is built from.
    pub fn previous(&self) -> Option<&Bundle> {
        self.previous.as_ref()
    }

    /// Whether the files the manifest names are known to be on disk as it says: the bundle held
    /// was read back and verified at start, or applied by this process. When not, the next
    /// bundle is asked for whole and written whole, even the same version.
    pub fn intact(&self) -> bool {
        self.manifest.version == 0 || self.previous.is_some()
    }

    pub fn executor(&self) -> &Executor {
        &self.exec
    }

    /// Keeps the `wireguard.conf` these actions bring the interface to, as read: the next plan
    /// reads a change of it by its regions.
    fn keep_read(&mut self, actions: &[Action]) {
        for a in actions {
            if let Action::ConfigureWireguard { read, .. } = a {
                self.read = Some(read.clone());
            }
        }
    }

    fn observed(&self) -> Observed {
        Observed {
            forwarding: self.exec.forwarding(),
            routing: self.exec.routing(),
            network: self.network,
            interface: self.exec.configured(),
            read: self.read.clone(),
        }
    }

    /// Applies the network configuration of the bundle whose files are in place (after a
    /// restart: the interface and ruleset lived in the previous process or were flushed).
    pub async fn resume(&mut self, bundle: &Bundle) -> Result<()> {
        let actions = plan(bundle, &Held::of(bundle), &self.observed(), &self.scope, &Changes::new())?;
        self.keep_read(&actions);
        self.exec.run(&actions).await?;
        self.network = Some((bundle.version, bundle.content_digest()));
        Ok(())
    }

    /// Writes and applies a verified bundle (`head` is its signed head, kept to verify the files
    /// at the next start); on failure restores the previous files and configuration and leaves
    /// the manifest as it was. Returns the evidence, or `None` when the
    /// bundle is what is held and applied already. With `again`, a bundle already held is written
    /// and applied once more (files that drifted on disk are put back) and reported. `edited`:
    /// the files a delta built as edits of held ones (ADR 0035), read by their regions.
    pub async fn apply(&mut self, head: &[u8], bundle: Bundle, now: i64, again: bool, edited: &[Edited]) -> Option<proto::Evidence> {
        let started = std::time::Instant::now();
        let mut evidence = proto::Evidence {
            seq: 0,
            version: bundle.version as i64,
            result: proto::EvidenceResult::Applied,
            error: None,
            files: Vec::new(),
            at: now,
            unmanaged: self.scope.files_only || !self.scope.wireguard,
        };
        let (mut held, mut observed) = (held(&self.manifest), self.observed());
        if again {
            // Every file is written again (one that drifted on disk is put back).
            held.version = 0;
            held.files.iter_mut().for_each(|f| f.1 = [0; 32]);
            observed.network = None;
        }
        let changes = if again { Changes::new() } else { text_changes(self.previous.as_ref(), &bundle, edited) };
        let result = match plan(&bundle, &held, &observed, &self.scope, &changes) {
            Ok(actions) if actions.is_empty() => return None,
            Ok(actions) => {
                self.keep_read(&actions);
                // The new head goes first: should the agent stop after the files and before the
                // head is replaced, the files on disk are the ones this head names. Not synced:
                // a process that stops leaves it to the page cache; a machine that loses power
                // may lose it, and then the files verify against neither head and the next
                // bundle comes whole.
                if let Err(e) = write_private(&self.state_dir.join(HELD_HEAD_NEXT), head) {
                    evidence.result = proto::EvidenceResult::Failed;
                    evidence.error = Some(format!("{e:#}"));
                    return Some(evidence);
                }
                let mut outcomes = Vec::new();
                let result = self.exec.run_into(&actions, &mut outcomes).await;
                // What happened to each file is evidence whether or not the network followed.
                evidence.files = outcomes
                    .iter()
                    .map(|o| proto::EvidenceFile { path: o.path.clone(), sha256: o.sha256.clone(), result: o.result })
                    .collect();
                result
            }
            // Nothing was touched: the bundle could not be planned.
            Err(e) => {
                evidence.result = proto::EvidenceResult::Failed;
                evidence.error = Some(e.to_string());
                return Some(evidence);
            }
        };
        self.last_apply_ms = Some(started.elapsed().as_millis() as u64);
        match result {
            Ok(()) => {
                let manifest = Manifest::of(&bundle);
                // The head only: the files are on disk, and a megabyte bundle is not written twice.
                let saved = std::fs::rename(self.state_dir.join(HELD_HEAD_NEXT), self.state_dir.join(HELD_HEAD))
                    .map_err(anyhow::Error::from)
                    .and_then(|_| manifest.save(&self.state_dir));
                if let Err(e) = saved {
                    // The files are the new bundle's, the manifest may not say so: what is held
                    // is not known, and the next bundle comes whole and is written whole.
                    evidence.result = proto::EvidenceResult::Failed;
                    evidence.error = Some(format!("{e:#}"));
                    self.previous = None;
                    return Some(evidence);
                }
                let _ = std::fs::remove_file(self.state_dir.join(LAST_BUNDLE));
                self.network = Some((bundle.version, bundle.content_digest()));
                self.manifest = manifest;
                self.previous = Some(bundle);
            }
            Err(e) => {
                evidence.result = proto::EvidenceResult::Failed;
                evidence.error = Some(format!("{e:#}"));
                self.network = None;
                let _ = std::fs::remove_file(self.state_dir.join(HELD_HEAD_NEXT));
                self.restore(&bundle).await;
            }
        }
        Some(evidence)
    }

    /// Puts the last good bundle's files back (removing those only the failed one had) and
    /// applies its configuration again.
    async fn restore(&mut self, failed: &Bundle) {
        let Some(previous) = self.previous.clone() else { return };
        let observed = Observed { network: None, ..self.observed() };
        let actions = match plan(&previous, &Held::of(failed), &observed, &self.scope, &Changes::new()) {
            Ok(actions) => {
                self.keep_read(&actions);
                actions
            }
            Err(e) => {
                tracing::error!("cannot re-apply the previous configuration: {e}");
                return;
            }
        };
        let (files, network): (Vec<Action>, Vec<Action>) = actions.into_iter().partition(|a| matches!(a, Action::WriteFiles { .. }));
        if let Err(e) = self.exec.run(&files).await {
            // What is on disk is neither bundle for sure: the next comes whole, written whole.
            tracing::error!("cannot restore the previous files: {e:#}; the next bundle is fetched and written whole");
            self.previous = None;
        }
        match self.exec.run(&network).await {
            Ok(_) => self.network = Some((previous.version, previous.content_digest())),
            Err(e) => tracing::error!("cannot re-apply the previous configuration: {e:#}"),
        }
    }
}

#[cfg(test)]
mod tests {
    //! The apply order, rollback, re-delivery, dropped files and forwarding, with fakes that
    //! record every call in one journal.

    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex};

    use trellis_core::bundle::BundleFile;
    use trellis_core::compile::{MESH_ZONE, NFTABLES_CONF, NODE_TOML, WIREGUARD_CONF};
    use trellis_core::wgconf::WgConf;

    use super::*;
    use crate::dns::{BoxFuture, Resolver};
    use crate::exec::Backends;
    use crate::exec::{FOLLOW_UPS, FOLLOW_UP_DELAYS};
    use crate::host::{FileOutcome, FileWriter, Firewall, Forwarding, Wireguard};
    use crate::status::PeerState;

    type Journal = Arc<Mutex<Vec<String>>>;
    /// The fake host's files, path to content, as committed.
    type Disk = Arc<Mutex<std::collections::BTreeMap<String, String>>>;

    fn note(j: &Journal, s: String) {
        j.lock().unwrap().push(s);
    }

    struct Files(Journal, Disk);
    impl FileWriter for Files {
        fn write_all(&mut self, files: &[BundleFile], dropped: &[String]) -> Result<Vec<FileOutcome>> {
            for f in files {
                note(&self.0, format!("stage {}", f.path));
            }
            note(&self.0, "commit".into());
            let mut disk = self.1.lock().unwrap();
            for f in files {
                disk.insert(f.path.clone(), String::from_utf8_lossy(&f.content).into_owned());
            }
            for d in dropped {
                note(&self.0, format!("remove {d}"));
                disk.remove(d);
            }
            Ok(files
                .iter()
                .map(|f| FileOutcome { path: f.path.clone(), sha256: hex::encode(f.sha256), result: proto::FileResult::Written })
                .collect())
        }
    }

    /// The peers with a handshake, by key, as the fake interface shows them.
    type Shaken = Arc<Mutex<Vec<String>>>;

    /// Changes a peer as the embedded boringtun must: by removing it and adding it again (its
    /// session lost), which it reports.
    /// The changes the fake interface made from a plan's edit (ADR 0037), one line each.
    type Edits = Arc<Mutex<Vec<String>>>;

    struct Wg(Journal, Shaken, Option<Arc<WgConf>>, Vec<String>, Edits);
    impl Wireguard for Wg {
        fn apply(&mut self, conf: &Arc<WgConf>, private_key: &str, edit: Option<&crate::plan::Edit>) -> Result<()> {
            note(&self.0, format!("wireguard {} key {private_key}", conf.addresses.join(",")));
            if let Some(old) = &self.2 {
                if let Some(c) = edit.and_then(|e| e.between(old, conf)).filter(|c| !c.is_empty()) {
                    let keys = |v: &mut dyn Iterator<Item = &Arc<trellis_core::wgconf::WgPeer>>| {
                        v.map(|p| p.public_key[..1].to_string()).collect::<Vec<_>>().join(",")
                    };
                    let line = format!("gone {} changed {}", keys(&mut c.gone.iter()), keys(&mut c.changed.iter().map(|(p, _)| p)));
                    self.4.lock().unwrap().push(line);
                }
                let changed = crate::host::traits::changes_from(old, conf, edit).into_owned().changed;
                self.3 = changed.into_iter().filter(|(_, before)| before.is_some()).map(|(p, _)| p.public_key.clone()).collect();
            }
            self.2 = Some(conf.clone());
            Ok(())
        }
        fn take_sessions_dropped(&mut self) -> Vec<String> {
            std::mem::take(&mut self.3)
        }
        /// Every peer configured, as an interface lists them, with a handshake when it shook.
        fn peers(&self) -> Result<Vec<PeerState>> {
            let shaken = self.1.lock().unwrap();
            let configured = self.2.iter().flat_map(|c| c.peers.iter().map(|p| p.public_key.clone()));
            let at = |k: &String| shaken.contains(k).then_some(crate::unix_now() as u64);
            Ok(configured.map(|k| PeerState::new(k.clone(), None, at(&k))).collect())
        }
        fn describe(&self) -> String {
            "fake".into()
        }
        fn restart_handshakes(&self, public_keys: &[String]) -> Result<()> {
            let first: Vec<String> = public_keys.iter().map(|k| k[..1].to_string()).collect();
            note(&self.0, format!("restart {}", first.join(" ")));
            Ok(())
        }
    }

    /// Loads the committed ruleset unless it says "bad".
    struct Fw(Journal, Disk);
    impl Firewall for Fw {
        fn apply(&mut self, ruleset: &[crate::plan::TextFile]) -> Result<()> {
            assert_eq!(ruleset[0].path, NFTABLES_CONF);
            // What the files committed hold: the ruleset given is theirs.
            let text = self.1.lock().unwrap().get(NFTABLES_CONF).cloned().unwrap_or_default();
            assert_eq!(text.as_bytes(), &ruleset[0].content[..]);
            if text == "bad" {
                note(&self.0, "ruleset refused".into());
                anyhow::bail!("nft refused {}: syntax error", ruleset[0].path);
            }
            note(&self.0, format!("ruleset {text}"));
            Ok(())
        }
        fn loaded(&self) -> bool {
            true
        }
    }

    struct Dns(Journal);
    impl Resolver for Dns {
        fn apply<'a>(
            &'a mut self,
            zone: &'a [crate::plan::TextFile],
            origin: &'a str,
            listen: &'a [SocketAddr],
        ) -> BoxFuture<'a, Result<()>> {
            let mut line = format!("dns {origin} on {}", listen.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(","));
            // A zone in parts (ADR 0043): its files in the order served, those that came as edits
            // marked.
            if zone.len() > 1 {
                let files: Vec<String> =
                    zone.iter().map(|f| format!("{}{}", f.path, if f.change.is_some() { " (edits)" } else { "" })).collect();
                line.push_str(&format!(" from {}", files.join(", ")));
            }
            note(&self.0, line);
            Box::pin(async { Ok(()) })
        }
        fn serving(&self) -> Vec<SocketAddr> {
            Vec::new()
        }
    }

    struct Fwd(Journal, bool);
    impl Forwarding for Fwd {
        fn enabled(&self) -> bool {
            self.1
        }
        fn enable(&mut self) -> Result<()> {
            note(&self.0, "forwarding on".into());
            self.1 = true;
            Ok(())
        }
    }

    struct Rt(Journal, bool);
    impl crate::routes::Routing for Rt {
        fn apply(&mut self, interface: &str, routes: &[ipnet::IpNet], exit: crate::plan::Exit, table: u32) -> Result<()> {
            let routes: Vec<String> = routes.iter().map(|r| r.to_string()).collect();
            note(&self.0, format!("routes {} into {interface}; exit v4 {} v6 {} table {table}", routes.join(" "), exit.ipv4, exit.ipv6));
            self.1 = !routes.is_empty() || exit.any();
            Ok(())
        }
        fn installed(&self) -> bool {
            self.1
        }
    }

    /// Notes every prompt; refuses to send with `fail`.
    struct Prompts(Journal, Arc<Mutex<bool>>);
    impl crate::host::Prompter for Prompts {
        fn prompt(&self, interface: &str, to: &[std::net::IpAddr]) -> Result<()> {
            let to: Vec<String> = to.iter().map(|a| a.to_string()).collect();
            note(&self.0, format!("prompt {interface} {}", to.join(" ")));
            if *self.1.lock().unwrap() {
                anyhow::bail!("cannot send a datagram through {interface}");
            }
            Ok(())
        }
    }

    struct Fixture {
        journal: Journal,
        /// Whether the fake prompter fails.
        prompts_fail: Arc<Mutex<bool>>,
        shaken: Shaken,
        edits: Edits,
        dir: PathBuf,
        applier: Installer,
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn fixture(tag: &str) -> Fixture {
        let dir = std::env::temp_dir().join(format!("trellis-applier-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("wireguard.key"), "PRIVATE\n").unwrap();
        let journal = Journal::default();
        let disk = Disk::default();
        let prompts_fail = Arc::new(Mutex::new(false));
        let j = journal.clone();
        let shaken = Shaken::default();
        let s = shaken.clone();
        let edits = Edits::default();
        let e = edits.clone();
        let backends = Backends {
            files: Box::new(Files(journal.clone(), disk.clone())),
            wireguard: Some(Box::new(move |_: &str| {
                Some(Box::new(Wg(j.clone(), s.clone(), None, Vec::new(), e.clone())) as Box<dyn Wireguard + Send>)
            })),
            firewall: Some(Box::new(Fw(journal.clone(), disk))),
            resolver: Some(Box::new(Dns(journal.clone()))),
            forwarding: Box::new(Fwd(journal.clone(), false)),
            routing: Some(Box::new(Rt(journal.clone(), false))),
            prompter: Some(Box::new(Prompts(journal.clone(), prompts_fail.clone()))),
            reloader: None,
        };
        let exec = Executor::new(backends, dir.join("wireguard.key"));
        let scope = Scope { files_only: false, wireguard: true, dns_port: 53 };
        Fixture { applier: Installer::new(exec, scope, &dir, Manifest::default(), None), journal, prompts_fail, shaken, edits, dir }
    }

    impl Fixture {
        fn take(&self) -> Vec<String> {
            std::mem::take(&mut *self.journal.lock().unwrap())
        }

        async fn apply(&mut self, bundle: &Bundle) -> Option<proto::Evidence> {
            self.applier.apply(format!("bundle {}", bundle.version).as_bytes(), bundle.clone(), 7, false, &[]).await
        }
    }

    fn bundle(version: u64, hub: bool, ruleset: &str, extra: &[&str]) -> Bundle {
        let settings = format!("node = \"db-1\"\nmesh = \"basic\"\ninterface = \"trellis0\"\nzone = \"basic.mesh\"\nhub = {hub}\n");
        let mut files = vec![
            BundleFile::new(NODE_TOML, 0o644, settings.into_bytes()),
            BundleFile::new(WIREGUARD_CONF, 0o600, "[Interface]\nAddress = 10.88.0.5/16\nListenPort = 51820\n".as_bytes().to_vec()),
            BundleFile::new(NFTABLES_CONF, 0o644, ruleset.as_bytes().to_vec()),
            BundleFile::new(MESH_ZONE, 0o644, b"zone".to_vec()),
        ];
        files.extend(extra.iter().map(|p| BundleFile::new(*p, 0o644, b"x".to_vec())));
        Bundle { mesh: "basic".into(), node: "db-1".into(), version, issued_at: 1, files }
    }

    /// The journal of staging and committing `extra` files besides the four a bundle has.
    fn write(extra: &[&str]) -> Vec<String> {
        let mut out: Vec<String> = [NODE_TOML, WIREGUARD_CONF, NFTABLES_CONF, MESH_ZONE].iter().map(|p| format!("stage {p}")).collect();
        out.extend(extra.iter().map(|p| format!("stage {p}")));
        out.push("commit".into());
        out
    }

    fn lines(l: &[&str]) -> Vec<String> {
        l.iter().map(|s| s.to_string()).collect()
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn files_are_committed_before_the_network_then_wireguard_ruleset_dns() {
        rt().block_on(async {
            let mut f = fixture("order");
            let ev = f.apply(&bundle(1, false, "good1", &[])).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Applied, "{ev:?}");
            assert_eq!(ev.at, 7);
            let mut expect = write(&[]);
            expect.extend(lines(&["wireguard 10.88.0.5/16 key PRIVATE", "ruleset good1", "dns basic.mesh on 10.88.0.5:53"]));
            assert_eq!(f.take(), expect);
            assert_eq!(f.applier.manifest().version, 1);
            assert_eq!(load(&f.dir).version, 1, "the manifest is saved");
            assert_eq!(std::fs::read(f.dir.join(HELD_HEAD)).unwrap(), b"bundle 1");
        });
    }

    fn load(dir: &Path) -> Manifest {
        Manifest::load(dir)
    }

    #[test]
    fn a_refused_ruleset_puts_the_previous_bundle_back() {
        rt().block_on(async {
            let mut f = fixture("rollback");
            f.apply(&bundle(1, false, "good1", &["etc/old"])).await.unwrap();
            f.take();
            let before = f.applier.manifest().clone();
            let ev = f.apply(&bundle(2, false, "bad", &["etc/new"])).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Failed);
            assert!(ev.error.as_deref().is_some_and(|e| e.contains("nft refused")), "{ev:?}");
            assert!(
                ev.files.iter().any(|f| f.path == "etc/new" && f.result == proto::FileResult::Written),
                "the files written before the network failed are in the evidence: {ev:?}"
            );
            // Only the files that changed are written (ADR 0033): the ruleset and the new file.
            let mut expect = lines(&["stage etc/trellis/nftables.conf", "stage etc/new", "commit"]);
            expect.extend(lines(&["remove etc/old", "wireguard 10.88.0.5/16 key PRIVATE", "ruleset refused"]));
            // The rollback: the previous files that differ, the failed bundle's own file removed,
            // then the previous configuration applied again in the same order.
            expect.extend(lines(&["stage etc/trellis/nftables.conf", "stage etc/old", "commit"]));
            expect.extend(lines(&[
                "remove etc/new",
                "wireguard 10.88.0.5/16 key PRIVATE",
                "ruleset good1",
                "dns basic.mesh on 10.88.0.5:53",
            ]));
            assert_eq!(f.take(), expect);
            assert_eq!(f.applier.manifest(), &before, "the manifest is unchanged");
            assert_eq!(load(&f.dir), before, "the saved manifest is unchanged");
            assert_eq!(std::fs::read(f.dir.join(HELD_HEAD)).unwrap(), b"bundle 1");
        });
    }

    /// The review of ADR 0033: when the head or the manifest cannot be kept after the files were
    /// written, what is held is not known: the installer says so (the next bundle comes whole and
    /// is written whole), instead of skipping files the old manifest says are held.
    #[test]
    fn a_head_that_cannot_be_kept_leaves_nothing_taken_as_held() {
        rt().block_on(async {
            let mut f = fixture("unkept");
            f.apply(&bundle(1, false, "good1", &[])).await.unwrap();
            assert!(f.applier.intact());
            // The head's place is taken by a directory: the rename fails.
            std::fs::remove_file(f.dir.join(HELD_HEAD)).unwrap();
            std::fs::create_dir_all(f.dir.join(HELD_HEAD).join("x")).unwrap();
            let ev = f.apply(&bundle(2, false, "good2", &[])).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Failed, "{ev:?}");
            assert!(!f.applier.intact(), "the files are not known to be the manifest's");
            assert_eq!(f.applier.manifest().version, 1);
        });
    }

    #[test]
    fn a_redelivery_does_nothing() {
        rt().block_on(async {
            let mut f = fixture("redelivery");
            f.apply(&bundle(1, false, "good1", &[])).await.unwrap();
            f.take();
            assert_eq!(f.apply(&bundle(1, false, "good1", &[])).await, None);
            assert_eq!(f.take(), Vec::<String>::new());
        });
    }

    #[test]
    fn applying_the_held_bundle_again_writes_and_applies_it_and_reports() {
        rt().block_on(async {
            let mut f = fixture("again");
            let b = bundle(1, false, "good1", &[]);
            f.apply(&b).await.unwrap();
            f.take();
            let ev = f.applier.apply(b"bundle 1", b, 8, true, &[]).await.expect("reported");
            assert_eq!((ev.result, ev.at, ev.files.len()), (proto::EvidenceResult::Applied, 8, 4), "{ev:?}");
            let mut expect = write(&[]);
            expect.extend(lines(&["wireguard 10.88.0.5/16 key PRIVATE", "ruleset good1", "dns basic.mesh on 10.88.0.5:53"]));
            assert_eq!(f.take(), expect);
        });
    }

    #[test]
    fn files_the_bundle_dropped_are_removed() {
        rt().block_on(async {
            let mut f = fixture("dropped");
            f.apply(&bundle(1, false, "good1", &["etc/a", "etc/b"])).await.unwrap();
            f.take();
            f.apply(&bundle(2, false, "good2", &["etc/b"])).await.unwrap();
            let journal = f.take();
            assert!(journal.contains(&"remove etc/a".to_string()), "{journal:?}");
            assert!(!journal.iter().any(|l| l == "remove etc/b"), "{journal:?}");
        });
    }

    #[test]
    fn a_hub_enables_forwarding_and_another_node_does_not() {
        rt().block_on(async {
            let mut f = fixture("hub");
            f.apply(&bundle(1, true, "good1", &[])).await.unwrap();
            let journal = f.take();
            let commit = journal.iter().position(|l| l == "commit").unwrap();
            let on = journal.iter().position(|l| l == "forwarding on").unwrap();
            let wg = journal.iter().position(|l| l.starts_with("wireguard")).unwrap();
            let ruleset = journal.iter().position(|l| l.starts_with("ruleset")).unwrap();
            // Forwarding goes on only once the filter is loaded.
            assert!(commit < wg && wg < ruleset && ruleset < on, "{journal:?}");

            let mut g = fixture("spoke");
            g.apply(&bundle(1, false, "good1", &[])).await.unwrap();
            assert!(!g.take().iter().any(|l| l == "forwarding on"));
        });
    }

    /// A bundle of a node that uses a route and an exit, and of a router.
    fn routed_bundle(version: u64, settings_extra: &str, peer_allowed: &str) -> Bundle {
        let mut b = bundle(version, false, "good1", &[]);
        let settings =
            format!("node = \"db-1\"\nmesh = \"basic\"\ninterface = \"trellis0\"\nzone = \"basic.mesh\"\nhub = false\n{settings_extra}");
        b.files[0] = BundleFile::new(NODE_TOML, 0o644, settings.into_bytes());
        let conf = format!(
            "[Interface]\nAddress = 10.88.0.5/16\nListenPort = 51820\n\n[Peer]\nPublicKey = {}\nAllowedIPs = 10.88.0.9/32\nAllowedIPs = {peer_allowed}\n",
            "A".repeat(43) + "="
        );
        b.files[1] = BundleFile::new(WIREGUARD_CONF, 0o600, conf.into_bytes());
        b
    }

    #[test]
    fn routes_and_an_exit_are_installed_after_the_interface_and_removed_when_they_go() {
        rt().block_on(async {
            let mut f = fixture("routes");
            let b = routed_bundle(1, "routes = [\"192.168.10.0/24\"]\nexit = true\n", "192.168.10.0/24, 0.0.0.0/0");
            let ev = f.apply(&b).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Applied, "{ev:?}");
            let journal = f.take();
            let wg = journal.iter().position(|l| l.starts_with("wireguard")).unwrap();
            let routes = journal
                .iter()
                .position(|l| l == "routes 192.168.10.0/24 into trellis0; exit v4 true v6 false table 51820")
                .unwrap_or_else(|| panic!("{journal:?}"));
            assert!(wg < routes, "{journal:?}");
            assert!(!journal.iter().any(|l| l == "forwarding on"), "a user of a route does not forward: {journal:?}");

            // The opt-in and the route go: what was installed is removed.
            f.apply(&routed_bundle(2, "", "10.88.0.10/32")).await.unwrap();
            let journal = f.take();
            assert!(journal.iter().any(|l| l == "routes  into trellis0; exit v4 false v6 false table 51820"), "{journal:?}");
            // Nothing installed, nothing to remove: no routing action at all.
            // (And the same routes and exit again, with other peers, touch nothing: below.)
            f.apply(&routed_bundle(3, "", "10.88.0.11/32")).await.unwrap();
            assert!(!f.take().iter().any(|l| l.starts_with("routes")));

            let mut h = fixture("steady");
            h.apply(&routed_bundle(1, "exit = true\n", "0.0.0.0/0")).await.unwrap();
            assert!(h.take().iter().any(|l| l.starts_with("routes ")));
            // Another peer list, the same exit: the exit's rules are left in place, not taken
            // down and put back (its traffic would leak outside the tunnel meanwhile).
            h.apply(&routed_bundle(2, "exit = true\n", "0.0.0.0/0, 10.88.0.12/32")).await.unwrap();
            let journal = h.take();
            assert!(journal.iter().any(|l| l.starts_with("wireguard")), "{journal:?}");
            assert!(!journal.iter().any(|l| l.starts_with("routes ")), "{journal:?}");

            let mut g = fixture("router");
            g.apply(&routed_bundle(1, "router = true\n", "10.88.0.10/32")).await.unwrap();
            assert!(g.take().iter().any(|l| l == "forwarding on"), "a router forwards");
        });
    }

    /// A bundle whose node has these peers: (key letter, endpoint, overlay address).
    fn peered_bundle(version: u64, peers: &[(char, Option<&str>, &str)]) -> Bundle {
        let mut b = bundle(version, false, "good1", &[]);
        let mut conf = "[Interface]\nAddress = 10.88.0.5/16\nListenPort = 51820\n".to_string();
        for (key, endpoint, ip) in peers {
            conf.push_str(&format!("\n[Peer]\nPublicKey = {}=\nAllowedIPs = {ip}/32\n", key.to_string().repeat(43)));
            if let Some(e) = endpoint {
                conf.push_str(&format!("Endpoint = {e}\n"));
            }
        }
        b.files[1] = BundleFile::new(WIREGUARD_CONF, 0o600, conf.into_bytes());
        b
    }

    /// Peers the interface just got, or dials at another endpoint, are prompted, last, once the
    /// ruleset and the zone are in place; peers it had as they were, or that dial this node, are
    /// not; a prompt that cannot be sent fails nothing.
    #[test]
    fn new_and_moved_peers_are_prompted_after_everything_else() {
        rt().block_on(async {
            let mut f = fixture("prompts");
            let a = ('A', Some("192.0.2.11:51820"), "10.88.0.6");
            let ev = f.apply(&peered_bundle(1, &[a])).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Applied, "{ev:?}");
            let journal = f.take();
            assert_eq!(
                journal[journal.len() - 2..],
                lines(&["dns basic.mesh on 10.88.0.5:53", "prompt trellis0 10.88.0.6"]),
                "{journal:?}"
            );

            let b = ('B', Some("192.0.2.12:51820"), "10.88.0.7");
            f.apply(&peered_bundle(2, &[a, b])).await.unwrap();
            assert_eq!(f.take().last().map(String::as_str), Some("prompt trellis0 10.88.0.7"), "only the new peer");

            let moved = ('A', Some("198.51.100.11:51820"), "10.88.0.6");
            f.apply(&peered_bundle(3, &[moved, b])).await.unwrap();
            assert_eq!(f.take().last().map(String::as_str), Some("prompt trellis0 10.88.0.6"), "only the moved peer");

            let dials_us = ('C', None, "10.88.0.8");
            f.apply(&peered_bundle(4, &[moved, b, dials_us])).await.unwrap();
            let journal = f.take();
            assert!(journal.iter().any(|l| l.starts_with("wireguard")), "{journal:?}");
            assert!(!journal.iter().any(|l| l.starts_with("prompt")), "nothing to prompt: {journal:?}");

            *f.prompts_fail.lock().unwrap() = true;
            let d = ('D', Some("192.0.2.14:51820"), "10.88.0.9");
            let ev = f.apply(&peered_bundle(5, &[moved, b, dials_us, d])).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Applied, "a prompt not sent is no failure: {ev:?}");
            assert_eq!(f.take().last().map(String::as_str), Some("prompt trellis0 10.88.0.9"));
            assert_eq!(f.applier.manifest().version, 5);
        });
    }

    /// `wireguard.conf` came as edits of the file held: the peers change by the plan's edit, read
    /// from the regions (ADR 0037), and the interface, prompts and files are what the whole read
    /// gives. A second change goes on from the first's read; a bundle applied again (no edits)
    /// and one whose edits are of another file are read whole.
    #[test]
    fn a_change_of_peers_in_edits_is_made_from_its_regions() {
        rt().block_on(async {
            let mut f = fixture("edits");
            let peers: Vec<(char, Option<String>, String)> = ('A'..='Z')
                .chain('a'..='z')
                .enumerate()
                .map(|(i, k)| (k, (i % 2 == 0).then(|| format!("192.0.2.{}:51820", 10 + i)), format!("10.88.0.{}", 10 + i)))
                .collect();
            fn view(p: &[(char, Option<String>, String)]) -> Vec<(char, Option<&str>, &str)> {
                p.iter().map(|(k, e, ip)| (*k, e.as_deref(), ip.as_str())).collect()
            }
            let one = peered_bundle(1, &view(&peers));
            f.apply(&one).await.unwrap();
            f.take();
            // C re-keyed as 0 (dialled), G removed, 1 added (dialled), K's endpoint moved.
            let mut after = peers.clone();
            after[2].0 = '0';
            after.remove(6);
            after.insert(12, ('1', Some("192.0.2.99:51820".into()), "10.88.0.99".into()));
            after[9].1 = Some("198.51.100.9:51820".into());
            let two = peered_bundle(2, &view(&after));
            let edited = |from: &Bundle, to: &Bundle| {
                let (old, new) = (&from.files[1], &to.files[1]);
                let edits = trellis_core::delta::edits(&old.content, &new.content);
                let (_, hunks) = trellis_core::delta::rebuild_with_hunks(&old.content, &edits, new.content.len(), WIREGUARD_CONF).unwrap();
                vec![Edited { path: WIREGUARD_CONF.into(), base: old.sha256, hunks: hunks.unwrap().into() }]
            };
            let ev = f.applier.apply(b"bundle 2", two.clone(), 7, false, &edited(&one, &two)).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Applied, "{ev:?}");
            assert_eq!(std::mem::take(&mut *f.edits.lock().unwrap()), ["gone C,G changed 0,K,1"]);
            let journal = f.take();
            let prompts: Vec<&String> = journal.iter().filter(|l| l.starts_with("prompt")).collect();
            // K, whose endpoint moved, lost its session in the fake backend (prompted at once);
            // then 0, K and 1, the peers new or moved that this node dials.
            assert_eq!(prompts, ["prompt trellis0 10.88.0.20", "prompt trellis0 10.88.0.12 10.88.0.20 10.88.0.99"], "{journal:?}");
            let whole = trellis_core::wgconf::parse(std::str::from_utf8(&two.files[1].content).unwrap()).unwrap();
            assert_eq!(*f.applier.executor().configured().unwrap(), whole, "the edit gives the whole read");

            // The next change goes on from this one's read.
            let mut third = after.clone();
            third.remove(0);
            let three = peered_bundle(3, &view(&third));
            f.applier.apply(b"bundle 3", three.clone(), 7, false, &edited(&two, &three)).await.unwrap();
            assert_eq!(std::mem::take(&mut *f.edits.lock().unwrap()), ["gone A changed "]);
            // Edits of a file other than the one held: read whole, and the interface still
            // brought to exactly the new file.
            let four = peered_bundle(4, &view(&peers));
            f.applier.apply(b"bundle 4", four.clone(), 7, false, &edited(&one, &four)).await.unwrap();
            assert!(f.edits.lock().unwrap().is_empty(), "edits of another base are not used");
            let whole = trellis_core::wgconf::parse(std::str::from_utf8(&four.files[1].content).unwrap()).unwrap();
            assert_eq!(*f.applier.executor().configured().unwrap(), whole);
        });
    }

    /// A relayed peer of `paths.toml` promoted on its handshake is probed through the interface
    /// at once, at its overlay address, then once per interval, also in the rest between polls
    /// and when the last probe could not be sent (ADR 0032): the executor sends what the book
    /// asks for.
    #[test]
    fn a_direct_peer_is_probed_through_the_interface_each_interval() {
        let mut f = fixture("probes");
        let hub_key = trellis_core::decl::PublicKey([1; 32]);
        let hub = hub_key.to_string();
        let peer = trellis_core::decl::PublicKey([7; 32]);
        let conf = format!(
            "[Interface]\nAddress = 10.88.0.5/16\nListenPort = 51820\n\n[Peer]\nPublicKey = {hub}\nAllowedIPs = 10.88.0.1/32, 10.88.0.7/32\nEndpoint = 198.51.100.1:51820\n"
        );
        let candidate = trellis_core::paths::Candidate {
            peer: "db-2".into(),
            public_key: peer,
            endpoint: "203.0.113.7:40000".parse().unwrap(),
            hub: "hub-1".into(),
            hub_key,
            allowed_ips: vec!["10.88.0.7/32".into()],
        };
        let mut b = bundle(1, false, "good1", &[]);
        b.files[1] = BundleFile::new(WIREGUARD_CONF, 0o600, conf.into_bytes());
        b.files.push(BundleFile::new(trellis_core::plan::PATHS_TOML, 0o644, trellis_core::paths::write("db-1", &[candidate]).into_bytes()));
        rt().block_on(f.apply(&b)).expect("applied");
        f.shaken.lock().unwrap().push(peer.to_string());
        f.take();
        // The probe is a datagram to the peer alone; the promotion's change of the interface
        // prompts handshakes (and follows them up) through the same prompter, with others.
        let probes = |f: &Fixture| f.take().into_iter().filter(|l| l == "prompt trellis0 10.88.0.7").count();
        let exec = f.applier.executor();
        assert!(exec.tend_paths(), "promoted on the handshake");
        assert_eq!(exec.path_status()[0].state, "direct");
        assert_eq!(probes(&f), 1, "probed at once");
        assert!(!exec.tend_paths());
        assert_eq!(probes(&f), 0, "not again within the interval");
        // The rest between polls (a controller away) tends the paths: the next probe goes out
        // in it, sent or not.
        *f.prompts_fail.lock().unwrap() = true;
        rt().block_on(exec.rest(std::time::Duration::from_millis(crate::paths::PROBE_EVERY_MS + 1_500)));
        assert_eq!(probes(&f), 1, "probed in the rest though the last failed");
        assert_eq!(exec.path_status()[0].state, "direct", "a probe not sent moves no path");
    }

    /// ADR 0039: a node's peers in parts. The interface gets the peers of every part; a change
    /// writes only the parts that changed and removes a part gone, and the plan's edit, from the
    /// parts changed compared by key, is what comparing every peer gives: a peer moved to
    /// another part unchanged is no change.
    #[test]
    fn peers_in_parts_change_by_the_parts_that_changed() {
        use trellis_core::plan::wireguard_part;
        type Peers<'a> = [(char, Option<&'a str>, &'a str)];
        fn parted(version: u64, parts: &[(usize, &Peers)]) -> Bundle {
            let mut b = bundle(version, false, "good1", &[]);
            let conf = "[Interface]\nAddress = 10.88.0.5/16\nListenPort = 51820\n\n# 6 peers, in parts\n";
            b.files[1] = BundleFile::new(WIREGUARD_CONF, 0o600, conf.as_bytes().to_vec());
            for (i, peers) in parts {
                let mut text = format!("# part {i}\n");
                for (key, endpoint, ip) in *peers {
                    text.push_str(&format!("\n[Peer]\nPublicKey = {}=\nAllowedIPs = {ip}/32\n", key.to_string().repeat(43)));
                    if let Some(e) = endpoint {
                        text.push_str(&format!("Endpoint = {e}\n"));
                    }
                }
                b.files.push(BundleFile::new(wireguard_part(*i), 0o600, text.into_bytes()));
            }
            b
        }
        fn whole(b: &Bundle) -> WgConf {
            let mut conf = trellis_core::wgconf::parse(std::str::from_utf8(&b.files[1].content).unwrap()).unwrap();
            let mut parts: Vec<&BundleFile> = b.files.iter().filter(|f| trellis_core::plan::is_part(&f.path)).collect();
            parts.sort_by_key(|f| f.path.clone());
            for f in parts {
                conf.peers.extend(
                    trellis_core::wgconf::read_part(std::str::from_utf8(&f.content).unwrap(), &f.path).unwrap().conf.peers.iter().cloned(),
                );
            }
            conf
        }
        rt().block_on(async {
            let mut f = fixture("parts");
            let (a, b, c) = (('A', Some("192.0.2.1:51820"), "10.88.0.6"), ('B', None, "10.88.0.7"), ('C', None, "10.88.0.8"));
            let (d, e, g) = (('D', None, "10.88.0.9"), ('E', None, "10.88.0.10"), ('F', None, "10.88.0.11"));
            let one = parted(1, &[(3, &[a, b, c]), (7, &[d, e]), (12, &[g])]);
            let ev = f.apply(&one).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Applied, "{ev:?}");
            assert_eq!(*f.applier.executor().configured().unwrap(), whole(&one));
            assert_eq!(f.applier.executor().configured().unwrap().peers.len(), 6);
            f.take();

            // B dials another endpoint, part 7 goes (E with it), D moves to part 20 as it was,
            // G comes in part 12.
            let moved = ('B', Some("192.0.2.2:51820"), "10.88.0.7");
            let new = ('G', Some("192.0.2.3:51820"), "10.88.0.12");
            let two = parted(2, &[(3, &[a, moved, c]), (12, &[g, new]), (20, &[d])]);
            let ev = f.apply(&two).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Applied, "{ev:?}");
            assert_eq!(std::mem::take(&mut *f.edits.lock().unwrap()), ["gone E changed B,G"]);
            assert_eq!(*f.applier.executor().configured().unwrap(), whole(&two), "the parts give the whole read");
            let journal = f.take();
            let files: Vec<&String> = journal.iter().filter(|l| l.starts_with("stage") || l.starts_with("remove")).collect();
            let want = [wireguard_part(3), wireguard_part(12), wireguard_part(20)]
                .map(|p| format!("stage {p}"))
                .into_iter()
                .chain([format!("remove {}", wireguard_part(7))]);
            assert_eq!(files, want.collect::<Vec<_>>().iter().collect::<Vec<_>>(), "only the parts that changed: {journal:?}");
            let prompts: Vec<&String> = journal.iter().filter(|l| l.starts_with("prompt")).collect();
            // B lost its session in the fake backend (prompted at once), then B and G, the peers
            // new or moved that this node dials.
            assert_eq!(prompts, ["prompt trellis0 10.88.0.7", "prompt trellis0 10.88.0.7 10.88.0.12"], "{journal:?}");

            // A part that holds an [Interface] is refused, naming it, and nothing is applied.
            let mut bad = parted(3, &[(3, &[a, moved, c]), (12, &[g, new]), (20, &[d])]);
            let at = bad.files.iter().position(|f| f.path == wireguard_part(20)).unwrap();
            bad.files[at] = BundleFile::new(wireguard_part(20), 0o600, b"[Interface]\nListenPort = 1\n".to_vec());
            let ev = f.apply(&bad).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Failed, "{ev:?}");
            let said = ev.error.clone().unwrap_or_default();
            assert!(said.contains("wireguard.d/peers-20.conf line 1") && said.contains("[Interface]"), "{said}");
            assert_eq!(*f.applier.executor().configured().unwrap(), whole(&two));
        });
    }

    /// ADR 0043: a zone in parts. The resolver is given `mesh.zone` and its parts in order; a
    /// change writes only the parts that changed; a part that holds anything but address records,
    /// or parts without `mesh.zone`, are refused, naming the part, and nothing is written.
    #[test]
    fn a_zone_in_parts_writes_the_parts_that_changed_and_a_part_not_of_records_is_refused() {
        use trellis_core::plan::zone_part;
        let main = "$ORIGIN basic.mesh.\n$TTL 60\n@\tIN\tSOA\tns.basic.mesh. hostmaster.basic.mesh. 1 3600 600 86400 60\n@\tIN\tNS\tns.basic.mesh.\n";
        fn zoned(version: u64, main: Option<&str>, parts: &[(usize, &str)]) -> Bundle {
            let mut b = bundle(version, false, "good1", &[]);
            b.files.retain(|f| f.path != MESH_ZONE);
            b.files.extend(main.map(|m| BundleFile::new(MESH_ZONE, 0o644, m.as_bytes().to_vec())));
            for (i, text) in parts {
                b.files.push(BundleFile::new(zone_part(*i), 0o644, text.as_bytes().to_vec()));
            }
            b
        }
        rt().block_on(async {
            let mut f = fixture("zone-parts");
            let one = zoned(1, Some(main), &[(5, "; part 05\nn-5\tIN\tA\t10.88.0.5\n"), (0, "; part 00\nn-0\tIN\tA\t10.88.0.6\n")]);
            let ev = f.apply(&one).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Applied, "{ev:?}");
            let journal = f.take();
            let dns: Vec<&String> = journal.iter().filter(|l| l.starts_with("dns")).collect();
            assert_eq!(
                dns,
                [&format!("dns basic.mesh on 10.88.0.5:53 from {MESH_ZONE}, {}, {}", zone_part(0), zone_part(5))],
                "{journal:?}"
            );

            // Part 5 changed, part 9 came, part 0 as it was.
            let two = zoned(
                2,
                Some(main),
                &[(5, "; part 05\nn-5\tIN\tA\t10.88.0.7\n"), (0, "; part 00\nn-0\tIN\tA\t10.88.0.6\n"), (9, "n-9\tIN\tA\t10.88.0.9\n")],
            );
            let ev = f.apply(&two).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Applied, "{ev:?}");
            let journal = f.take();
            let staged: Vec<&String> = journal.iter().filter(|l| l.starts_with("stage") || l.starts_with("remove")).collect();
            assert_eq!(
                staged,
                [&format!("stage {}", zone_part(5)), &format!("stage {}", zone_part(9))],
                "only the parts that changed: {journal:?}"
            );

            // A part that sets the origin is refused, naming it and its line; nothing is written.
            let bad = zoned(
                3,
                Some(main),
                &[(5, "; part 05\nn-5\tIN\tA\t10.88.0.7\n"), (0, "; part 00\nn-0\tIN\tA\t10.88.0.6\n"), (9, "; part 09\n$ORIGIN evil.\n")],
            );
            let ev = f.apply(&bad).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Failed, "{ev:?}");
            let said = ev.error.clone().unwrap_or_default();
            assert!(said.contains("zone.d/names-09.zone line 2") && said.contains("$ORIGIN evil."), "{said}");
            assert!(!f.take().iter().any(|l| l.starts_with("stage")), "nothing is written");

            // Parts without mesh.zone: refused, naming a part.
            let headless = zoned(4, None, &[(5, "n-5\tIN\tA\t10.88.0.7\n")]);
            let ev = f.apply(&headless).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Failed, "{ev:?}");
            let said = ev.error.clone().unwrap_or_default();
            assert!(said.contains(zone_part(5)) && said.contains("no etc/trellis/mesh.zone"), "{said}");
            assert!(!f.take().iter().any(|l| l.starts_with("stage")), "nothing is written");

            // The ruleset's parts likewise (ADR 0044): a part that flushes the ruleset is refused.
            let mut flushing = zoned(5, Some(main), &[(0, "; part 00\nn-0\tIN\tA\t10.88.0.6\n")]);
            flushing.files.retain(|f| f.path != NFTABLES_CONF);
            flushing.files.push(BundleFile::new(NFTABLES_CONF, 0o644, b"table inet trellis {\n}\n".to_vec()));
            flushing.files.push(BundleFile::new(trellis_core::plan::ruleset_part(3), 0o644, b"# part 03\nflush ruleset\n".to_vec()));
            let ev = f.apply(&flushing).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Failed, "{ev:?}");
            let said = ev.error.clone().unwrap_or_default();
            assert!(said.contains("nftables.d/sources-03.nft line 2") && said.contains("flush ruleset"), "{said}");
            assert!(!f.take().iter().any(|l| l.starts_with("stage")), "nothing is written");
        });
    }

    /// A peer the backend changed by removing and adding it again (the embedded boringtun) lost
    /// its session: if this node dials it, it is prompted at once, right after WireGuard. Before,
    /// a hub's peer changed by a relayed node's enrolment carried nothing from the hub until this
    /// end next spoke (up to 25 s; `lab/fleet.toml` on boringtun). A changed peer that dials
    /// this node is not prompted (it has no address to be dialled at).
    #[test]
    fn a_peer_whose_session_the_backend_dropped_is_prompted_at_once() {
        rt().block_on(async {
            let mut f = fixture("dropped");
            let hub = ('H', Some("192.0.2.1:51820"), "10.88.0.2");
            let dials_us = ('D', None, "10.88.0.8");
            f.apply(&peered_bundle(1, &[hub, dials_us])).await.unwrap();
            f.take();
            // The hub now relays for another node; the node dialling us changed too.
            let relaying = ('H', Some("192.0.2.1:51820"), "10.88.0.2/32, 10.88.0.30");
            let moved_ips = ('D', None, "10.88.0.8/32, 10.88.0.31");
            let ev = f.apply(&peered_bundle(2, &[relaying, moved_ips])).await.unwrap();
            assert_eq!(ev.result, proto::EvidenceResult::Applied, "{ev:?}");
            let journal = f.take();
            let wg = journal.iter().position(|l| l.starts_with("wireguard")).expect("wireguard applied");
            assert_eq!(journal.get(wg + 1).map(String::as_str), Some("prompt trellis0 10.88.0.2"), "{journal:?}");
            assert_eq!(journal.iter().filter(|l| l.starts_with("prompt")).count(), 1, "only the hub: {journal:?}");
        });
    }

    /// A first bundle of many peers prompts them all, but follows up at most `FOLLOW_UP_MAX` of
    /// them: restarting thousands of peers eight times over would starve the agent.
    #[test]
    fn follow_ups_are_bounded_however_many_peers_were_prompted() {
        use base64::Engine;
        rt().block_on(async {
            let mut f = fixture("follow-up-bound");
            let mut b = bundle(1, false, "good1", &[]);
            let mut conf = "[Interface]\nAddress = 10.88.0.5/16\nListenPort = 51820\n".to_string();
            for i in 0..300u32 {
                let mut key = [7u8; 32];
                key[..4].copy_from_slice(&i.to_be_bytes());
                let key = base64::engine::general_purpose::STANDARD.encode(key);
                conf.push_str(&format!(
                    "\n[Peer]\nPublicKey = {key}\nAllowedIPs = 10.88.{}.{}/32\nEndpoint = 192.0.2.9:{}\n",
                    1 + i / 250,
                    1 + i % 250,
                    1000 + i
                ));
            }
            b.files[1] = BundleFile::new(WIREGUARD_CONF, 0o600, conf.into_bytes());
            f.apply(&b).await.unwrap();
            let prompt = f.take().last().cloned().unwrap_or_default();
            assert_eq!(prompt.split_whitespace().count(), 2 + 300, "every new peer is prompted: {prompt}");
            let followed = f.applier.executor().follow_up();
            assert_eq!(followed.len(), crate::exec::FOLLOW_UP_MAX, "at most FOLLOW_UP_MAX are followed up");
        });
    }

    /// A prompted peer without a handshake a moment later (it dropped the initiation: it did not
    /// have this node yet) has its handshake restarted and is prompted again, until it has one or
    /// the follow-ups are spent; one with a handshake is left alone.
    #[test]
    fn a_prompted_peer_without_a_handshake_is_restarted_and_prompted_again() {
        rt().block_on(async {
            let mut f = fixture("follow-up");
            let key = |c: char| format!("{}=", c.to_string().repeat(43));
            let (a, b) = (('A', Some("192.0.2.11:51820"), "10.88.0.6"), ('B', Some("192.0.2.12:51820"), "10.88.0.7"));
            // Measured from before the apply, so a slow machine cannot make it look early.
            let before = std::time::Instant::now();
            f.apply(&peered_bundle(1, &[a, b])).await.unwrap();
            assert_eq!(f.take().last().map(String::as_str), Some("prompt trellis0 10.88.0.6 10.88.0.7"));
            let exec = f.applier.executor();
            let due = exec.next_follow_up().expect("a follow-up is due");
            assert!(due >= before + FOLLOW_UP_DELAYS[0], "not before a handshake had its time");

            // A answered; B did not.
            f.shaken.lock().unwrap().push(key('A'));
            assert_eq!(exec.follow_up(), [key('B')]);
            assert_eq!(f.take(), lines(&["restart B", "prompt trellis0 10.88.0.7"]));

            // B still without one: followed up until they are spent, then left to WireGuard.
            for _ in 1..FOLLOW_UPS {
                assert_eq!(exec.follow_up(), [key('B')]);
            }
            assert_eq!(exec.next_follow_up(), None, "{FOLLOW_UPS} follow-ups, no more");
            assert_eq!(f.take().iter().filter(|l| l.starts_with("restart")).count(), FOLLOW_UPS as usize - 1);

            // A new bundle adds C: C and B, still waiting, are followed up; B's handshake ends it.
            let c = ('C', Some("192.0.2.13:51820"), "10.88.0.8");
            f.apply(&peered_bundle(2, &[a, b, c])).await.unwrap();
            let exec = f.applier.executor();
            assert_eq!(exec.follow_up(), [key('C')], "B was spent before C came");
            f.shaken.lock().unwrap().push(key('C'));
            assert!(exec.follow_up().is_empty());
            assert_eq!(exec.next_follow_up(), None, "everyone has a handshake");

            // D and E prompted and waiting; the next bundle removes D and adds F: D is followed
            // up no more (the interface no longer has it), E and F are.
            let (d, e) = (('D', Some("192.0.2.14:51820"), "10.88.0.9"), ('E', Some("192.0.2.15:51820"), "10.88.0.10"));
            f.apply(&peered_bundle(3, &[a, b, c, d, e])).await.unwrap();
            let f_peer = ('F', Some("192.0.2.16:51820"), "10.88.0.11");
            f.apply(&peered_bundle(4, &[a, b, c, e, f_peer])).await.unwrap();
            f.take();
            let mut followed = f.applier.executor().follow_up();
            followed.sort();
            assert_eq!(followed, [key('E'), key('F')]);
            assert_eq!(
                f.take(),
                lines(&["restart F E", "prompt trellis0 10.88.0.11 10.88.0.10"]),
                "the new peer first, then those waiting"
            );
        });
    }

    /// A peer still waiting when a later bundle prompts another is followed up only what is left
    /// of its own follow-ups: with bundles coming faster than follow-ups end, the old way began
    /// every waiting peer's again, and a node of ten thousand silent peers restarted the same
    /// 256 for as long as bundles came (each restart a walk of every peer's addresses on
    /// gotatun and boringtun).
    #[test]
    fn a_peer_carried_into_a_later_prompt_keeps_its_count_of_follow_ups() {
        rt().block_on(async {
            let mut f = fixture("follow-up-carried");
            let key = |c: char| format!("{}=", c.to_string().repeat(43));
            let b = ('B', Some("192.0.2.12:51820"), "10.88.0.7");
            f.apply(&peered_bundle(1, &[b])).await.unwrap();
            let exec = f.applier.executor();
            for _ in 0..3 {
                assert_eq!(exec.follow_up(), [key('B')]);
            }
            // A bundle adds C while B still waits: C has all its follow-ups, B what it had left.
            let c = ('C', Some("192.0.2.13:51820"), "10.88.0.8");
            f.apply(&peered_bundle(2, &[b, c])).await.unwrap();
            let exec = f.applier.executor();
            let mut restarts = std::collections::HashMap::<String, u32>::new();
            while exec.next_follow_up().is_some() {
                for k in exec.follow_up() {
                    *restarts.entry(k).or_default() += 1;
                }
                assert!(restarts.values().all(|n| *n <= FOLLOW_UPS), "{restarts:?}");
            }
            assert_eq!(restarts.get(&key('C')), Some(&FOLLOW_UPS), "{restarts:?}");
            assert_eq!(restarts.get(&key('B')), Some(&(FOLLOW_UPS - 3)), "{restarts:?}");
        });
    }

    #[test]
    fn files_only_touches_no_network() {
        let b = bundle(1, true, "good1", &[]);
        let scope = Scope { files_only: true, wireguard: true, dns_port: 53 };
        let actions = plan(&b, &Held::default(), &Observed::default(), &scope, &crate::plan::Changes::new()).unwrap();
        assert_eq!(actions, [Action::WriteFiles { files: b.files.clone(), remove: Vec::new() }]);
    }
}

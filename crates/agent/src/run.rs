//! `trellis-agent run`: long-poll the bundle, verify it, write its files atomically, apply them,
//! report evidence. With the controller away the last verified bundle stays applied and the
//! overlay keeps running; the agent retries with backoff and jitter and shows its staleness.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use base64::Engine;
use serde::{Deserialize, Serialize};
use trellis_core::bundle::{verify, Applied, Bundle};
use trellis_proto as proto;

use crate::apply::{self, FileWriter, Firewall, Wireguard};
use crate::identity::{self, Identity};

pub struct Options {
    pub state_dir: PathBuf,
    pub root: PathBuf,
    pub wireguard: apply::WgMode,
    /// Write files only; touch no interface and no ruleset.
    pub files_only: bool,
    /// Long-poll wait, seconds.
    pub wait: u64,
    /// Stop after this many applied bundles (for tests); 0 runs for ever.
    pub max_applies: u64,
    /// The longest wait between retries while the controller is unreachable, seconds.
    pub max_backoff: u64,
    pub dns_port: u16,
}

struct Polled {
    body: Result<Option<Vec<u8>>>,
    answered: bool,
    fresh_at: Option<i64>,
}

/// What the agent last applied, kept on disk so a restart resumes without rewriting anything.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u64,
    pub digest: String,
    pub files: Vec<ManifestFile>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ManifestFile {
    pub path: String,
    pub sha256: String,
    pub mode: u32,
}

/// What `trellis-agent status` shows, written by the run loop.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AgentStatus {
    pub pid: u32,
    pub updated_at: i64,
    pub last_contact: Option<i64>,
    /// The time in the controller's newest signed freshness stamp.
    pub fresh_at: Option<i64>,
    pub version: u64,
    pub last_error: Option<String>,
    pub interface: Option<String>,
    pub peers: Vec<apply::PeerState>,
    pub ruleset_loaded: bool,
    pub dns_serving: Vec<String>,
    /// Milliseconds from a bundle's arrival to its files written and interface, ruleset and DNS
    /// updated, for the last one applied.
    pub last_apply_ms: Option<u64>,
    pub buffered_evidence: usize,
    pub dropped_evidence: u64,
}

pub const EVIDENCE_BOUND: u64 = 10 * 1024 * 1024;

fn now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

fn read_json<T: for<'de> Deserialize<'de> + Default>(path: &Path) -> T {
    std::fs::read(path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
}

fn write_json<T: Serialize>(path: &Path, v: &T) -> Result<()> {
    identity::write_file(path, &serde_json::to_vec_pretty(v)?, 0o600)
}

/// Evidence waiting to be delivered: one JSON record a line, oldest first, bounded on disk.
pub struct EvidenceBuffer {
    path: PathBuf,
    next_path: PathBuf,
}

impl EvidenceBuffer {
    pub fn new(dir: &Path) -> Self {
        EvidenceBuffer { path: dir.join("evidence.jsonl"), next_path: dir.join("evidence.next") }
    }

    pub fn pending(&self) -> Vec<proto::Evidence> {
        std::fs::read_to_string(&self.path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    }

    fn next_seq(&self) -> i64 {
        std::fs::read_to_string(&self.next_path).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(1)
    }

    /// Appends a record with the next sequence number; drops the oldest records (their numbers
    /// become a visible gap) when the buffer would pass its bound. Returns how many were dropped.
    pub fn push(&self, mut record: proto::Evidence) -> Result<u64> {
        record.seq = self.next_seq();
        identity::write_file(&self.next_path, (record.seq + 1).to_string().as_bytes(), 0o600)?;
        let mut lines: VecDeque<String> = std::fs::read_to_string(&self.path).unwrap_or_default().lines().map(str::to_string).collect();
        lines.push_back(serde_json::to_string(&record)?);
        let mut dropped = 0;
        let mut size: u64 = lines.iter().map(|l| l.len() as u64 + 1).sum();
        while size > EVIDENCE_BOUND && lines.len() > 1 {
            size -= lines.pop_front().map_or(0, |l| l.len() as u64 + 1);
            dropped += 1;
        }
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        identity::write_file(&self.path, text.as_bytes(), 0o600)?;
        Ok(dropped)
    }

    /// Removes the records the controller acknowledged (the first `n`).
    pub fn ack(&self, n: usize) -> Result<()> {
        let lines: Vec<String> = std::fs::read_to_string(&self.path).unwrap_or_default().lines().skip(n).map(str::to_string).collect();
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        identity::write_file(&self.path, text.as_bytes(), 0o600)
    }
}

pub struct Agent {
    opts: Options,
    id: Identity,
    key: ed25519_dalek::VerifyingKey,
    files: Box<dyn FileWriter + Send>,
    wg: Option<Box<dyn Wireguard + Send>>,
    fw: Option<Box<dyn Firewall + Send>>,
    dns: Option<Box<dyn crate::dns::Resolver>>,
    evidence: EvidenceBuffer,
    status: AgentStatus,
    manifest: Manifest,
    http: reqwest::Client,
}

impl Agent {
    pub fn new(opts: Options) -> Result<Agent> {
        let id = identity::load(&opts.state_dir)?;
        let key = crate::bundle::signing_key(&id)?;
        let manifest: Manifest = read_json(&opts.state_dir.join("manifest.json"));
        // The interface is made on the first apply, when the bundle names it.
        let wg = None;
        let fw: Option<Box<dyn Firewall + Send>> = if opts.files_only { None } else { Some(Box::new(apply::Nft::new())) };
        let http = identity::node_client(&opts.state_dir)?;
        Ok(Agent {
            files: Box::new(apply::DiskWriter { root: opts.root.clone() }),
            evidence: EvidenceBuffer::new(&opts.state_dir),
            status: AgentStatus { pid: std::process::id(), version: manifest.version, ..Default::default() },
            id,
            key,
            wg,
            dns: if opts.files_only { None } else { Some(Box::new(crate::dns::Hickory::default())) },
            fw,
            manifest,
            http,
            opts,
        })
    }

    fn save_status(&mut self) {
        self.status = self.snapshot();
    }

    /// Applies the bundle the manifest names again after a restart: the files are in place, the
    /// interface and ruleset are not (they lived in the previous process or were flushed).
    async fn resume(&mut self) -> Result<()> {
        if self.manifest.version == 0 || self.opts.files_only {
            return Ok(());
        }
        let Ok(bytes) = std::fs::read(self.opts.state_dir.join("bundle.last")) else { return Ok(()) };
        let v =
            verify(&bytes, &self.key, &self.id.mesh, &self.id.node, None).map_err(|e| anyhow::anyhow!("the last applied bundle: {e}"))?;
        self.apply_network(&v.bundle).await
    }

    async fn apply_network(&mut self, bundle: &Bundle) -> Result<()> {
        let settings = node_settings(bundle)?;
        if settings.hub {
            // A hub forwards between the overlay peers it relays for.
            for knob in ["/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"] {
                std::fs::write(knob, "1").with_context(|| format!("cannot enable forwarding ({knob})"))?;
            }
        }
        let conf_text = bundle.files.iter().find(|f| f.path == trellis_core::compile::WIREGUARD_CONF).map(|f| f.content.clone());
        let mut listen = Vec::new();
        if let Some(text) = conf_text {
            let conf = trellis_core::wgconf::parse(std::str::from_utf8(&text).context("wireguard.conf is not UTF-8")?)
                .map_err(|e| anyhow::anyhow!(e))?;
            let private = std::fs::read_to_string(self.opts.state_dir.join("wireguard.key")).context("cannot read wireguard.key")?;
            let ifname = settings.interface.clone();
            if self.wg.is_none() {
                self.wg = apply::wireguard(self.opts.wireguard, &ifname);
            }
            if let Some(wg) = self.wg.as_mut() {
                wg.apply(&conf, private.trim())?;
                self.status.interface = Some(wg.describe());
                // The zone is served on the overlay addresses of the interface the agent manages.
                for a in &conf.addresses {
                    if let Some(ip) = a.split('/').next().and_then(|ip| ip.parse::<std::net::IpAddr>().ok()) {
                        listen.push(std::net::SocketAddr::new(ip, self.opts.dns_port));
                    }
                }
            }
        }
        if let Some(fw) = self.fw.as_mut() {
            if bundle.files.iter().any(|f| f.path == trellis_core::compile::NFTABLES_CONF) {
                fw.apply(&self.opts.root.join(trellis_core::compile::NFTABLES_CONF))?;
                self.status.ruleset_loaded = fw.loaded();
            }
        }
        if let Some(dns) = self.dns.as_mut() {
            if bundle.files.iter().any(|f| f.path == trellis_core::compile::MESH_ZONE) && !listen.is_empty() {
                dns.apply(&self.opts.root.join(trellis_core::compile::MESH_ZONE), &settings.zone, &listen).await?;
                self.status.dns_serving = dns.serving().iter().map(|a| a.to_string()).collect();
            }
        }
        Ok(())
    }

    /// Writes and applies a verified bundle; on failure restores the previous files and state.
    async fn apply(&mut self, bytes: &[u8], bundle: Bundle) -> proto::Evidence {
        let started = std::time::Instant::now();
        let dropped: Vec<String> =
            self.manifest.files.iter().filter(|m| !bundle.files.iter().any(|f| f.path == m.path)).map(|m| m.path.clone()).collect();
        let mut evidence = proto::Evidence {
            seq: 0,
            version: bundle.version as i64,
            result: proto::EvidenceResult::Applied,
            error: None,
            files: Vec::new(),
            at: now(),
        };
        let result = match self.files.write_all(&bundle.files, &dropped) {
            Ok(outcomes) => {
                evidence.files = outcomes
                    .iter()
                    .map(|o| proto::EvidenceFile { path: o.path.clone(), sha256: o.sha256.clone(), result: o.result })
                    .collect();
                self.apply_network(&bundle).await
            }
            Err(e) => Err(e),
        };
        self.status.last_apply_ms = Some(started.elapsed().as_millis() as u64);
        match result {
            Ok(()) => {
                let manifest = Manifest {
                    version: bundle.version,
                    digest: hex::encode(bundle.content_digest()),
                    files: bundle
                        .files
                        .iter()
                        .map(|f| ManifestFile { path: f.path.clone(), sha256: hex::encode(f.sha256), mode: f.mode })
                        .collect(),
                };
                let saved = identity::write_file(&self.opts.state_dir.join("bundle.last"), bytes, 0o600)
                    .and_then(|_| write_json(&self.opts.state_dir.join("manifest.json"), &manifest));
                if let Err(e) = saved {
                    evidence.result = proto::EvidenceResult::Failed;
                    evidence.error = Some(format!("{e:#}"));
                    return evidence;
                }
                self.manifest = manifest;
                self.status.version = bundle.version;
                self.status.last_error = None;
            }
            Err(e) => {
                evidence.result = proto::EvidenceResult::Failed;
                evidence.error = Some(format!("{e:#}"));
                self.status.last_error = evidence.error.clone();
                self.restore(&bundle).await;
            }
        }
        evidence
    }

    /// Puts the last good bundle's files back and applies them again.
    async fn restore(&mut self, failed: &Bundle) {
        let Ok(bytes) = std::fs::read(self.opts.state_dir.join("bundle.last")) else { return };
        let Ok(v) = verify(&bytes, &self.key, &self.id.mesh, &self.id.node, None) else { return };
        let extra: Vec<String> =
            failed.files.iter().filter(|f| !v.bundle.files.iter().any(|o| o.path == f.path)).map(|f| f.path.clone()).collect();
        if let Err(e) = self.files.write_all(&v.bundle.files, &extra) {
            eprintln!("trellis-agent: cannot restore the previous files: {e:#}");
        }
        if let Err(e) = self.apply_network(&v.bundle).await {
            eprintln!("trellis-agent: cannot re-apply the previous configuration: {e:#}");
        }
    }

    async fn flush_evidence(&mut self) -> Result<()> {
        let pending = self.evidence.pending();
        if pending.is_empty() {
            return Ok(());
        }
        for chunk in pending.chunks(proto::MAX_EVIDENCE_BATCH) {
            self.post(&proto::EvidenceBatch { records: chunk.to_vec() }).await?;
            self.evidence.ack(chunk.len())?;
        }
        Ok(())
    }

    async fn post(&self, batch: &proto::EvidenceBatch) -> Result<()> {
        let mut last = None;
        for c in &self.id.controllers {
            match self.http.post(format!("https://{c}/v1/evidence")).json(batch).send().await {
                Ok(r) if r.status().is_success() => return Ok(()),
                Ok(r) => bail!("the controller refused evidence: {}", r.text().await.unwrap_or_default()),
                Err(e) => last = Some(e.to_string()),
            }
        }
        bail!("cannot reach the controller: {}", last.unwrap_or_default())
    }

    /// One long-poll. Returns the bundle bytes when there is a newer one.
    /// One long-poll. The bundle bytes when there is a newer one; also whether the controller
    /// answered and the time in its signed freshness stamp. Takes `&self` so that the status
    /// can be refreshed while it waits.
    async fn poll(&self) -> Polled {
        let mut last = None;
        for c in &self.id.controllers {
            let mut req =
                self.http.get(format!("https://{c}/v1/bundle?wait={}", self.opts.wait)).timeout(Duration::from_secs(self.opts.wait + 30));
            if self.manifest.version > 0 {
                req = req.header("if-none-match", format!("\"{}\"", self.manifest.version));
            }
            let resp = match req.send().await {
                Ok(r) => r,
                Err(e) => {
                    last = Some(format!("{c}: {e}"));
                    continue;
                }
            };
            let fresh_at = resp
                .headers()
                .get("x-trellis-freshness")
                .and_then(|v| base64::engine::general_purpose::STANDARD.decode(v.as_bytes()).ok())
                .and_then(|stamp| trellis_core::bundle::verify_stamp(&stamp, &self.key, &self.id.mesh).ok());
            let body = match resp.status().as_u16() {
                304 => Ok(None),
                200 => crate::bundle::read_bounded(resp).await.map(Some),
                s => {
                    let text = resp.text().await.unwrap_or_default();
                    let msg = serde_json::from_str::<proto::ErrorBody>(&text).map(|b| b.error).unwrap_or(text);
                    Err(anyhow::anyhow!("the controller answered {s}: {msg}"))
                }
            };
            return Polled { body, answered: true, fresh_at };
        }
        Polled { body: Err(anyhow::anyhow!("cannot reach the controller: {}", last.unwrap_or_default())), answered: false, fresh_at: None }
    }

    /// The status with the live fields filled in (time, peers and handshakes, buffered
    /// evidence), written to disk. Needs only `&self`, so it also runs while a long-poll waits.
    fn snapshot(&self) -> AgentStatus {
        let mut status = self.status.clone();
        status.updated_at = now();
        if let Some(wg) = &self.wg {
            status.peers = wg.peers().unwrap_or_default();
        }
        status.buffered_evidence = self.evidence.pending().len();
        let _ = write_json(&self.opts.state_dir.join("agent-status.json"), &status);
        status
    }

    /// Applies one saved bundle (as `fetch` saved it) the way `run` applies what it pulls, and
    /// reports the outcome as evidence. Returns the evidence record.
    pub async fn apply_file(mut self, file: &Path) -> Result<proto::Evidence> {
        let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
        let last = Some(Applied {
            version: self.manifest.version,
            digest: hex::decode(&self.manifest.digest).ok().and_then(|d| d.try_into().ok()),
        });
        let v = verify(&bytes, &self.key, &self.id.mesh, &self.id.node, last.filter(|l| l.version > 0))
            .map_err(|e| anyhow::anyhow!("{}: refused: {e}", file.display()))?;
        if let Err(e) = self.resume().await {
            eprintln!("trellis-agent: re-applying the running bundle first failed: {e:#}");
        }
        let ev = self.apply(&bytes, v.bundle).await;
        self.evidence.push(ev.clone())?;
        if let Err(e) = self.flush_evidence().await {
            eprintln!("trellis-agent: evidence kept for later: {e:#}");
        }
        self.save_status();
        Ok(ev)
    }

    pub async fn run(mut self) -> Result<()> {
        if let Err(e) = self.resume().await {
            self.status.last_error = Some(format!("resuming: {e:#}"));
            eprintln!("trellis-agent: resuming the last bundle failed: {e:#}");
        }
        self.save_status();
        let mut failures: u32 = 0;
        let mut applies = 0u64;
        loop {
            match identity::renew_if_due(&self.opts.state_dir).await {
                // Only a new certificate needs a new client; otherwise the connection is reused.
                Ok(true) => match identity::node_client(&self.opts.state_dir) {
                    Ok(c) => self.http = c,
                    Err(e) => eprintln!("trellis-agent: loading the renewed certificate: {e:#}"),
                },
                Ok(false) => {}
                Err(e) => eprintln!("trellis-agent: certificate renewal: {e:#}"),
            }
            // Evidence waiting from before (an outage, a restart) goes out before the next long
            // poll, which may hold the connection for most of a minute.
            let _ = self.flush_evidence().await;
            let polled = {
                // While the long-poll waits, the status file is refreshed every ten seconds so
                // that `trellis-agent status` shows live peers and handshakes.
                let poll = self.poll();
                tokio::pin!(poll);
                let mut tick = tokio::time::interval(Duration::from_secs(10));
                tick.tick().await;
                loop {
                    tokio::select! {
                        p = &mut poll => break p,
                        _ = tick.tick() => { self.snapshot(); }
                    }
                }
            };
            if polled.answered {
                self.status.last_contact = Some(now());
            }
            if let Some(at) = polled.fresh_at {
                self.status.fresh_at = Some(self.status.fresh_at.map_or(at, |f| f.max(at)));
            }
            let outcome = polled.body;
            match outcome {
                Ok(Some(bytes)) => {
                    failures = 0;
                    let last = Some(Applied {
                        version: self.manifest.version,
                        digest: hex::decode(&self.manifest.digest).ok().and_then(|d| d.try_into().ok()),
                    });
                    match verify(&bytes, &self.key, &self.id.mesh, &self.id.node, last.filter(|l| l.version > 0)) {
                        Ok(v) if v.redelivery => {}
                        Ok(v) => {
                            let ev = self.apply(&bytes, v.bundle).await;
                            let dropped = self.evidence.push(ev)?;
                            self.status.dropped_evidence += dropped;
                            applies += 1;
                        }
                        Err(e) => {
                            // Refused before anything was written: the previous files stay.
                            eprintln!("trellis-agent: refused a bundle: {e}");
                            self.status.last_error = Some(format!("refused a bundle: {e}"));
                        }
                    }
                }
                Ok(None) => failures = 0,
                Err(e) => {
                    failures += 1;
                    self.status.last_error = Some(format!("{e:#}"));
                }
            }
            if let Err(e) = self.flush_evidence().await {
                if failures == 0 {
                    self.status.last_error = Some(format!("evidence: {e:#}"));
                }
            }
            self.save_status();
            if self.opts.max_applies > 0 && applies >= self.opts.max_applies {
                return Ok(());
            }
            if failures > 0 {
                // Exponential backoff with jitter, capped at a minute; no CPU while waiting.
                let cap = self.opts.max_backoff.max(1) as f64;
                let base = (2u64.saturating_pow(failures.min(6)) as f64).min(cap);
                let jitter = 0.5 + rand::random::<f64>() / 2.0;
                tokio::time::sleep(Duration::from_secs_f64(base * jitter)).await;
            }
        }
    }
}

/// `etc/trellis/node.toml`: the interface, the zone's name, and whether this node is a hub.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeSettings {
    #[allow(dead_code)]
    node: String,
    #[allow(dead_code)]
    mesh: String,
    interface: String,
    zone: String,
    hub: bool,
}

fn node_settings(bundle: &Bundle) -> Result<NodeSettings> {
    let f = bundle.files.iter().find(|f| f.path == trellis_core::compile::NODE_TOML).context("the bundle has no etc/trellis/node.toml")?;
    toml::from_str(std::str::from_utf8(&f.content).context("node.toml is not UTF-8")?).context("etc/trellis/node.toml is not valid")
}

pub fn load_status(dir: &Path) -> AgentStatus {
    read_json(&dir.join("agent-status.json"))
}

pub fn load_manifest(dir: &Path) -> Manifest {
    read_json(&dir.join("manifest.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(version: i64) -> proto::Evidence {
        proto::Evidence { seq: 0, version, result: proto::EvidenceResult::Applied, error: None, files: Vec::new(), at: 1 }
    }

    #[test]
    fn evidence_is_numbered_kept_in_order_and_acknowledged_from_the_front() {
        let dir = std::env::temp_dir().join(format!("trellis-evidence-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let buf = EvidenceBuffer::new(&dir);
        for v in 1..=5 {
            assert_eq!(buf.push(record(v)).unwrap(), 0);
        }
        let seqs: Vec<i64> = buf.pending().iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [1, 2, 3, 4, 5]);
        buf.ack(2).unwrap();
        buf.push(record(6)).unwrap();
        let seqs: Vec<i64> = buf.pending().iter().map(|r| r.seq).collect();
        assert_eq!(seqs, [3, 4, 5, 6], "numbers keep rising after an acknowledgement");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_buffer_is_bounded_and_drops_the_oldest() {
        let dir = std::env::temp_dir().join(format!("trellis-evidence-bound-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let buf = EvidenceBuffer::new(&dir);
        let mut big = record(1);
        big.error = Some("x".repeat(1024 * 1024));
        let mut dropped = 0;
        for _ in 0..12 {
            dropped += buf.push(big.clone()).unwrap();
        }
        assert!(dropped >= 2, "dropped {dropped}");
        let size = std::fs::metadata(dir.join("evidence.jsonl")).unwrap().len();
        assert!(size <= EVIDENCE_BOUND, "{size}");
        let seqs: Vec<i64> = buf.pending().iter().map(|r| r.seq).collect();
        assert_eq!(*seqs.last().unwrap(), 12, "the newest is kept");
        assert_eq!(seqs.first().copied(), Some(12 - seqs.len() as i64 + 1), "the oldest went first; the gap is visible by number");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

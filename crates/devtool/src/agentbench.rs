//! `trellis-dev bench agent`: a real agent on a node that sees the whole mesh (an operator's),
//! in a network namespace with a real `trellis serve` on its loopback. It times the first apply
//! of a bundle of N peers and then of a bundle with one peer re-keyed, one added and one removed,
//! each split by phase as the agent itself measured it (files, WireGuard, ruleset, DNS); the
//! agent's and wireguard-go's resident memory; and the DNS answer time for one name among N. On
//! each WireGuard backend asked for.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::args::AgentArgs;

/// The node measured: in the operators' group, which every other node admits, and admitting
/// every other node on one port itself, so its ruleset names N sources.
const NODE: &str = "op-0";
const PORT: u16 = 18443;

pub fn run(a: &AgentArgs) -> Result<std::process::ExitCode> {
    // SAFETY: `geteuid` reads the process's effective user id and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the agent bench needs root: it makes a network namespace and a WireGuard interface");
    }
    if a.peers == 0 || a.peers > 200_000 {
        bail!("--peers must be between 1 and 200000");
    }
    let mut all = Vec::new();
    for backend in &a.wireguard {
        if !["wireguard-go", "gotatun", "boringtun", "kernel"].contains(&backend.as_str()) {
            bail!("--wireguard {backend:?}: give wireguard-go, gotatun, boringtun or kernel");
        }
        eprintln!("bench agent: {} peers on {backend} ...", a.peers);
        let figures = Bench::new(backend)?.measure(a)?;
        if !a.json {
            print(&figures);
        }
        all.push(figures);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&json!({ "peers": a.peers, "backends": all }))?);
    }
    Ok(std::process::ExitCode::SUCCESS)
}

fn print(f: &Value) {
    let phases = |v: &Value| {
        v["phases_ms"]
            .as_object()
            .map(|o| o.iter().map(|(k, ms)| format!("{k} {:.1}", ms.as_f64().unwrap_or(0.0))).collect::<Vec<_>>().join(", "))
            .unwrap_or_default()
    };
    println!(
        "{}: first apply of {} peers {} ms ({}); after {} s at rest, one peer re-keyed, one added, one removed: median {} ms of {} ({}; runs {})",
        f["backend"].as_str().unwrap_or(""),
        f["peers"],
        f["first"]["apply_ms"],
        phases(&f["first"]),
        f["rest_s"],
        f["change"]["apply_ms"],
        f["change"]["runs_ms"].as_array().map_or(0, Vec::len),
        phases(&f["change"]),
        f["change"]["runs_ms"].as_array().map(|r| r.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(" ")).unwrap_or_default()
    );
    println!(
        "{}: agent resident {:.1} MiB (peak {:.1} MiB){}; DNS answer for one name among {}: median {} ms of {} queries, {} unanswered within 2 s",
        f["backend"].as_str().unwrap_or(""),
        f["agent_rss_mib"].as_f64().unwrap_or(0.0),
        f["agent_peak_mib"].as_f64().unwrap_or(0.0),
        f["wireguard_go_rss_mib"].as_f64().map(|m| format!(", wireguard-go resident {m:.1} MiB")).unwrap_or_default(),
        f["peers"],
        f["dns_median_ms"],
        f["dns_queries"],
        f["dns_unanswered"]
    );
}

/// One run: a namespace, a controller and an agent, removed when dropped.
struct Bench {
    ns: String,
    dir: PathBuf,
    backend: String,
    children: Vec<std::process::Child>,
    trellis: PathBuf,
    agent: PathBuf,
    /// Set once measured: a run that failed keeps its directory (the logs) to be read.
    done: bool,
}

impl Drop for Bench {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Ok(out) = Command::new("ip").args(["netns", "pids", &self.ns]).output() {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
        }
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
        if self.done && std::env::var_os("TRELLIS_BENCH_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("bench agent: the logs of the failed run are in {}", self.dir.display());
        }
    }
}

fn sh(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("cannot run {}", args[0]))?;
    if !out.status.success() {
        bail!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Bench {
    fn new(backend: &str) -> Result<Bench> {
        let trellis = crate::delivery::trellis_exe()?;
        let agent = trellis.with_file_name("trellis-agent");
        if !agent.is_file() {
            bail!("{} is missing; build it next to trellis-dev with `cargo build -p trellis-agent`", agent.display());
        }
        let tag = format!("{}-{backend}", std::process::id());
        let ns = format!("tbench-{}", &tag[..tag.len().min(20)]);
        let dir = std::env::temp_dir().join(format!("trellis-bench-agent-{tag}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        sh(&["ip", "netns", "add", &ns])?;
        let b = Bench { ns, dir, backend: backend.to_string(), children: Vec::new(), trellis, agent, done: false };
        sh(&["ip", "-n", &b.ns, "link", "set", "lo", "up"])?;
        Ok(b)
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_string_lossy().into_owned()
    }

    /// A command in the namespace.
    fn in_ns(&self, args: &[&str]) -> Result<String> {
        let mut full = vec!["ip", "netns", "exec", &self.ns];
        full.extend_from_slice(args);
        sh(&full)
    }

    fn trellis(&self, args: &[&str]) -> Result<String> {
        let t = self.trellis.to_string_lossy().into_owned();
        let state = self.path("controller");
        let mut full = vec![t.as_str()];
        full.extend_from_slice(args);
        full.extend(["--state-dir", &state]);
        self.in_ns(&full)
    }

    fn measure(mut self, a: &AgentArgs) -> Result<Value> {
        let n = a.peers;
        let state = self.path("controller");
        self.in_ns(&[&self.trellis.to_string_lossy(), "init", "--state-dir", &state, "--advertise", &format!("127.0.0.1:{PORT}")])?;
        let log = std::fs::File::create(self.dir.join("serve.log"))?;
        let serve = Command::new("ip")
            .args(["netns", "exec", &self.ns, &self.trellis.to_string_lossy(), "serve", "--state-dir", &state])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("cannot start trellis serve")?;
        self.children.push(serve);
        let decl = self.dir.join("decl");
        write_declaration(&decl, n, None)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.trellis(&["apply", &decl.to_string_lossy()]).is_err() {
            if Instant::now() > deadline {
                bail!("the controller did not take the declaration; see {}", self.dir.join("serve.log").display());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let token: Value = serde_json::from_str(&self.trellis(&["token", "create", NODE, "--json"])?)?;
        let token_file = self.dir.join("token");
        std::fs::write(&token_file, token["token"].as_str().context("no token in `trellis token create --json`")?)?;
        let agent_state = self.path("agent");
        let root = self.path("root");
        let agent = self.agent.to_string_lossy().into_owned();
        self.in_ns(&[&agent, "enrol", "--token-file", &token_file.to_string_lossy(), "--state-dir", &agent_state])?;
        let cmd = format!(
            "mkdir -p /var/run/wireguard && mount -t tmpfs tmpfs /var/run/wireguard && exec {agent} run --state-dir {agent_state} --root {root} --wireguard {} --max-backoff 2",
            self.backend
        );
        let log = std::fs::File::create(self.dir.join("agent.log"))?;
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns, "unshare", "-m", "sh", "-c", &cmd])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("cannot start the agent")?;
        let pid = child.id();
        self.children.push(child);
        let first = self.until_version(1, Duration::from_secs(120))?;
        let rss = crate::figures::memory_kib(pid, "VmRSS").unwrap_or(0) as f64 / 1024.0;

        // One peer re-keyed, one added, one removed; then undone, and so on: each is a
        // three-peer change, timed on a node at rest (`--rest`).
        std::thread::sleep(Duration::from_secs(a.rest));
        let mut held = first["version"].as_u64().unwrap_or(1);
        let mut changes = Vec::new();
        for i in 0..a.changes.max(1) {
            write_declaration(&decl, n, (i % 2 == 0).then_some(()))?;
            self.trellis(&["apply", &decl.to_string_lossy()])?;
            let s = self.until_version(held + 1, Duration::from_secs(120))?;
            held = s["version"].as_u64().unwrap_or(held + 1);
            changes.push(s);
        }
        let change = median_change(&changes);
        let peak = crate::figures::memory_kib(pid, "VmHWM").unwrap_or(0) as f64 / 1024.0;
        let rss_after = crate::figures::memory_kib(pid, "VmRSS").unwrap_or(0) as f64 / 1024.0;
        let wg_go = wireguard_go_of(pid).and_then(|p| crate::figures::memory_kib(p, "VmRSS")).map(|k| k as f64 / 1024.0);

        // A name among N, asked of the agent's own resolver.
        let status = self.status()?;
        let listen = status["dns_serving"].as_array().and_then(|l| l.first()).and_then(|a| a.as_str()).map(str::to_string);
        let mut times = Vec::new();
        let mut unanswered = 0;
        if let Some(listen) = listen {
            let (host, port) = listen.rsplit_once(':').context("a DNS address without a port")?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let name = format!("p-{:05}.agent.mesh", n / 2);
            for _ in 0..a.queries {
                // An answer not within 2 s counts as unanswered, and is reported so.
                let out = self.in_ns(&["dig", "+tries=1", "+time=2", &format!("@{host}"), "-p", port, &name, "A"]).unwrap_or_default();
                if !out.contains("status: NOERROR") || !out.contains("ANSWER: 1") {
                    unanswered += 1;
                    continue;
                }
                let ms: u64 = out
                    .lines()
                    .find_map(|l| l.strip_prefix(";; Query time: "))
                    .and_then(|t| t.split_whitespace().next()?.parse().ok())
                    .unwrap_or(0);
                times.push(ms);
            }
        }
        times.sort_unstable();
        self.done = true;
        Ok(json!({
            "backend": self.backend,
            "peers": n,
            "first": { "apply_ms": first["last_apply_ms"], "phases_ms": first["last_apply_phases_ms"], "peers_on_interface": first["peers"].as_array().map(|p| p.len()) },
            "change": change,
            "rest_s": a.rest,
            "agent_rss_mib": rss.max(rss_after),
            "agent_peak_mib": peak,
            "wireguard_go_rss_mib": wg_go,
            "dns_median_ms": times.get(times.len() / 2),
            "dns_queries": times.len(),
            "dns_unanswered": unanswered,
        }))
    }

    fn status(&self) -> Result<Value> {
        let text = std::fs::read_to_string(self.dir.join("agent/agent-status.json")).context("the agent wrote no status yet")?;
        Ok(serde_json::from_str(&text)?)
    }

    /// Waits until the agent's status says it applied `version` or later.
    fn until_version(&self, version: u64, limit: Duration) -> Result<Value> {
        let started = Instant::now();
        loop {
            if let Ok(s) = self.status() {
                if s["version"].as_u64().is_some_and(|v| v >= version) && s["last_apply_ms"].is_u64() {
                    return Ok(s);
                }
            }
            if started.elapsed() > limit {
                bail!(
                    "the agent did not apply version {version} within {} s; see {}",
                    limit.as_secs(),
                    self.dir.join("agent.log").display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The median of the changes' apply times, each phase's median beside it, and every run's time.
fn median_change(changes: &[Value]) -> Value {
    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    }
    // The agent times an apply in whole milliseconds: the median is one of them.
    let runs: Vec<u64> = changes.iter().filter_map(|c| c["last_apply_ms"].as_u64()).collect();
    let mut phases = serde_json::Map::new();
    for name in changes.iter().filter_map(|c| c["last_apply_phases_ms"].as_object()).flat_map(|o| o.keys()) {
        if !phases.contains_key(name) {
            let each = changes.iter().map(|c| c["last_apply_phases_ms"][name].as_f64().unwrap_or(0.0)).collect();
            phases.insert(name.clone(), json!(median(each)));
        }
    }
    json!({
        "apply_ms": median(runs.iter().map(|&r| r as f64).collect()) as u64,
        "runs_ms": runs,
        "phases_ms": phases,
        // Each change's phases, in order, so that an outlier shows where its time went.
        "runs_phases_ms": changes.iter().map(|c| c["last_apply_phases_ms"].clone()).collect::<Vec<_>>(),
        "peers_on_interface": changes.last().and_then(|c| c["peers"].as_array()).map(|p| p.len()),
    })
}

/// The pid of the wireguard-go child of `agent`, if it runs one.
fn wireguard_go_of(agent: u32) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (comm, rest) = stat.split_once(") ")?;
        let ppid: u32 = rest.split_whitespace().nth(1)?.parse().ok()?;
        (ppid == agent && comm.ends_with("(wireguard-go")).then_some(pid)
    })
}

/// The mesh: NODE in the operators' group and N peers, each with a declared key and admitting the
/// operators on SSH; NODE admits every peer on 9100 (N sources in its ruleset). With `changed`,
/// p-00000 has a new key, p-00001 is gone and p-N is added.
fn write_declaration(dir: &Path, n: usize, changed: Option<()>) -> Result<()> {
    std::fs::create_dir_all(dir.join("modules"))?;
    let mut s = format!(
        "[mesh]\nname = \"agent\"\ndomain = \"agent.mesh\"\noverlay_ipv4 = \"{}\"\n\n[networks]\nlan = {{}}\n\n[groups]\nops = [\"{NODE}\"]\n",
        crate::meshgen::overlay_for(n + 2)
    );
    let peers: Vec<usize> = match changed {
        None => (0..n).collect(),
        Some(()) => (0..=n).filter(|i| *i != 1).collect(),
    };
    let names: Vec<String> = peers.iter().map(|i| format!("\"p-{i:05}\"")).collect();
    let _ = writeln!(s, "peers = [{}]", names.join(", "));
    let _ = write!(s, "\n[[node]]\nname = \"{NODE}\"\nnetworks = [\"lan\"]\nmodules = [\"metrics\"]\n");
    for i in peers {
        let key = if changed.is_some() && i == 0 { crate::meshgen::key(n + 7) } else { crate::meshgen::key(i) };
        let _ = write!(
            s,
            "\n[[node]]\nname = \"p-{i:05}\"\nnetworks = [\"lan\"]\nmodules = [\"ssh\"]\npublic_key = \"{key}\"\n[[node.endpoint]]\naddress = \"198.18.{}.{}:51820\"\nreachable_from = [\"lan\"]\n",
            (i / 250) % 250,
            i % 250 + 1
        );
    }
    std::fs::write(dir.join("mesh.toml"), s)?;
    std::fs::write(
        dir.join("modules/ssh.toml"),
        "[module]\nname = \"ssh\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"22\"]\nfrom = [\"group:ops\"]\n",
    )?;
    std::fs::write(
        dir.join("modules/metrics.toml"),
        "[module]\nname = \"metrics\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"9100\"]\nfrom = [\"group:peers\"]\n",
    )?;
    Ok(())
}

//! `trellis-agent run` end to end: a controller and two agents in network namespaces on one
//! bridge, real WireGuard (the embedded boringtun, and a real `wireguard-go` the agent runs),
//! real nftables, real traffic. And a crash test: agents killed with SIGKILL in the middle of
//! applies leave every file old or new.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use trellis_testing::cmd::{ok, run, sh, Proc};
use trellis_testing::{can_run, repo, Need, TempDir};

use crate::controller::copy_dir;
use crate::support::Netns;

const AGENT: &str = crate::support::AGENT;
const TRELLIS: &str = env!("CARGO_BIN_EXE_trellis");

struct Site {
    _bridge: Netns,
    ctl: Netns,
    nodes: HashMap<&'static str, Netns>,
    dir: TempDir,
    serve: Option<Proc>,
    agents: HashMap<&'static str, Proc>,
    /// The agents' `--wireguard` backend.
    wireguard: &'static str,
}

impl Site {
    /// `trellis init` and `serve` on the controller, and lab/basic applied.
    fn serve_basic(&mut self) {
        self.ctl.ok(&[TRELLIS, "init", "--state-dir", self.state().to_str().unwrap(), "--advertise", "192.0.2.1:8443"]);
        self.start_controller();
        self.admin(&["apply", repo().join("lab/basic").to_str().unwrap()]);
    }

    /// db-1 and api-1 enrolled, their agents running and converged, and api-1 pinging db-1 over
    /// the overlay; db-1's overlay address.
    fn pair_up(&mut self) -> String {
        self.enrol_and_run("db-1");
        self.enrol_and_run("api-1");
        self.converge(&["api-1", "db-1"]);
        let db = self.overlay_v4("db-1");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !ping(&self.nodes["api-1"], &db) {
            assert!(Instant::now() < deadline, "no ping over the overlay\n{}", self.logs());
        }
        db
    }

    /// The controller at 192.0.2.1, api-1 at .11 and db-1 at .12, as lab/basic declares.
    fn new() -> Site {
        crate::support::agent();
        let bridge = Netns::new("br");
        bridge.ok(&["ip", "link", "add", "br0", "type", "bridge"]);
        bridge.ok(&["ip", "link", "set", "br0", "up"]);
        let attach = |tag: &'static str, addr: &str| {
            let ns = Netns::new(tag);
            let veth = format!("v-{tag}");
            ok(sh("ip", &["link", "add", &veth, "netns", &bridge.name, "type", "veth", "peer", "name", "eth0", "netns", &ns.name]));
            bridge.ok(&["ip", "link", "set", &veth, "master", "br0"]);
            bridge.ok(&["ip", "link", "set", &veth, "up"]);
            ns.ok(&["ip", "addr", "add", &format!("{addr}/24"), "dev", "eth0"]);
            ns.ok(&["ip", "link", "set", "eth0", "up"]);
            ns
        };
        let ctl = attach("ctl", "192.0.2.1");
        let mut nodes = HashMap::new();
        nodes.insert("api-1", attach("api", "192.0.2.11"));
        nodes.insert("db-1", attach("db", "192.0.2.12"));
        Site { _bridge: bridge, ctl, nodes, dir: TempDir::new("site"), serve: None, agents: HashMap::new(), wireguard: "boringtun" }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("ctl")
    }

    fn admin(&self, args: &[&str]) -> String {
        let mut a: Vec<&str> = vec![TRELLIS];
        a.extend_from_slice(args);
        let state = self.state();
        a.extend_from_slice(&["--state-dir", state.to_str().unwrap()]);
        self.ctl.ok(&a)
    }

    fn start_controller(&mut self) {
        let log = std::fs::File::create(self.dir.path().join("serve.log")).unwrap();
        let child = self
            .ctl
            .cmd(&[TRELLIS, "serve", "--state-dir", self.state().to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.serve = Some(Proc(child));
        let deadline = Instant::now() + Duration::from_secs(20);
        while !run(self.ctl.cmd(&["nc", "-z", "-w", "1", "192.0.2.1", "8443"])).0.status.success() {
            assert!(Instant::now() < deadline, "controller did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn root(&self, node: &str) -> PathBuf {
        self.dir.path().join(format!("root-{node}"))
    }

    fn agent_dir(&self, node: &str) -> PathBuf {
        self.dir.path().join(format!("agent-{node}"))
    }

    fn enrol_and_run(&mut self, node: &'static str) {
        let token = self.admin(&["token", "create", node]).trim().to_string();
        let ns = &self.nodes[node];
        ns.ok(&[AGENT, "enrol", &token, "--state-dir", self.agent_dir(node).to_str().unwrap()]);
        self.run_agent(node);
    }

    fn run_agent(&mut self, node: &'static str) {
        let ns = &self.nodes[node];
        let cmd = format!(
            "mkdir -p /var/run/wireguard && mount -t tmpfs tmpfs /var/run/wireguard && exec {AGENT} run --state-dir {} --root {} --wireguard {} --max-backoff 1",
            self.agent_dir(node).display(),
            self.root(node).display(),
            self.wireguard
        );
        let log = std::fs::File::create(self.dir.path().join(format!("agent-{node}.log"))).unwrap();
        let child = ns.cmd(&["unshare", "-m", "sh", "-c", &cmd]).stdout(Stdio::null()).stderr(log).spawn().unwrap();
        self.agents.insert(node, Proc(child));
    }

    fn status(&self) -> serde_json::Value {
        serde_json::from_str(&self.admin(&["status", "--json"])).unwrap()
    }

    /// Waits until every enrolled node has applied its desired version.
    fn converge(&self, nodes: &[&str]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let s = self.status();
            let done = nodes.iter().all(|n| {
                let e = s.as_array().unwrap().iter().find(|x| x["name"] == *n).unwrap();
                e["desired_version"].is_u64() && e["desired_version"] == e["applied_version"]
            });
            if done {
                return;
            }
            assert!(Instant::now() < deadline, "agents did not converge: {s}\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Each node's desired version now.
    fn desired(&self, nodes: &[&str]) -> Vec<u64> {
        let s = self.status();
        nodes
            .iter()
            .map(|n| s.as_array().unwrap().iter().find(|x| x["name"] == *n).unwrap()["desired_version"].as_u64().unwrap_or(0))
            .collect()
    }

    /// Waits until each node's desired version is past `before` (an apply returns before the
    /// publish run it asks for), then until every one of them applied it.
    fn converge_past(&self, nodes: &[&str], before: &[u64]) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.desired(nodes).iter().zip(before).any(|(now, was)| now <= was) {
            assert!(Instant::now() < deadline, "no new version was published for {nodes:?}\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(100));
        }
        self.converge(nodes);
    }

    fn logs(&self) -> String {
        let mut s = String::new();
        for f in ["serve.log", "agent-api-1.log", "agent-db-1.log"] {
            s.push_str(&format!("--- {f}\n{}\n", std::fs::read_to_string(self.dir.path().join(f)).unwrap_or_default()));
        }
        s
    }

    fn overlay_v4(&self, node: &str) -> String {
        let zone = std::fs::read_to_string(self.root("api-1").join("etc/trellis/mesh.zone")).unwrap();
        zone.lines().find(|l| l.starts_with(&format!("{node}\t")) && l.contains("\tA\t")).unwrap().rsplit('\t').next().unwrap().to_string()
    }
}

fn ping(ns: &Netns, dst: &str) -> bool {
    run(ns.cmd(&["ping", "-c", "1", "-W", "2", dst])).0.status.success()
}

fn port_open(ns: &Netns, dst: &str, port: u16) -> bool {
    run(ns.cmd(&["nc", "-z", "-n", "-w", "2", dst, &port.to_string()])).0.status.success()
}

fn file_hashes(root: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for f in ["wireguard.conf", "nftables.conf", "mesh.zone", "ca.pem", "node.pem"] {
        let p = root.join("etc/trellis").join(f);
        out.push((f.to_string(), std::fs::read(&p).map(|b| hex::encode(Sha256::digest(b))).unwrap_or_default()));
    }
    out
}

#[test]
fn two_agents_bring_up_the_overlay_enforce_the_policy_and_survive_an_outage() {
    if !can_run(Need::Root) {
        return;
    }
    let mut site = Site::new();
    site.serve_basic();
    let db = site.pair_up();
    let (api_ns, db_ns) = (&site.nodes["api-1"], &site.nodes["db-1"]);

    // The overlay works, and the filter on db-1 is the policy: postgres from module:api is open,
    // ssh (admins only) is closed.
    let mut listeners = Vec::new();
    for port in ["5432", "22"] {
        listeners.push(Proc(
            db_ns.cmd(&["nc", "-l", "-k", port]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap(),
        ));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(port_open(api_ns, &db, 5432), "postgres from api-1 is allowed");
    assert!(!port_open(api_ns, &db, 22), "ssh from api-1 is denied");
    let listed = db_ns.ok(&["nft", "list", "table", "inet", "trellis"]);
    assert!(listed.contains("postgres rule 1"), "{listed}");

    // DNS: each node answers the mesh zone on its overlay address; api-1 runs the resolver
    // module, so db-1 may ask it over the overlay.
    let api = site.overlay_v4("api-1");
    let dig = |ns: &Netns, server: &str, name: &str| -> String {
        ns.ok(&["dig", "+short", "+time=2", "+tries=2", &format!("@{server}"), name, "A"]).trim().to_string()
    };
    assert_eq!(dig(api_ns, &api, "db-1.basic.mesh"), db, "api-1 answers for db-1");
    assert_eq!(dig(db_ns, &api, "postgres.basic.mesh"), db, "the module name resolves to the nodes running it");
    let mut ping_answer: Vec<String> = dig(db_ns, &api, "ping.basic.mesh").lines().map(str::to_string).collect();
    ping_answer.sort();
    // op-1 is declared (not enrolled yet) and runs `ping` too: the zone is the declaration's.
    let mut want = vec![api.clone(), db.clone(), site.overlay_v4("op-1")];
    want.sort();
    assert_eq!(ping_answer, want, "every node running `ping`");

    // The controller goes away: the overlay keeps working and the files stay as they were.
    let before = file_hashes(&site.root("api-1"));
    site.serve = None;
    std::thread::sleep(Duration::from_secs(3));
    assert!(ping(api_ns, &db), "the overlay survives the controller's outage");
    assert!(port_open(api_ns, &db, 5432));
    assert_eq!(file_hashes(&site.root("api-1")), before, "files untouched while the controller is away");
    let local = ok({
        let mut c = Command::new(AGENT);
        c.args(["status", "--state-dir", site.agent_dir("api-1").to_str().unwrap(), "--json"]);
        c
    });
    let v: serde_json::Value = serde_json::from_str(&local).unwrap();
    assert!(v["last_error"].as_str().unwrap_or_default().contains("cannot reach the controller"), "{local}");
    assert_eq!(v["ruleset_loaded"], true, "the ruleset stays loaded: {local}");
    assert_eq!(v["interface"], "trellis0 (boringtun)", "{local}");
    assert_eq!(v["dns_serving"].as_array().map(Vec::len), Some(2), "DNS on both overlay addresses: {local}");

    drop(listeners);
    // It comes back with a change (a node more): both agents catch up, and the evidence of every
    // apply is there, numbered from 1 without gaps.
    let decl = TempDir::new("decl");
    copy_dir(&repo().join("lab/basic"), decl.path());
    let mesh = std::fs::read_to_string(decl.path().join("mesh.toml")).unwrap();
    std::fs::write(decl.path().join("mesh.toml"), mesh + "\n[[node]]\nname = \"extra-1\"\n").unwrap();
    site.start_controller();
    let before = site.desired(&["api-1", "db-1"]);
    site.admin(&["apply", decl.path().to_str().unwrap()]);
    site.converge_past(&["api-1", "db-1"], &before);
    let s = site.status();
    for n in ["api-1", "db-1"] {
        let e = s.as_array().unwrap().iter().find(|x| x["name"] == n).unwrap();
        assert_eq!(e["evidence_missing"], 0, "{e}");
        assert!(e["evidence_records"].as_i64().unwrap() >= 2, "{e}");
    }
    assert!(ping(&site.nodes["api-1"], &db), "still up after catching up");

    // Revocation: db-1 drops api-1's traffic once its next bundle leaves api-1 out.
    let t0 = Instant::now();
    site.admin(&["node", "revoke", "api-1"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while ping(&site.nodes["api-1"], &db) {
        assert!(Instant::now() < deadline, "db-1 still answers the revoked api-1");
    }
    println!("revocation -> former peer drops the revoked node's traffic: {} ms", t0.elapsed().as_millis());
}

/// The pid of the `wireguard-go` whose parent is `parent`, if there is one.
fn wireguard_go_child(parent: u32) -> Option<u32> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let status = std::fs::read_to_string(e.path().join("status")).ok()?;
        let field = |k: &str| status.lines().find_map(|l| l.strip_prefix(k)).map(str::trim).unwrap_or_default().to_string();
        (field("Name:") == "wireguard-go" && field("PPid:") == parent.to_string() && !field("State:").starts_with('Z')).then_some(pid)
    })
}

/// Whether process `pid` is gone (or a zombie no one has reaped yet).
fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z')))
}

/// Two agents on `--wireguard wireguard-go`: each runs a real wireguard-go as its child, traffic
/// passes through the overlay under the policy, a changed MTU replaces the process (the old one
/// ends), a revocation removes the peer over UAPI while the same process keeps running, and an
/// agent killed with SIGKILL takes its wireguard-go and its interface with it.
#[test]
fn two_agents_on_wireguard_go_pass_traffic_change_peers_in_place_and_take_it_down_with_them() {
    if !(can_run(Need::Root) && can_run(Need::Program("wireguard-go"))) {
        return;
    }
    let mut site = Site::new();
    site.wireguard = "wireguard-go";
    site.serve_basic();
    let db = site.pair_up();
    let (api_ns, db_ns) = (&site.nodes["api-1"], &site.nodes["db-1"]);
    let _listeners: Vec<Proc> = ["5432", "22"]
        .iter()
        .map(|port| {
            Proc(db_ns.cmd(&["nc", "-l", "-k", port]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap())
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    assert!(port_open(api_ns, &db, 5432), "postgres from api-1 is allowed\n{}", site.logs());
    assert!(!port_open(api_ns, &db, 22), "ssh from api-1 is denied");
    let local = ok({
        let mut c = Command::new(AGENT);
        c.args(["status", "--state-dir", site.agent_dir("db-1").to_str().unwrap(), "--json"]);
        c
    });
    let v: serde_json::Value = serde_json::from_str(&local).unwrap();
    assert_eq!(v["interface"], "trellis0 (wireguard-go)", "{local}");

    // The interface is wireguard-go's, the agent's child, as `wg` sees it through the UAPI socket
    // in the agent's mount namespace: one peer (api-1), with a handshake.
    let agent = site.agents["db-1"].0.id();
    let first = wireguard_go_child(agent).unwrap_or_else(|| panic!("db-1's agent (pid {agent}) runs no wireguard-go\n{}", site.logs()));
    let wg = |what: &str| ok(sh("nsenter", &["-t", &agent.to_string(), "-m", "-n", "wg", "show", "trellis0", what]));
    assert_eq!(wg("peers").lines().count(), 1, "{}", wg("dump"));
    assert!(wg("latest-handshakes").split_whitespace().nth(1).is_some_and(|t| t != "0"), "{}", wg("dump"));

    // The interface changes (another MTU): a new wireguard-go replaces the first, which ends.
    let decl = TempDir::new("mtu-decl");
    copy_dir(&repo().join("lab/basic"), decl.path());
    let mesh = std::fs::read_to_string(decl.path().join("mesh.toml")).unwrap();
    let v6 = "overlay_ipv6 = \"fd88:0:0:1::/64\"\n";
    assert!(mesh.contains(v6));
    std::fs::write(decl.path().join("mesh.toml"), mesh.replace(v6, &format!("{v6}mtu = 1380\n"))).unwrap();
    site.admin(&["apply", decl.path().to_str().unwrap()]);
    site.converge(&["api-1", "db-1"]);
    let wg_pid = wireguard_go_child(agent).unwrap_or_else(|| panic!("no wireguard-go after the change\n{}", site.logs()));
    assert_ne!(wg_pid, first, "a new wireguard-go for the new interface");
    assert!(gone(first), "the first wireguard-go ended when its interface was replaced");
    assert!(db_ns.ok(&["ip", "link", "show", "trellis0"]).contains("mtu 1380"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ping(api_ns, &db) {
        assert!(Instant::now() < deadline, "no ping over the new interface\n{}", site.logs());
    }

    // Revocation: db-1 drops api-1 over UAPI; the process and the interface stay.
    site.admin(&["node", "revoke", "api-1"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while ping(api_ns, &db) {
        assert!(Instant::now() < deadline, "db-1 still answers the revoked api-1\n{}", site.logs());
    }
    site.converge(&["db-1"]);
    assert_eq!(wg("peers").trim(), "", "api-1 is no longer a peer of db-1");
    assert_eq!(wireguard_go_child(agent), Some(wg_pid), "the peer changed in place: the same wireguard-go runs");

    // The agent ends without a chance to clean up: wireguard-go ends with it, and the interface.
    drop(site.agents.remove("db-1"));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gone(wg_pid) {
        assert!(Instant::now() < deadline, "wireguard-go (pid {wg_pid}) outlived its agent");
        std::thread::sleep(Duration::from_millis(50));
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while run(db_ns.cmd(&["ip", "link", "show", "trellis0"])).0.status.success() {
        assert!(Instant::now() < deadline, "trellis0 outlived its wireguard-go");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `--wireguard wireguard-go` on a host without it is refused before anything happens, in one
/// sentence; `userspace`, the old name of `boringtun`, is still understood.
#[test]
fn a_missing_wireguard_go_is_refused_and_userspace_still_means_boringtun() {
    let dir = TempDir::new("no-wggo");
    let agent_run = |mode: &str| {
        let mut c = Command::new(crate::support::agent());
        c.args(["run", "--state-dir", dir.path().to_str().unwrap(), "--wireguard", mode]).env("PATH", dir.path());
        run(c)
    };
    let (out, d) = agent_run("wireguard-go");
    assert_eq!(out.status.code(), Some(1), "{d}");
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "error: --wireguard wireguard-go: no `wireguard-go` on PATH; install it (Debian package wireguard-go) or choose another backend",
        "{d}"
    );
    let (out, d) = agent_run("userspace");
    assert_eq!(out.status.code(), Some(1), "accepted, then refused for the empty state directory\n{d}");
    assert!(!String::from_utf8_lossy(&out.stderr).contains("invalid value"), "{d}");
}

fn pseudo_random(n: u64) -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos() as u64;
    (t ^ (t >> 7)).wrapping_mul(0x9E37_79B9_7F4A_7C15) % n.max(1)
}

#[test]
fn an_agent_killed_at_any_moment_leaves_every_file_old_or_new() {
    use crate::controller::{agent_bin, enrol, Controller, Db};
    let c = Controller::start(Db::Sqlite);
    c.ok(&["apply", "lab/basic"]);
    let work = TempDir::new("crash");
    let (state, root) = (work.path().join("db-1"), work.path().join("root"));
    ok(enrol(&c.token("db-1", &[]), &state));

    // Every content each file has had in any version: a file on disk must be one of them. A
    // decision is published behind its request, so after an apply `learn` long-polls for the
    // version after the one it last saw.
    let mut known: HashMap<String, HashSet<String>> = HashMap::new();
    let learn = |known: &mut HashMap<String, HashSet<String>>, held: Option<i64>| -> i64 {
        let out = work.path().join("latest.bundle");
        let mut f = agent_bin();
        f.args(["fetch", "--state-dir", state.to_str().unwrap(), "--out", out.to_str().unwrap()]);
        if let Some(v) = held {
            f.args(["--held", &v.to_string(), "--wait", "20"]);
        }
        ok(f);
        let mut v = agent_bin();
        v.args(["verify", out.to_str().unwrap(), "--state-dir", state.to_str().unwrap(), "--json"]);
        let json: serde_json::Value = serde_json::from_str(&ok(v)).unwrap();
        for file in json["files"].as_array().unwrap() {
            known.entry(file["path"].as_str().unwrap().to_string()).or_default().insert(file["sha256"].as_str().unwrap().to_string());
        }
        let version = json["version"].as_i64().unwrap();
        assert!(held.is_none_or(|h| version > h), "a new version after the apply: {json}");
        version
    };
    let mut held = learn(&mut known, None);

    let decl = TempDir::new("crash-decl");
    copy_dir(&repo().join("lab/basic"), decl.path());
    let base = std::fs::read_to_string(decl.path().join("mesh.toml")).unwrap();
    let rounds = 25;
    for round in 0..rounds {
        let mut agent = Proc(
            agent_bin()
                .args([
                    "run",
                    "--files-only",
                    "--max-backoff",
                    "1",
                    "--state-dir",
                    state.to_str().unwrap(),
                    "--root",
                    root.to_str().unwrap(),
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        // A new version: another node joins, so every file of db-1 that lists nodes changes.
        let extra: String = (0..=round % 4).map(|k| format!("\n[[node]]\nname = \"extra-{round}-{k}\"\nmodules = [\"ping\"]\n")).collect();
        std::fs::write(decl.path().join("mesh.toml"), format!("{base}{extra}")).unwrap();
        c.ok(&["apply", decl.path().to_str().unwrap()]);
        held = learn(&mut known, Some(held));
        // Kills land before, during and after the write: the apply takes a few milliseconds.
        std::thread::sleep(Duration::from_millis(pseudo_random(60)));
        let _ = agent.0.kill(); // SIGKILL
        let _ = agent.0.wait();
        for (path, hashes) in &known {
            let p = root.join(path);
            if let Ok(bytes) = std::fs::read(&p) {
                let sha = hex::encode(Sha256::digest(&bytes));
                assert!(hashes.contains(&sha), "round {round}: {path} is neither an old nor a new version of itself");
            }
        }
        let manifest = std::fs::read(state.join("manifest.json"));
        if let Ok(m) = manifest {
            serde_json::from_slice::<serde_json::Value>(&m).unwrap_or_else(|e| panic!("round {round}: manifest.json is torn: {e}"));
        }
    }
    // Restarted once more, it resumes and ends on exactly the newest bundle.
    let _agent = Proc(
        agent_bin()
            .args(["run", "--files-only", "--state-dir", state.to_str().unwrap(), "--root", root.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let newest = work.path().join("newest.bundle");
    let mut f = agent_bin();
    f.args(["fetch", "--state-dir", state.to_str().unwrap(), "--out", newest.to_str().unwrap()]);
    ok(f);
    let mut v = agent_bin();
    v.args(["verify", newest.to_str().unwrap(), "--state-dir", state.to_str().unwrap(), "--json"]);
    let json: serde_json::Value = serde_json::from_str(&ok(v)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let all_new = json["files"].as_array().unwrap().iter().all(|file| {
            std::fs::read(root.join(file["path"].as_str().unwrap()))
                .is_ok_and(|b| hex::encode(Sha256::digest(&b)) == file["sha256"].as_str().unwrap())
        });
        if all_new {
            break;
        }
        assert!(Instant::now() < deadline, "the restarted agent did not reach the newest bundle");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_ruleset_nft_refuses_leaves_the_previous_one_loaded_and_the_failure_in_status() {
    if !can_run(Need::Root) {
        return;
    }
    use base64::Engine;
    let mut site = Site::new();
    site.serve_basic();
    site.enrol_and_run("db-1");
    site.converge(&["db-1"]);
    let db_ns = &site.nodes["db-1"];
    let state = site.agent_dir("db-1");
    // The agent stopped once it has delivered what it recorded: a record still in its buffer
    // would arrive when it runs again, one more than this test counts (the suite once saw it,
    // on a busy machine).
    let buffered = |state: &Path| -> i64 {
        let mut c = Command::new(AGENT);
        c.args(["status", "--state-dir", state.to_str().unwrap(), "--json"]);
        serde_json::from_str::<serde_json::Value>(&ok(c)).unwrap()["buffered_evidence"].as_i64().unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while buffered(&state) != 0 {
        assert!(Instant::now() < deadline, "the agent's evidence was not delivered within 20 s");
        std::thread::sleep(Duration::from_millis(100));
    }
    site.agents.clear(); // stop the running agent; its ruleset stays loaded in the kernel
                         // What it reported until now: on a busy machine its first apply may have failed once and
                         // been made again, each a record.
    let records_before =
        site.status().as_array().unwrap().iter().find(|x| x["name"] == "db-1").unwrap()["evidence_records"].as_i64().unwrap();
    let root = site.root("db-1");
    let saved = site.dir.path().join("current.bundle");
    db_ns.ok(&[AGENT, "fetch", "--state-dir", state.to_str().unwrap(), "--out", saved.to_str().unwrap()]);
    let seed = std::fs::read_to_string(site.state().join("signing.key")).unwrap();
    let key =
        ed25519_dalek::SigningKey::from_bytes(&base64::engine::general_purpose::STANDARD.decode(seed.trim()).unwrap().try_into().unwrap());
    let current =
        trellis_core::bundle::verify(&std::fs::read(&saved).unwrap(), &key.verifying_key(), "basic", "db-1", None).unwrap().bundle;
    let before_rules = db_ns.ok(&["nft", "list", "table", "inet", "trellis"]);
    let before_file = std::fs::read(root.join("etc/trellis/nftables.conf")).unwrap();

    // The controller publishes a newer version (a node added changes every zone) that the
    // stopped agent has not fetched; a bundle of that version is forged with a ruleset nft
    // refuses. (Evidence for a version the controller never published is refused, so the forged
    // bundle carries a published version number.)
    let spare = TempDir::new("spare-decl");
    copy_dir(&repo().join("lab/basic"), spare.path());
    let mesh = std::fs::read_to_string(spare.path().join("mesh.toml")).unwrap();
    std::fs::write(spare.path().join("mesh.toml"), mesh + "\n[[node]]\nname = \"spare-1\"\n").unwrap();
    site.admin(&["apply", spare.path().to_str().unwrap()]);
    let mut bad = current.clone();
    bad.version += 1;
    for f in bad.files.iter_mut().filter(|f| f.path == "etc/trellis/nftables.conf") {
        let text = format!("{}\ntable inet trellis {{ chain broken {{ this is not nft }} }}\n", String::from_utf8_lossy(&f.content));
        *f = trellis_core::bundle::BundleFile::new(f.path.clone(), f.mode, text.into_bytes());
    }
    let forged = site.dir.path().join("refused.bundle");
    std::fs::write(&forged, bad.sign(&key).to_vec()).unwrap();
    let apply = |file: &Path| {
        run(db_ns.cmd(&[
            AGENT,
            "apply",
            file.to_str().unwrap(),
            "--state-dir",
            state.to_str().unwrap(),
            "--root",
            root.to_str().unwrap(),
            "--wireguard",
            "none",
        ]))
    };
    let (out, d) = apply(&forged);
    assert_eq!(out.status.code(), Some(1), "{d}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("failed and the previous configuration was restored") && err.contains("nft refused"), "{d}");

    assert_eq!(db_ns.ok(&["nft", "list", "table", "inet", "trellis"]), before_rules, "the previous ruleset is still the one loaded");
    assert_eq!(std::fs::read(root.join("etc/trellis/nftables.conf")).unwrap(), before_file, "the previous file is back");
    let s = site.status();
    let e = s.as_array().unwrap().iter().find(|x| x["name"] == "db-1").unwrap();
    assert!(e["last_error"].as_str().unwrap_or_default().contains("nft refused"), "{e}");
    assert_eq!(e["applied_version"].as_u64(), Some(current.version), "{e}");

    // Evidence made while the controller is away is kept on disk and arrives later, in order.
    let decl = TempDir::new("outage-decl");
    copy_dir(&repo().join("lab/basic"), decl.path());
    let mesh = std::fs::read_to_string(decl.path().join("mesh.toml")).unwrap();
    std::fs::write(decl.path().join("mesh.toml"), mesh + "\n[[node]]\nname = \"extra-1\"\n").unwrap();
    site.admin(&["apply", decl.path().to_str().unwrap()]);
    let newer = site.dir.path().join("newer.bundle");
    // Published behind the apply's answer: long-poll for the version after the current one.
    let held = current.version.to_string();
    db_ns.ok(&[AGENT, "fetch", "--state-dir", state.to_str().unwrap(), "--out", newer.to_str().unwrap(), "--held", &held, "--wait", "20"]);
    site.serve = None;
    let (out, d) = apply(&newer);
    assert!(out.status.success(), "{d}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("evidence kept for later"), "{d}");
    let local: serde_json::Value = serde_json::from_str(&ok({
        let mut c = Command::new(AGENT);
        c.args(["status", "--state-dir", state.to_str().unwrap(), "--json"]);
        c
    }))
    .unwrap();
    assert_eq!(local["buffered_evidence"], 1, "{local}");
    site.start_controller();
    site.run_agent("db-1");
    site.converge(&["db-1"]);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = site.status();
        let e = s.as_array().unwrap().iter().find(|x| x["name"] == "db-1").unwrap().clone();
        // The refused apply and the one made while the controller was away: two more.
        if e["last_result"] == "applied" && e["evidence_records"].as_i64() == Some(records_before + 2) {
            assert_eq!(e["evidence_missing"], 0, "{e}");
            break;
        }
        assert!(Instant::now() < deadline, "buffered evidence did not arrive: {e}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Every file under `dir` (relative path, SHA-256), sorted.
fn all_files(dir: &Path) -> Vec<(String, String)> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                walk(base, &e.path(), out);
            } else {
                let rel = e.path().strip_prefix(base).unwrap().to_string_lossy().to_string();
                out.push((rel, hex::encode(Sha256::digest(std::fs::read(e.path()).unwrap()))));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// A tmpfs of `size` mounted at `dir`, unmounted on drop.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(dir: &Path, size: &str) -> SmallDisk {
        std::fs::create_dir_all(dir).unwrap();
        ok(sh("mount", &["-t", "tmpfs", "-o", &format!("size={size},mode=0755"), "tmpfs", dir.to_str().unwrap()]));
        SmallDisk(dir.to_path_buf())
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = sh("umount", &["-l", self.0.to_str().unwrap()]).output();
    }
}

/// Issue 12, faults: the agent's disk fills up in the middle of an apply. The write of the new
/// version fails with "No space left on device"; every file stays at the old version (no file
/// cut short, no temporary file left behind), the failure is in the agent's status and reported
/// to the controller, and once there is room the same bundle applies.
#[test]
fn a_full_disk_mid_apply_leaves_the_old_files_and_reports_the_failure() {
    use crate::controller::{agent_bin, enrol, Controller, Db};
    // It mounts a small tmpfs.
    if !can_run(Need::Root) {
        return;
    }
    let c = Controller::start(Db::Sqlite);
    c.ok(&["apply", "lab/basic"]);
    let work = TempDir::new("full");
    let (state, root) = (work.path().join("db-1"), work.path().join("root"));
    ok(enrol(&c.token("db-1", &[]), &state));
    let disk = SmallDisk::mount(&root, "256k");
    let fetch = |out: &Path, held: Option<&str>| {
        let mut f = agent_bin();
        f.args(["fetch", "--state-dir", state.to_str().unwrap(), "--out", out.to_str().unwrap()]);
        if let Some(v) = held {
            f.args(["--held", v, "--wait", "20"]);
        }
        ok(f);
    };
    let apply = |bundle: &Path| {
        let mut a = agent_bin();
        a.args([
            "apply",
            bundle.to_str().unwrap(),
            "--files-only",
            "--state-dir",
            state.to_str().unwrap(),
            "--root",
            root.to_str().unwrap(),
        ]);
        a
    };
    let (v1, v2) = (work.path().join("v1.bundle"), work.path().join("v2.bundle"));
    fetch(&v1, None);
    ok(apply(&v1));
    let old = all_files(&root);
    assert!(old.iter().any(|(p, _)| p.ends_with("etc/trellis/mesh.zone")), "{old:?}");

    // A new version: another node joins.
    let decl = TempDir::new("full-decl");
    copy_dir(&repo().join("lab/basic"), decl.path());
    let mesh = std::fs::read_to_string(decl.path().join("mesh.toml")).unwrap();
    std::fs::write(decl.path().join("mesh.toml"), mesh + "\n[[node]]\nname = \"extra-1\"\nmodules = [\"ping\"]\n").unwrap();
    c.ok(&["apply", decl.path().to_str().unwrap()]);
    let v1_version = {
        let mut v = agent_bin();
        v.args(["verify", v1.to_str().unwrap(), "--state-dir", state.to_str().unwrap(), "--json"]);
        serde_json::from_str::<serde_json::Value>(&ok(v)).unwrap()["version"].as_i64().unwrap().to_string()
    };
    fetch(&v2, Some(&v1_version));

    // The disk fills up.
    let filler = root.join("filler");
    let _ = sh("dd", &["if=/dev/zero", &format!("of={}", filler.display()), "bs=4096"]).output();
    assert!(filler.metadata().unwrap().len() > 0);
    let (out, d) = run(apply(&v2));
    assert_eq!(out.status.code(), Some(1), "{d}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("No space left on device"), "{d}");
    let now: Vec<(String, String)> = all_files(&root).into_iter().filter(|(p, _)| p != "filler").collect();
    assert_eq!(now, old, "every file is as it was, and nothing else is left behind");
    let mut s = agent_bin();
    s.args(["status", "--state-dir", state.to_str().unwrap(), "--json"]);
    let status = ok(s);
    assert!(status.contains("No space left on device"), "{status}");
    // The controller heard of it.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let st = c.ok(&["status", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&st).unwrap();
        let db1 = v.as_array().unwrap().iter().find(|n| n["node"] == "db-1" || n["name"] == "db-1").cloned().unwrap_or_default();
        if db1.to_string().contains("No space left on device") {
            break;
        }
        assert!(Instant::now() < deadline, "the controller never heard of the failure: {st}");
        std::thread::sleep(Duration::from_millis(200));
    }

    // Room again: the same bundle applies.
    std::fs::remove_file(&filler).unwrap();
    ok(apply(&v2));
    assert_ne!(all_files(&root), old, "the new version is written");
    drop(disk);
}

/// Issue 35 (ADR 0033): an agent that missed three versions catches up by a delta from the
/// bundle it holds, and writes only the files that changed; one whose files were changed by hand
/// holds content nobody published: it fetches the bundle whole and writes every file again.
#[test]
fn an_agent_that_missed_three_versions_catches_up_by_delta_and_one_with_files_changed_by_hand_whole() {
    use crate::controller::{agent_bin, enrol, Controller, Db};
    let c = Controller::start(Db::Sqlite);
    let decl = TempDir::new("delta-decl");
    copy_dir(&repo().join("lab/basic"), decl.path());
    let base = std::fs::read_to_string(decl.path().join("mesh.toml")).unwrap();
    c.ok(&["apply", decl.path().to_str().unwrap()]);
    let work = TempDir::new("delta");
    let (state, root) = (work.path().join("db-1"), work.path().join("root"));
    ok(enrol(&c.token("db-1", &[]), &state));
    let (s, r) = (state.to_str().unwrap(), root.to_str().unwrap());
    // One apply and out, its log kept.
    let once = || {
        let mut a = agent_bin();
        a.env("RUST_LOG", "info").args(["run", "--files-only", "--max-applies", "1", "--state-dir", s, "--root", r]);
        let (out, d) = run(a);
        assert!(out.status.success(), "{d}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // The newest bundle, once it is past `held`: its version and each file's digest.
    let newest = |held: Option<i64>| -> (i64, Vec<(String, String)>) {
        let out = work.path().join("newest.bundle");
        let mut f = agent_bin();
        f.args(["fetch", "--state-dir", s, "--out", out.to_str().unwrap()]);
        if let Some(v) = held {
            f.args(["--held", &v.to_string(), "--wait", "20"]);
        }
        ok(f);
        let mut v = agent_bin();
        v.args(["verify", out.to_str().unwrap(), "--state-dir", s, "--json"]);
        let json: serde_json::Value = serde_json::from_str(&ok(v)).unwrap();
        let files = json["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| (f["path"].as_str().unwrap().to_string(), f["sha256"].as_str().unwrap().to_string()));
        (json["version"].as_i64().unwrap(), files.collect())
    };
    let on_disk = |files: &[(String, String)]| {
        for (path, sha) in files {
            let bytes = std::fs::read(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
            assert_eq!(&hex::encode(Sha256::digest(&bytes)), sha, "{path} is the newest bundle's");
        }
    };
    let log = once();
    assert!(!log.contains("from a delta"), "the first bundle comes whole: {log}");
    let (mut held, first) = newest(None);
    on_disk(&first);
    assert!(state.join("bundle.head").exists() && !state.join("bundle.last").exists(), "the head is kept, not the whole bundle");
    let mtime = |path: &str| std::fs::metadata(root.join(path)).unwrap().modified().unwrap();
    let ca_written = mtime("etc/trellis/ca.pem");

    // Three versions while the agent is away: a node more each time.
    for k in 0..3 {
        let extra: String = (0..=k).map(|i| format!("\n[[node]]\nname = \"extra-{i}\"\nmodules = [\"ping\"]\n")).collect();
        std::fs::write(decl.path().join("mesh.toml"), format!("{base}{extra}")).unwrap();
        c.ok(&["apply", decl.path().to_str().unwrap()]);
        held = newest(Some(held)).0;
    }
    let (version, files) = newest(None);
    assert_eq!(version, held);
    let log = once();
    assert!(log.contains("built a bundle from a delta"), "three versions behind, a delta: {log}");
    on_disk(&files);
    assert_eq!(mtime("etc/trellis/ca.pem"), ca_written, "a file that did not change is not written again");
    let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(state.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["version"].as_i64(), Some(version));

    // A file changed by hand: the bundle held no longer verifies; the same version comes whole
    // and every file is written again.
    let held_check = || {
        let mut v = agent_bin();
        v.args(["verify", "--held", "--state-dir", s, "--root", r]);
        run(v)
    };
    let (out, d) = held_check();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains(&format!("version {version}")), "{d}");
    std::fs::write(root.join("etc/trellis/node.toml"), "changed by hand\n").unwrap();
    let (out, d) = held_check();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("etc/trellis/node.toml is 16 bytes, not"), "{d}");
    let log = once();
    assert!(log.contains("fetched and written whole"), "{log}");
    assert!(!log.contains("built a bundle from a delta"), "{log}");
    on_disk(&files);
    assert!(held_check().0.status.success());
    // And the next change comes as a delta again.
    std::fs::write(decl.path().join("mesh.toml"), format!("{base}\n[[node]]\nname = \"late\"\nmodules = [\"ping\"]\n")).unwrap();
    c.ok(&["apply", decl.path().to_str().unwrap()]);
    let (_, files) = newest(Some(version));
    let log = once();
    assert!(log.contains("built a bundle from a delta"), "{log}");
    on_disk(&files);
}

//! The controller and enrolment end to end: real `trellis init` and `serve` (on SQLite and on
//! PostgreSQL), real `trellis-agent enrol`, over HTTPS on loopback.

use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use trellis_core::token::EnrolmentToken;

use trellis_testing::cmd::{fails_with, ok, run, sh, Proc};
use trellis_testing::{can_run, repo, Need, TempDir};

use crate::support::trellis_cmd;

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub fn agent_bin() -> Command {
    let mut c = Command::new(crate::support::agent());
    c.current_dir(repo());
    c
}

/// An agent of `state` running files-only under `root`, retrying the controller every second.
pub fn files_only_agent(state: &Path, root: &Path) -> Proc {
    Proc(
        agent_bin()
            .args(["run", "--files-only", "--max-backoff", "1", "--state-dir", state.to_str().unwrap(), "--root", root.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// A running controller; killed on drop.
pub struct Controller {
    pub dir: TempDir,
    pub state: PathBuf,
    pub port: u16,
    pub database_url: Option<String>,
    serves: Vec<Child>,
    /// More arguments for every `trellis serve`.
    serve_args: Vec<String>,
}

#[derive(Clone, Copy, Debug)]
pub enum Db {
    Sqlite,
    Postgres,
}

pub fn database_url(db: Db) -> Option<String> {
    match db {
        Db::Sqlite => None,
        Db::Postgres => {
            let db = tokio::runtime::Runtime::new().unwrap().block_on(trellis_testing::Database::postgres());
            Some(db.expect("a test on PostgreSQL first asks can_run(Need::Postgres)").to_string())
        }
    }
}

impl Controller {
    pub fn start(db: Db) -> Controller {
        Self::start_with(db, &[])
    }

    pub fn start_with(db: Db, extra: &[&str]) -> Controller {
        Self::start_on(database_url(db), extra)
    }

    /// A controller on this database (`None`: its own SQLite file).
    pub fn start_on(database_url: Option<String>, extra: &[&str]) -> Controller {
        Self::start_serving(database_url, extra, &[])
    }

    /// A controller on this database, `init` with `extra` and `serve` with `serve_args`.
    pub fn start_serving(database_url: Option<String>, extra: &[&str], serve_args: &[&str]) -> Controller {
        let dir = TempDir::new("ctl");
        let state = dir.path().join("state");
        let port = free_port();
        let advertise = format!("127.0.0.1:{port}");
        let listen = format!("127.0.0.1:{port}");
        let mut init = trellis_cmd(&["init", "--state-dir", state.to_str().unwrap(), "--advertise", &advertise, "--listen", &listen]);
        if let Some(u) = &database_url {
            init.args(["--database-url", u]);
        }
        init.args(extra);
        ok(init);
        let serve_args = serve_args.iter().map(|a| a.to_string()).collect();
        let mut c = Controller { dir, state, port, database_url, serves: Vec::new(), serve_args };
        c.serve(port);
        c
    }

    /// Starts (another) `trellis serve` on this state directory and database, on `port`.
    pub fn serve(&mut self, port: u16) {
        self.serve_with(port, &[]);
    }

    /// The `trellis serve` command of this controller, on `port`, with `extra` arguments.
    pub fn serve_cmd(&self, port: u16, extra: &[&str]) -> Command {
        let mut cmd = trellis_cmd(&["serve", "--state-dir", self.state.to_str().unwrap(), "--listen", &format!("127.0.0.1:{port}")]);
        if let Some(u) = &self.database_url {
            cmd.args(["--database-url", u]);
        }
        cmd.args(&self.serve_args).args(extra);
        cmd
    }

    /// As [`Controller::serve`], with `extra` arguments.
    pub fn serve_with(&mut self, port: u16, extra: &[&str]) {
        let mut cmd = self.serve_cmd(port, extra);
        let log = std::fs::File::create(self.dir.path().join(format!("serve-{port}.log"))).unwrap();
        let child = cmd.stdout(Stdio::null()).stderr(log).spawn().expect("spawn trellis serve");
        self.serves.push(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "trellis serve did not listen on {port}: {}", self.log(port));
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the `i`th `trellis serve` started (0: the first), leaving the others serving.
    pub fn stop_replica(&mut self, i: usize) {
        let c = &mut self.serves[i];
        let _ = c.kill();
        let _ = c.wait();
    }

    /// Stops every `trellis serve` of this controller.
    pub fn stop_serving(&mut self) {
        for c in &mut self.serves {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.serves.clear();
    }

    pub fn log(&self, port: u16) -> String {
        std::fs::read_to_string(self.dir.path().join(format!("serve-{port}.log"))).unwrap_or_default()
    }

    pub fn admin(&self, args: &[&str]) -> Command {
        let mut c = trellis_cmd(args);
        c.args(["--state-dir", self.state.to_str().unwrap()]);
        c
    }

    pub fn ok(&self, args: &[&str]) -> String {
        ok(self.admin(args))
    }

    pub fn token(&self, node: &str, extra: &[&str]) -> String {
        let mut a = vec!["token", "create", node];
        a.extend_from_slice(extra);
        self.ok(&a).trim().to_string()
    }

    pub fn nodes(&self) -> serde_json::Value {
        serde_json::from_str(&self.ok(&["nodes", "--json"])).unwrap()
    }

    pub fn node_state(&self, name: &str) -> String {
        let v = self.nodes();
        v.as_array().unwrap().iter().find(|n| n["name"] == name).map(|n| n["state"].as_str().unwrap().to_string()).unwrap_or_default()
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        for c in &mut self.serves {
            let _ = c.kill();
            let _ = c.wait();
        }
        // A failed test shows what the controller said, before its directory goes with it.
        if std::thread::panicking() {
            for entry in std::fs::read_dir(self.dir.path()).into_iter().flatten().flatten() {
                let name = entry.file_name().to_string_lossy().to_string();
                if name.starts_with("serve-") && name.ends_with(".log") {
                    let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
                    let lines: Vec<&str> = text.lines().collect();
                    let tail = lines[lines.len().saturating_sub(80)..].join("\n");
                    eprintln!("--- the last {} lines of {name} ---\n{tail}", lines.len().min(80));
                }
            }
        }
    }
}

pub fn enrol(token: &str, dir: &Path) -> Command {
    let mut c = agent_bin();
    c.args(["enrol", token, "--state-dir", dir.to_str().unwrap()]);
    c
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())).permissions().mode() & 0o777
}

/// On SQLite, then on PostgreSQL unless the test skips it (`can_run`).
fn both(f: impl Fn(Db)) {
    f(Db::Sqlite);
    if can_run(Need::Postgres) {
        f(Db::Postgres);
    }
}

#[test]
fn init_creates_keys_with_mode_0600_and_refuses_to_run_twice() {
    let c = Controller::start(Db::Sqlite);
    for f in ["ca.key", "server.key", "signing.key", "admin.token", "controller.toml"] {
        assert_eq!(mode(&c.state.join(f)), 0o600, "{f}");
    }
    let config = std::fs::read_to_string(c.state.join("controller.toml")).unwrap();
    let token = std::fs::read_to_string(c.state.join("admin.token")).unwrap();
    assert!(!config.contains(token.trim()), "the admin credential is stored hashed, not in the configuration");
    fails_with(
        trellis_cmd(&["init", "--state-dir", c.state.to_str().unwrap(), "--advertise", "127.0.0.1:1"]),
        "already holds a controller",
    );
}

#[test]
fn a_node_enrols_with_one_pasted_line_and_its_keys_never_leave_it() {
    both(|db| {
        let c = Controller::start(db);
        c.ok(&["apply", "lab/basic"]);
        let token = c.token("db-1", &[]);
        assert!(token.len() <= 400 && !token.contains(char::is_whitespace), "{token}");
        let node = TempDir::new("node");
        let out = ok(enrol(&token, node.path()));
        assert!(out.contains("enrolled node db-1 in mesh basic (active)"), "{out}");
        for (f, m) in [("wireguard.key", 0o600), ("node.key", 0o600), ("node.pem", 0o644), ("ca.pem", 0o644), ("identity.toml", 0o644)] {
            assert_eq!(mode(&node.path().join(f)), m, "{f}");
        }
        let identity = std::fs::read_to_string(node.path().join("identity.toml")).unwrap();
        assert!(
            identity.contains("node = \"db-1\"")
                && identity.contains(&format!("127.0.0.1:{}", c.port))
                && identity.contains("signing_public_key"),
            "{identity}"
        );
        // The private keys are not in anything the controller holds.
        let wg_private = std::fs::read_to_string(node.path().join("wireguard.key")).unwrap();
        let tls_private = std::fs::read_to_string(node.path().join("node.key")).unwrap();
        let nodes = c.ok(&["nodes", "--json"]);
        assert!(!nodes.contains(wg_private.trim()) && !nodes.contains(&tls_private[40..80]), "{nodes}");
        let v: serde_json::Value = serde_json::from_str(&nodes).unwrap();
        let db1 = v.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap();
        assert_eq!(db1["state"], "active", "{db:?}");
        assert!(db1["cert_not_after"].as_i64().unwrap() > 0 && db1["key_fingerprint"].is_string() && db1["ipv4"].is_string());
        let text = c.ok(&["nodes"]);
        assert!(text.lines().any(|l| l.starts_with("op-1") && l.contains("declared")), "{text}");
        // The certificate names db-1, and the controller recorded its serial.
        let status: serde_json::Value = serde_json::from_str(&ok({
            let mut a = agent_bin();
            a.args(["status", "--state-dir", node.path().to_str().unwrap(), "--json"]);
            a
        }))
        .unwrap();
        assert_eq!(status["node"], "db-1");
        let audit = c.ok(&["audit", "verify"]);
        // The services CA scoped to the declared domain (audited by the apply), the apply, db-1's
        // token and its enrolment.
        assert!(audit.contains("audit chain verified: 4 records"), "{audit}");
    });
}

/// Unix seconds as GNU `date` writes them in RFC 3339 UTC: an oracle the binaries do not share.
fn rfc3339(unix: i64) -> String {
    let out = Command::new("date").args(["-u", "-d", &format!("@{unix}"), "+%Y-%m-%dT%H:%M:%SZ"]).output().unwrap();
    assert!(out.status.success(), "date -u -d @{unix}");
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// What an operator reads while enrolling: `token create` says to give the token in a file (an
/// argument shows in the process list and the shell's history), and every expiry is a date in
/// RFC 3339 UTC, never Unix seconds. Before, the hint was `trellis-agent enrol TOKEN` and the
/// agent said "valid until 1796194702 (unix)".
#[test]
fn enrolment_says_dates_as_dates_and_suggests_the_token_file() {
    let c = Controller::start(Db::Sqlite);
    c.ok(&["apply", "lab/basic"]);
    let out = c.admin(&["token", "create", "db-1"]).output().unwrap();
    assert!(out.status.success());
    let (token, hint) = (String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap());
    assert!(hint.contains("trellis-agent enrol --token-file FILE --state-dir DIR"), "{hint}");
    assert!(!hint.contains("enrol TOKEN"), "the token is not suggested as an argument: {hint}");
    let tokens: serde_json::Value = serde_json::from_str(&c.ok(&["token", "list", "--json"])).unwrap();
    let expires = tokens.as_array().unwrap().iter().find(|t| t["node"] == "db-1").unwrap()["expires_at"].as_i64().unwrap();
    assert!(hint.contains(&format!("valid until {};", rfc3339(expires))), "{hint}");

    let node = TempDir::new("dates");
    let file = node.path().join("db-1.token");
    std::fs::write(&file, token).unwrap();
    let state = node.path().join("state");
    let enrolled = ok({
        let mut a = agent_bin();
        a.args(["enrol", "--token-file", file.to_str().unwrap(), "--state-dir", state.to_str().unwrap()]);
        a
    });
    let nodes = c.nodes();
    let not_after = nodes.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap()["cert_not_after"].as_i64().unwrap();
    let until = rfc3339(not_after);
    assert!(enrolled.contains(&format!("certificate valid until {until};")), "{enrolled}");
    let status = ok({
        let mut a = agent_bin();
        a.args(["status", "--state-dir", state.to_str().unwrap()]);
        a
    });
    assert!(status.lines().any(|l| l.starts_with("certificate: serial ") && l.ends_with(&format!(", valid until {until}"))), "{status}");
    let table = c.ok(&["nodes"]);
    assert!(table.lines().any(|l| l.starts_with("db-1 ") && l.contains(&until)), "{table}");
    for text in [&hint, &enrolled, &status, &table] {
        assert!(!text.contains("(unix)") && !text.contains(&not_after.to_string()), "{text}");
    }
}

/// A control character in a declaration, or in what the agent keeps in its state directory,
/// reaches the terminal escaped as the audit list escapes it: `check`, a refused `apply` and
/// `trellis-agent status` print `\u{1b}`, never the raw byte. Before, the diagnostics and the
/// status lines carried ESC and BEL as they were.
#[test]
fn declaration_and_state_text_reach_the_terminal_escaped() {
    let decl = TempDir::new("escdecl");
    ok(sh("cp", &["-r", &format!("{}/lab/basic/.", repo().display()), decl.path().to_str().unwrap()]));
    let mesh = decl.path().join("mesh.toml");
    let text = std::fs::read_to_string(&mesh).unwrap();
    let text = text.replacen("admins = [\"op-1\"]", "admins = [\"op-1\", \"ghost\\u001b]0;pwned\\u0007\"]", 1);
    let text =
        text.replacen("modules = [\"postgres\", \"ssh\", \"ping\"]", "modules = [\"postgres\", \"ssh\", \"ping\", \"evil\\u001b[2K\"]", 1);
    std::fs::write(&mesh, text).unwrap();
    let raw = |s: &str| s.contains('\u{1b}') || s.contains('\u{7}');
    let expect_escaped = |err: &str| {
        assert!(!raw(err), "a raw control character reached the terminal:\n{err:?}");
        assert!(err.contains("lists `ghost\\u{1b}]0;pwned\\u{7}`, which is not a declared node"), "{err}");
        assert!(err.contains("runs module `evil\\u{1b}[2K`, which has no manifest"), "{err}");
    };
    let (out, d) = run(trellis_cmd(&["check", decl.path().to_str().unwrap()]));
    assert_eq!(out.status.code(), Some(1), "{d}");
    expect_escaped(&String::from_utf8_lossy(&out.stderr));

    let c = Controller::start(Db::Sqlite);
    let (out, d) = run(c.admin(&["apply", decl.path().to_str().unwrap()]));
    assert_eq!(out.status.code(), Some(1), "{d}");
    expect_escaped(&String::from_utf8_lossy(&out.stderr));

    c.ok(&["apply", "lab/basic"]);
    let node = TempDir::new("escstate");
    ok(enrol(&c.token("db-1", &[]), node.path()));
    let identity = node.path().join("identity.toml");
    let text = std::fs::read_to_string(&identity).unwrap().replacen("mesh = \"basic\"", "mesh = \"basic\\u001b[2K\"", 1);
    std::fs::write(&identity, text).unwrap();
    let status = serde_json::json!({
        "pid": 1, "updated_at": 1, "version": 0, "last_error": "nft failed\n    7  node approved db-1\u{1b}[2K",
        "interface": "wg\u{1b}0", "peers": [{"public_key": "k\u{1b}[31m", "endpoint": "192.0.2.1:1\u{7}", "last_handshake": null}],
        "ruleset_loaded": false, "dns_serving": ["10.0.0.1:53\u{1b}"], "buffered_evidence": 0, "dropped_evidence": 0,
    });
    std::fs::write(node.path().join("agent-status.json"), status.to_string()).unwrap();
    let shown = ok({
        let mut a = agent_bin();
        a.args(["status", "--state-dir", node.path().to_str().unwrap()]);
        a
    });
    assert!(!raw(&shown), "a raw control character reached the terminal:\n{shown:?}");
    for line in [
        "node db-1 in mesh basic\\u{1b}[2K (at enrolment: active)",
        "interface: wg\\u{1b}0",
        "  peer k\\u{1b}[31m endpoint 192.0.2.1:1\\u{7} last handshake never",
        "DNS serving: 10.0.0.1:53\\u{1b}",
        "last error: nft failed\\n    7  node approved db-1\\u{1b}[2K",
    ] {
        assert!(shown.lines().any(|l| l == line), "no {line:?} in\n{shown}");
    }
}

/// A pool token: one pasted line enrols as many runners as it has uses, each named by the
/// controller; `trellis nodes` and `token list` show the pool, and a use too many is refused.
#[test]
fn pool_members_enrol_with_one_line_and_are_listed_with_their_pool() {
    both(|db| {
        let c = Controller::start(db);
        c.ok(&["apply", "lab/pool"]);
        let token = c.ok(&["token", "create", "--pool", "ci", "--uses", "2", "--ttl", "10m"]).trim().to_string();
        let t = EnrolmentToken::decode(&token).unwrap();
        assert_eq!(t.node, "ci", "a pool token names its pool");
        let runners = [TempDir::new("ci-a"), TempDir::new("ci-b"), TempDir::new("ci-c")];
        for (i, r) in runners[..2].iter().enumerate() {
            let out = ok(enrol(&token, r.path()));
            assert!(out.contains(&format!("enrolled node ci-{} in mesh pool (active)", i + 1)), "{db:?}: {out}");
        }
        fails_with(enrol(&token, runners[2].path()), "token already used");
        let nodes = c.nodes();
        let pools: Vec<(&str, &str)> =
            nodes.as_array().unwrap().iter().map(|n| (n["name"].as_str().unwrap(), n["pool"].as_str().unwrap_or("-"))).collect();
        assert_eq!(pools, [("ci-1", "ci"), ("ci-2", "ci"), ("db-1", "-"), ("web-1", "-")], "{db:?}");
        let text = c.ok(&["nodes"]);
        assert!(text.lines().next().unwrap().contains(" POOL "), "{text}");
        assert!(text.lines().any(|l| l.starts_with("ci-2") && l.split_whitespace().nth(2) == Some("ci")), "{text}");
        let tokens = c.ok(&["token", "list"]);
        assert!(tokens.lines().any(|l| l.contains("pool:ci") && l.contains("used") && l.contains("2/2")), "{tokens}");
        let audit = c.ok(&["audit", "list"]);
        assert_eq!(audit.lines().filter(|l| l.contains("node enrolled")).count(), 2, "{audit}");
        fails_with(c.admin(&["token", "create", "--pool", "cd"]), "pool `cd` is not declared in revision 1");
    });
}

#[test]
fn a_token_works_once_even_when_two_nodes_race() {
    both(|db| {
        let c = Controller::start(db);
        c.ok(&["apply", "lab/basic"]);
        let token = c.token("api-1", &[]);
        let dirs = [TempDir::new("race-a"), TempDir::new("race-b")];
        let children: Vec<Child> =
            dirs.iter().map(|d| enrol(&token, d.path()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()).collect();
        let outs: Vec<Output> = children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
        let won = outs.iter().filter(|o| o.status.success()).count();
        assert_eq!(won, 1, "{db:?}: exactly one wins: {outs:?}");
        let loser = outs.iter().find(|o| !o.status.success()).unwrap();
        assert!(String::from_utf8_lossy(&loser.stderr).contains("token already used"), "{loser:?}");
    });
}

#[test]
fn damaged_expired_revoked_and_mismatched_tokens_are_refused_with_those_words() {
    let c = Controller::start(Db::Sqlite);
    c.ok(&["apply", "lab/basic"]);

    // Damaged: caught before anything is made or sent.
    let token = c.token("op-1", &[]);
    let mut damaged: Vec<char> = token.chars().collect();
    let i = damaged.len() / 2;
    damaged[i] = if damaged[i] == 'x' { 'y' } else { 'x' };
    let damaged: String = damaged.into_iter().collect();
    let node = TempDir::new("dmg");
    let nodedir = node.path().join("n");
    fails_with(enrol(&damaged, &nodedir), "token is damaged");
    assert!(!nodedir.exists(), "nothing is made for a damaged token");

    // Another CA's fingerprint: the agent aborts before sending the secret, so the token stays valid.
    let mut t = EnrolmentToken::decode(&token).unwrap();
    t.ca_fingerprint[0] ^= 0xff;
    fails_with(enrol(&t.encode().unwrap(), &nodedir), "does not match the token");
    let list = c.ok(&["token", "list", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&list).unwrap();
    assert_eq!(v[0]["state"], "valid", "the secret was never sent: {list}");

    // Revoked.
    let id = v[0]["id"].as_str().unwrap().to_string();
    c.ok(&["token", "revoke", &id]);
    fails_with(enrol(&token, &TempDir::new("rev").path().join("n")), "token has been revoked");

    // Expired.
    let short = c.token("op-1", &["--ttl", "1s"]);
    std::thread::sleep(Duration::from_millis(2100));
    fails_with(enrol(&short, &TempDir::new("exp").path().join("n")), "token has expired");

    // Tokens only for declared nodes that enrol.
    fails_with(c.admin(&["token", "create", "ghost"]), "node `ghost` is not declared");
    let list = c.ok(&["token", "list"]);
    assert!(list.contains("revoked") && list.contains("expired"), "{list}");
}

#[test]
fn a_wireguard_key_held_by_another_node_is_refused() {
    let c = Controller::start(Db::Sqlite);
    c.ok(&["apply", "lab/basic"]);
    let a = TempDir::new("key-a");
    ok(enrol(&c.token("db-1", &[]), a.path()));
    // A second node that somehow holds the same WireGuard key.
    let b = TempDir::new("key-b");
    std::fs::create_dir_all(b.path()).unwrap();
    std::fs::copy(a.path().join("wireguard.key"), b.path().join("wireguard.key")).unwrap();
    let token = c.token("op-1", &[]);
    fails_with(enrol(&token, b.path()), "already held by node `db-1`");
    assert_eq!(c.node_state("op-1"), "declared");
}

#[test]
fn renewal_needs_the_node_certificate_and_revocation_refuses_it_at_once() {
    both(|db| {
        let c = Controller::start(db);
        c.ok(&["apply", "lab/basic"]);
        let node = TempDir::new("renew");
        ok(enrol(&c.token("db-1", &[]), node.path()));
        let renew = |force: bool| {
            let mut a = agent_bin();
            a.args(["renew", "--state-dir", node.path().to_str().unwrap()]);
            if force {
                a.arg("--force");
            }
            a
        };
        let before = std::fs::read_to_string(node.path().join("node.pem")).unwrap();
        let out = ok(renew(false));
        assert!(out.contains("not due for renewal"), "{out}");
        ok(renew(true));
        let after = std::fs::read_to_string(node.path().join("node.pem")).unwrap();
        assert_ne!(before, after, "a new certificate was written");
        // No other node took part: nobody held its key, so it is revoked as soon as the publish
        // run has looked (ADR 0022).
        let said = c.ok(&["node", "revoke", "db-1", "--wait", "--timeout", "20s"]);
        assert!(said.starts_with("node db-1 is revoked (in "), "{said}");
        fails_with(renew(true), "node `db-1` has been revoked");
        assert_eq!(c.node_state("db-1"), "revoked");
        // The decision and its completion, each audited once.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !c.ok(&["audit", "list"]).contains("revocation completed") {
            assert!(Instant::now() < deadline, "{db:?}: the completion of db-1's revocation is not audited");
            std::thread::sleep(Duration::from_millis(100));
        }
        let audit = c.ok(&["audit", "verify"]);
        assert!(audit.contains("7 records"), "{db:?} {audit}");
    });
}

/// `trellis node revoke --wait` with a peer that holds the key and never applies (enrolled, no
/// agent running): it exits 1 after its timeout naming that peer and why, and `trellis nodes`
/// says the same under its table, and `--json` as the API does.
#[test]
fn a_revocation_waited_for_names_the_peer_that_still_holds_the_key() {
    both(|db| {
        let c = Controller::start(db);
        c.ok(&["apply", "lab/basic"]);
        for node in ["db-1", "api-1"] {
            let dir = TempDir::new(&format!("hold-{node}"));
            ok(enrol(&c.token(node, &[]), dir.path()));
        }
        // Both published: each holds the other's key in its bundle.
        let deadline = Instant::now() + Duration::from_secs(20);
        let published = || {
            let s: serde_json::Value = serde_json::from_str(&c.ok(&["status", "--json"])).unwrap();
            s.as_array().unwrap().iter().filter(|n| n["desired_version"].is_i64()).count() == 2
        };
        while !published() {
            assert!(Instant::now() < deadline, "{db:?}: api-1 and db-1 were not both published");
            std::thread::sleep(Duration::from_millis(100));
        }
        let err = fails_with(c.admin(&["node", "revoke", "db-1", "--wait", "--timeout", "2s"]), "node db-1 is still revoking (for ");
        assert!(err.contains("1 of 1 peer(s) still hold its key: api-1 applied nothing yet < v"), "{db:?} {err}");
        assert_eq!(c.node_state("db-1"), "revoking");
        let nodes = c.ok(&["nodes"]);
        assert!(nodes.lines().any(|l| l.starts_with("db-1: revoking (for ") && l.contains("api-1 applied nothing yet")), "{nodes}");
        let api: serde_json::Value = serde_json::from_str(&c.ok(&["nodes", "--json"])).unwrap();
        let rev = &api.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap()["revocation"];
        assert_eq!((rev["holders"].as_i64(), rev["holding"][0]["name"].as_str()), (Some(1), Some("api-1")), "{rev}");
    });
}

#[test]
fn an_expired_certificate_cannot_renew() {
    let c = Controller::start_with(Db::Sqlite, &["--cert-lifetime", "2s"]);
    c.ok(&["apply", "lab/basic"]);
    let node = TempDir::new("expired");
    ok(enrol(&c.token("db-1", &[]), node.path()));
    std::thread::sleep(Duration::from_millis(2500));
    let mut a = agent_bin();
    a.args(["renew", "--state-dir", node.path().to_str().unwrap(), "--force"]);
    fails_with(a, "enrol again with a new token");
}

#[test]
fn approval_holds_a_node_in_pending() {
    let c = Controller::start(Db::Sqlite);
    c.ok(&["apply", "lab/basic"]);
    let node = TempDir::new("pending");
    let out = ok(enrol(&c.token("op-1", &["--require-approval"]), node.path()));
    assert!(out.contains("(pending)"), "{out}");
    assert_eq!(c.node_state("op-1"), "pending");
    c.ok(&["node", "approve", "op-1"]);
    assert_eq!(c.node_state("op-1"), "active");
    fails_with(c.admin(&["node", "approve", "op-1"]), "is not pending approval");
}

#[test]
fn a_rejected_apply_changes_nothing_and_expect_revision_catches_a_race() {
    both(|db| {
        let c = Controller::start(db);
        let out = c.ok(&["apply", "lab/basic", "--expect-revision", "0", "--json"]);
        assert!(out.contains("\"revision\": 1"), "{out}");
        let bad = TempDir::new("bad");
        std::fs::create_dir_all(bad.path().join("modules")).unwrap();
        std::fs::write(
            bad.path().join("mesh.toml"),
            "[mesh]\nname = \"basic\"\ndomain = \"basic.mesh\"\noverlay_ipv4 = \"10.88.0.0/16\"\n[[node]]\nname = \"a\"\nscope = 1\n",
        )
        .unwrap();
        let err = fails_with(c.admin(&["apply", bad.path().to_str().unwrap()]), "nothing was changed");
        assert!(err.contains(&format!("{}/mesh.toml:7:1: error: unknown key `scope`", bad.path().display())), "{err}");
        // Still revision 1, and tokens for its nodes still work.
        c.token("db-1", &[]);
        let again = c.ok(&["apply", "lab/basic"]);
        assert!(again.contains("unchanged: revision 1"), "{again}");
        fails_with(c.admin(&["apply", "lab/basic", "--expect-revision", "0"]), "the current revision is 1, not 0");
    });
}

#[test]
fn admin_commands_need_the_credential() {
    let c = Controller::start(Db::Sqlite);
    let wrong = TempDir::new("wrong");
    std::fs::write(wrong.path().join("token"), "trellis-admin-nope\n").unwrap();
    let mut cmd = trellis_cmd(&["nodes", "--server", &format!("127.0.0.1:{}", c.port), "--admin-token-file"]);
    cmd.arg(wrong.path().join("token")).arg("--ca-file").arg(c.state.join("ca.pem"));
    fails_with(cmd, "the admin credential is wrong");
    let mut cmd = trellis_cmd(&["nodes", "--server", &format!("127.0.0.1:{}", c.port), "--admin-token-file"]);
    cmd.arg(c.state.join("admin.token")).arg("--ca-file").arg(c.state.join("ca.pem"));
    ok(cmd);
}

#[test]
fn two_controllers_share_one_postgresql() {
    if !can_run(Need::Postgres) {
        return;
    }
    let mut c = Controller::start(Db::Postgres);
    let second = free_port();
    c.serve(second);
    c.ok(&["apply", "lab/basic"]);
    // A token issued through the first controller is redeemed through the second.
    let token = c.token("db-1", &[]);
    let mut t = EnrolmentToken::decode(&token).unwrap();
    t.controllers = vec![format!("127.0.0.1:{second}")];
    let node = TempDir::new("replica");
    ok(enrol(&t.encode().unwrap(), node.path()));
    assert_eq!(c.node_state("db-1"), "active");
    // The same token through the first controller: already used, whichever replica answers.
    fails_with(enrol(&token, TempDir::new("replica2").path()), "token already used");
    // Two applies of a changed declaration race through the two replicas, both expecting
    // revision 1: exactly one wins, the other sees the conflict.
    let changed = TempDir::new("changed");
    copy_dir(&repo().join("lab/basic"), changed.path());
    let mesh = std::fs::read_to_string(changed.path().join("mesh.toml")).unwrap();
    std::fs::write(changed.path().join("mesh.toml"), mesh + "\n[[node]]\nname = \"extra-1\"\n").unwrap();
    let spawn = |port: u16| {
        let mut cmd =
            trellis_cmd(&["apply", changed.path().to_str().unwrap(), "--expect-revision", "1", "--server", &format!("127.0.0.1:{port}")]);
        cmd.arg("--admin-token-file").arg(c.state.join("admin.token")).arg("--ca-file").arg(c.state.join("ca.pem"));
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    };
    let children = vec![spawn(c.port), spawn(second)];
    let outs: Vec<Output> = children.into_iter().map(|ch| ch.wait_with_output().unwrap()).collect();
    assert_eq!(outs.iter().filter(|o| o.status.success()).count(), 1, "{outs:?}");
    let loser = outs.iter().find(|o| !o.status.success()).unwrap();
    assert!(String::from_utf8_lossy(&loser.stderr).contains("the current revision is 2, not 1"), "{loser:?}");
}

pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

#[test]
fn a_second_controller_with_another_ca_at_the_tokens_address_gets_no_secret() {
    let mut real = Controller::start(Db::Sqlite);
    real.ok(&["apply", "lab/basic"]);
    let token = real.token("db-1", &[]);
    real.stop_serving();
    // An impostor: a controller of its own, with its own CA, answering at the token's address.
    let impostor = TempDir::new("impostor");
    let state = impostor.path().join("state");
    let addr = format!("127.0.0.1:{}", real.port);
    ok(trellis_cmd(&["init", "--state-dir", state.to_str().unwrap(), "--advertise", &addr, "--listen", &addr]));
    let mut serve =
        trellis_cmd(&["serve", "--state-dir", state.to_str().unwrap()]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(Instant::now() < deadline, "impostor did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    let node = TempDir::new("victim");
    let err = fails_with(enrol(&token, node.path()), "does not match the token");
    assert!(err.contains("refusing to send the token's secret"), "{err}");
    let _ = serve.kill();
    let _ = serve.wait();
    // The real controller never saw the secret: the token still works, once.
    real.serve(real.port);
    assert!(real.ok(&["token", "list"]).contains("valid"));
    ok(enrol(&token, &node.path().join("again")));
    assert_eq!(real.node_state("db-1"), "active");
}

/// The attack: a node (compromised, or its operator careless) reports an evidence error that
/// carries a newline, a forged table row and terminal escapes. `trellis status` must show it on
/// its own row, escaped, with no control character reaching the terminal (before, it forged a
/// row and rewrote the operator's screen). An enrolment whose node name is not a name is
/// refused without being written anywhere.
#[test]
fn stored_strings_cannot_forge_rows_or_reach_the_terminal_raw() {
    let c = Controller::start(Db::Sqlite);
    c.ok(&["apply", "lab/basic"]);
    let node = TempDir::new("inject");
    ok(enrol(&c.token("db-1", &[]), node.path()));
    let status: serde_json::Value = serde_json::from_str(&c.ok(&["status", "--json"])).unwrap();
    let version = status.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap()["desired_version"].as_i64().unwrap();
    let forged = "x\nop-1                 active          1       1  current                                      0  \u{1b}[2K";
    let evidence =
        serde_json::json!({"records": [{"seq": 1, "version": version, "result": "failed", "error": forged, "files": [], "at": 1}]});
    let curl = |path: &str, body: &serde_json::Value, cert: bool| {
        let ca = c.state.join("ca.pem");
        let (cert_path, key_path) = (node.path().join("node.pem"), node.path().join("node.key"));
        let mut args = vec!["-sS", "--cacert", ca.to_str().unwrap(), "-H", "content-type: application/json"];
        if cert {
            args.extend(["--cert", cert_path.to_str().unwrap(), "--key", key_path.to_str().unwrap()]);
        }
        let body = body.to_string();
        let url = format!("https://127.0.0.1:{}{path}", c.port);
        let (out, d) = run(sh("curl", &[args.as_slice(), &["-d", &body, &url]].concat()));
        assert!(out.status.success(), "{d}");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let ack = curl("/v1/evidence", &evidence, true);
    assert!(ack.contains("\"accepted\":1"), "{ack}");
    let table = c.ok(&["status"]);
    assert!(!table.bytes().any(|b| b == 0x1b), "no escape byte reaches the terminal: {table:?}");
    let rows: Vec<&str> = table.lines().filter(|l| l.starts_with("db-1 ")).collect();
    assert_eq!(rows.len(), 1, "{table}");
    assert!(
        rows[0].ends_with("x\\nop-1                 active          1       1  current                                      0  \\u{1b}[2K"),
        "{table}"
    );
    assert_eq!(table.lines().filter(|l| l.starts_with("op-1")).count(), 1, "no forged row: {table}");

    let name = "x\n    9  2026-11-30 00:00:00Z  node approved  db-1\u{1b}[2K";
    let enrol =
        serde_json::json!({"token_id": "0000000000000000", "secret": "AAAA", "node": name, "csr_pem": "-", "wireguard_public_key": "-"});
    let refused = curl("/v1/enrol", &enrol, false);
    assert!(refused.contains("\"code\":\"bad_request\""), "{refused}");
    let audit = c.ok(&["audit", "list"]);
    assert!(!audit.contains("redemption refused"), "a malformed enrolment is not written to the audit chain: {audit}");
}

/// A careless setup: `init` and `enrol` given a directory open to others (1777, like /tmp)
/// refuse it with a sentence and leave its mode alone (before, both chmod'ed it to 0700 and a
/// 1777 directory lost its sticky bit); a refused enrolment leaves no key behind (before, a
/// `wireguard.key` stayed); the token can come from a file or standard input rather than the
/// command line, where `/proc/PID/cmdline` and the shell's history would keep it.
#[test]
fn open_directories_are_refused_unchanged_refusals_leave_nothing_and_tokens_come_from_files() {
    let full_mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    let open = TempDir::new("open");
    std::fs::set_permissions(open.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    let err =
        fails_with(trellis_cmd(&["init", "--state-dir", open.path().to_str().unwrap(), "--advertise", "127.0.0.1:1"]), "is open to others");
    assert!(err.contains("(mode 1777)"), "{err}");
    assert_eq!(full_mode(open.path()), 0o1777, "init keeps the directory's mode");

    let c = Controller::start(Db::Sqlite);
    c.ok(&["apply", "lab/basic"]);
    fails_with(enrol(&c.token("db-1", &[]), open.path()), "is open to others");
    assert_eq!(full_mode(open.path()), 0o1777, "enrol keeps the directory's mode");
    assert!(!open.path().join("wireguard.key").exists(), "no key is made in an open directory");

    let revoked = c.token("op-1", &[]);
    let list: serde_json::Value = serde_json::from_str(&c.ok(&["token", "list", "--json"])).unwrap();
    let id = list.as_array().unwrap().iter().find(|t| t["node"] == "op-1").unwrap()["id"].as_str().unwrap().to_string();
    c.ok(&["token", "revoke", &id]);
    let parent = TempDir::new("refused");
    let fresh = parent.path().join("n");
    fails_with(enrol(&revoked, &fresh), "token has been revoked");
    assert!(!fresh.exists(), "a refused enrolment leaves nothing it made");
    let kept = TempDir::new("kept");
    fails_with(enrol(&revoked, kept.path()), "token has been revoked");
    assert!(!kept.path().join("wireguard.key").exists(), "nor a key in a directory that was there");

    let file = parent.path().join("token");
    std::fs::write(&file, c.token("db-1", &[]) + "\n").unwrap();
    let by_file = parent.path().join("by-file");
    ok({
        let mut a = agent_bin();
        a.args(["enrol", "--token-file", file.to_str().unwrap(), "--state-dir", by_file.to_str().unwrap()]);
        a
    });
    assert_eq!(full_mode(&by_file), 0o700);
    let by_stdin = parent.path().join("by-stdin");
    let mut a = agent_bin();
    a.args(["enrol", "--token-file", "-", "--state-dir", by_stdin.to_str().unwrap()]).stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut child = a.spawn().unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), c.token("api-1", &[]).as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(by_stdin.join("identity.toml").exists());
    let (out, _) = run({
        let mut a = agent_bin();
        a.args(["enrol", "TOKEN", "--token-file", "-", "--state-dir", "/nonexistent"]);
        a
    });
    assert_eq!(out.status.code(), Some(2), "a token given twice is a usage error");
}

/// The attack: someone with write access to the database deletes the newest audit record (or
/// rewrites one and recomputes the chain). The chain alone still verifies; the controller's
/// signed checkpoint, kept outside the database, shows it. Before, `audit verify` passed.
#[test]
fn a_cut_audit_chain_is_caught_by_the_signed_checkpoint() {
    let c = Controller::start(Db::Sqlite);
    c.ok(&["apply", "lab/basic"]);
    c.token("db-1", &[]);
    c.token("op-1", &[]);
    // Token decisions are signed into the checkpoint by the watcher within half a second.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = c.ok(&["audit", "verify"]);
        if out.contains("matches the controller's checkpoint at record 4 (signed by the controller's key)") {
            break;
        }
        assert!(Instant::now() < deadline, "no checkpoint at the head: {out}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Read two records a request, the chain is checked across pages the same way, and listed
    // whole.
    let out = c.ok(&["audit", "verify", "--page-size", "2"]);
    assert!(out.contains("audit chain verified: 4 records") && out.contains("checkpoint at record 4"), "{out}");
    let listed: serde_json::Value = serde_json::from_str(&c.ok(&["audit", "list", "--json", "--page-size", "2"])).unwrap();
    let seqs: Vec<i64> = listed.as_array().unwrap().iter().map(|r| r["seq"].as_i64().unwrap()).collect();
    assert_eq!(seqs, vec![1, 2, 3, 4]);
    let text = c.ok(&["audit", "list", "--page-size", "1"]);
    assert_eq!(text.lines().count(), 5, "a header and four rows: {text}");
    let url = format!("sqlite://{}?mode=rw", c.state.join("trellis.db").display());
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        let s = trellis_store::Store::open(&url).await.unwrap();
        assert_eq!(s.execute_raw("DELETE FROM audit WHERE seq = 4").await.unwrap(), 1);
        assert_eq!(trellis_proto::audit::verify(&s.audit().await.unwrap()), Ok(3), "the cut chain verifies on its own");
    });
    std::thread::sleep(Duration::from_millis(800));
    let err = fails_with(c.admin(&["audit", "verify"]), "records were removed");
    assert!(err.contains("the audit chain ends at record 3, but the controller's checkpoint says it reached record 4"), "{err}");
    fails_with(c.admin(&["audit", "verify", "--page-size", "1"]), "the controller's checkpoint says it reached record 4");
}

fn renew(node: &Path) -> Command {
    let mut a = agent_bin();
    a.args(["renew", "--force", "--state-dir", node.to_str().unwrap()]);
    a
}

/// A TCP relay to a controller that cuts a connection the moment the controller starts to
/// answer after `committed()` turned true: the request was carried out, and its answer never
/// reaches the client. Only the first `cuts` connections are cut; the rest are relayed whole.
/// Returns the relay's port and the number of connections cut so far.
fn cutting_relay(
    to: u16,
    cuts: usize,
    committed: impl Fn() -> bool + Send + Sync + 'static,
) -> (u16, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let cut = Arc::new(AtomicUsize::new(0));
    let committed = Arc::new(committed);
    let (cut2, mut seen) = (cut.clone(), 0usize);
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(mut client) = client else { return };
            let Ok(mut server) = std::net::TcpStream::connect(("127.0.0.1", to)) else { return };
            let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c2, &mut s2);
                let _ = s2.shutdown(std::net::Shutdown::Write);
            });
            let may_cut = seen < cuts;
            seen += 1;
            let (cut, committed) = (cut2.clone(), committed.clone());
            std::thread::spawn(move || {
                let mut buf = [0u8; 16 * 1024];
                loop {
                    let n = match server.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if may_cut && committed() {
                        cut.fetch_add(1, Ordering::SeqCst);
                        break;
                    }
                    if client.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = client.shutdown(std::net::Shutdown::Both);
                let _ = server.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    (port, cut)
}

/// Issue 12, finding 10: the answer to an enrolment is lost after the controller committed it.
/// Before, the agent gave up and its retry with the same token got "token already used", so the
/// node needed a new token. Now the agent asks again with the same keys and is answered as the
/// first time; when it gives up, it keeps its keys, and the same command later completes the
/// enrolment. Other keys with the same token are still refused.
#[test]
fn a_lost_enrolment_answer_is_asked_for_again_with_the_same_keys() {
    both(|db| {
        let c = Controller::start(db);
        c.ok(&["apply", "lab/basic"]);
        let state = c.state.clone();
        let used = move |node: &'static str| {
            let state = state.clone();
            move || {
                let mut cmd = trellis_cmd(&["token", "list", "--json", "--state-dir", state.to_str().unwrap()]);
                let list: serde_json::Value = serde_json::from_slice(&cmd.output().unwrap().stdout).unwrap_or_default();
                list.as_array().into_iter().flatten().any(|t| t["node"] == node && t["state"] == "used")
            }
        };
        let through = |token: &str, port: u16| {
            let mut t = EnrolmentToken::decode(token).unwrap();
            t.controllers = vec![format!("127.0.0.1:{port}")];
            t.encode().unwrap()
        };
        let enrolled = |node: &str| {
            let v: serde_json::Value = serde_json::from_str(&c.ok(&["audit", "list", "--json"])).unwrap();
            v.as_array().unwrap().iter().filter(|r| r["action"] == "node enrolled" && r["subject"] == node).count()
        };

        // The first answer is cut after the commit; the agent asks again within its run.
        let token = c.token("db-1", &[]);
        let (relay, cut) = cutting_relay(c.port, 1, used("db-1"));
        let node = TempDir::new("lost");
        let mut cmd = enrol(&through(&token, relay), node.path());
        cmd.args(["--retry-for", "30"]);
        let (out, d) = run(cmd);
        assert!(out.status.success(), "{db:?}: the retry is answered\n{d}");
        assert_eq!(cut.load(std::sync::atomic::Ordering::SeqCst), 1, "the first answer was cut after the commit\n{d}");
        // The first wait is the agent's backoff for one failure: between half a second and one.
        let stderr = String::from_utf8_lossy(&out.stderr);
        let waited: f64 = stderr
            .split("asking again in ")
            .nth(1)
            .and_then(|r| r.split(" s with the same keys").next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(-1.0);
        assert!((0.5..=1.0).contains(&waited), "{d}");
        // The certificate it holds is the node's current one: it renews with it.
        assert_eq!(c.node_state("db-1"), "active");
        ok(renew(node.path()));
        assert_eq!(enrolled("db-1"), 1, "enrolled once");
        assert!(!node.path().join("enrol.pending").exists());
        // Other keys with the same token: refused.
        fails_with(enrol(&token, TempDir::new("thief").path()), "token already used");

        // Every answer is cut and the agent gives up at once: its keys stay, and the same
        // command, once the controller is reachable, completes the enrolment.
        let token = c.token("op-1", &[]);
        let (relay, cut) = cutting_relay(c.port, usize::MAX, used("op-1"));
        let node = TempDir::new("later");
        let mut cmd = enrol(&through(&token, relay), node.path());
        cmd.args(["--retry-for", "0"]);
        let err = fails_with(cmd, "it may have reached the controller, so this node's keys are kept in");
        assert_eq!(cut.load(std::sync::atomic::Ordering::SeqCst), 1, "{err}");
        assert_eq!(mode(&node.path().join("enrol.pending")), 0o600, "the pending TLS key is private");
        assert!(node.path().join("wireguard.key").exists() && !node.path().join("identity.toml").exists(), "{err}");
        let out = ok(enrol(&token, node.path()));
        assert!(out.contains("enrolled node op-1"), "{out}");
        ok(renew(node.path()));
        assert_eq!(enrolled("op-1"), 1, "enrolled once");
        assert!(!node.path().join("enrol.pending").exists());
    });
}

/// A PostgreSQL server of the test's own (so that it can be stopped and started), from
/// `scripts/postgres`; stopped and removed on drop.
struct OwnPostgres {
    url: String,
    dir: String,
}

impl OwnPostgres {
    fn start() -> OwnPostgres {
        let out = ok(sh(&repo().join("scripts/postgres").to_string_lossy(), &["start"]));
        let field = |name: &str| {
            out.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{name}=")))
                .unwrap_or_else(|| panic!("no {name} in {out}"))
                .to_string()
        };
        OwnPostgres { url: field("TRELLIS_TEST_POSTGRES_URL"), dir: field("TRELLIS_PG_DIR") }
    }

    fn pg_ctl(&self, args: &str) {
        let bin = ok(sh("sh", &["-c", "ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1"])).trim().to_string();
        ok(sh("su", &["postgres", "-s", "/bin/sh", "-c", &format!("'{bin}/pg_ctl' -D '{}/data' -w {args} >/dev/null", self.dir)]));
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let _ = sh(&repo().join("scripts/postgres").to_string_lossy(), &["stop", &self.dir]).output();
    }
}

/// Issue 12, faults: PostgreSQL restarted while the controller is busy. Before, a request during
/// the outage waited 30 s for a connection and then got `500 internal`. Now every request that
/// needs the database is answered `503 database_unavailable` with a sentence within seconds,
/// nodes keep getting their bundles from memory, and once the database is back the same
/// controller decides again, without a restart.
#[test]
fn a_database_restart_is_answered_503_with_a_sentence_and_the_controller_recovers() {
    // It starts its own PostgreSQL as the postgres user.
    if !can_run(Need::Root) {
        return;
    }
    let pg = OwnPostgres::start();
    let c = Controller::start_on(Some(pg.url.clone()), &[]);
    c.ok(&["apply", "lab/basic"]);
    let node = TempDir::new("pgnode");
    ok(enrol(&c.token("db-1", &[]), node.path()));
    let fetch = |out: &str| {
        let mut a = agent_bin();
        a.args(["fetch", "--state-dir", node.path().to_str().unwrap(), "--out", &node.path().join(out).to_string_lossy()]);
        a
    };
    ok(fetch("before.bundle"));

    // Load: a client deciding (token after token) all along, bounded in count and time.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (stop, state) = (stop.clone(), c.state.clone());
        std::thread::spawn(move || {
            let (mut ok, mut unavailable, mut other) = (0, 0, Vec::new());
            let started = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::SeqCst)
                && ok + unavailable + other.len() < 2000
                && started.elapsed() < Duration::from_secs(120)
            {
                let mut cmd = trellis_cmd(&["token", "create", "op-1", "--state-dir", state.to_str().unwrap()]);
                let out = cmd.output().unwrap();
                let err = String::from_utf8_lossy(&out.stderr).to_string();
                if out.status.success() {
                    ok += 1;
                } else if err.contains("the database is unavailable") {
                    unavailable += 1;
                } else {
                    other.push(err);
                }
            }
            (ok, unavailable, other)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    pg.pg_ctl("-m fast stop");
    let down = Instant::now();
    // A decision is refused promptly with the sentence; the health check and a node's bundle
    // are answered from memory.
    let t = Instant::now();
    let err = fails_with(c.admin(&["nodes"]), "the database is unavailable");
    assert!(t.elapsed() < Duration::from_secs(15), "answered after {:?}: {err}", t.elapsed());
    assert!(err.contains("nothing was changed: try again once it is back"), "{err}");
    ok(fetch("during.bundle"));
    std::thread::sleep(Duration::from_secs(1));
    // Started again as `scripts/postgres` starts it: same socket directory, address and port.
    let port = pg.url.rsplit(':').next().unwrap().split('/').next().unwrap().to_string();
    pg.pg_ctl(&format!("-o \"-k '{}' -c listen_addresses=127.0.0.1 -p {port} -c fsync=off\" start", pg.dir));
    let outage = down.elapsed();
    // Back: the same process decides again.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (out, d) = run(c.admin(&["token", "create", "api-1"]));
        if out.status.success() {
            break;
        }
        assert!(Instant::now() < deadline, "the controller did not recover: {d}\n{}", c.log(c.port));
        std::thread::sleep(Duration::from_millis(200));
    }
    let recovered = down.elapsed() - outage;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (ok, unavailable, other) = load.join().unwrap();
    eprintln!("database outage {outage:?}: {ok} decisions made around it, {unavailable} refused as unavailable, recovered {recovered:?} after the restart");
    assert!(other.is_empty(), "every refusal during the outage is the sentence: {other:?}");
    assert!(unavailable > 0 && ok > 0, "the load saw the outage and the recovery ({ok} ok, {unavailable} unavailable)");
    let audit = c.ok(&["audit", "verify"]);
    assert!(audit.contains("audit chain verified"), "{audit}");
}

//! PostgreSQL failover (issue 33): controllers on one PostgreSQL follow it when its primary is
//! lost and a streaming standby is promoted, without a restart, and lose nothing that was
//! acknowledged.
//!
//! sqlx's PostgreSQL driver takes one host (no libpq host lists, no `target_session_attrs`), so
//! the controllers reach the database through a TCP forwarder, as they would through HAProxy or
//! pgbouncer in production: it relays to the current primary and is switched after promotion.

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use trellis_core::token::EnrolmentToken;
use trellis_testing::cmd::describe;
use trellis_testing::{can_run, Need, TempDir};

use crate::controller::{free_port, Controller};
use crate::support::trellis_cmd;

const BIN: &str = "/usr/lib/postgresql/15/bin";

/// Runs `cmd`, killing it after `limit`: every wait of this test is bounded.
fn run_within(mut cmd: Command, limit: Duration) -> (Output, String) {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let pid = child.id();
    let done = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let done = done.clone();
        std::thread::spawn(move || {
            let deadline = Instant::now() + limit;
            while !done.load(Ordering::SeqCst) {
                if Instant::now() > deadline {
                    // Only the child this call started, by its id.
                    let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let out = child.wait_with_output().unwrap();
    done.store(true, Ordering::SeqCst);
    let _ = watchdog.join();
    let d = describe(&cmd, &out);
    (out, d)
}

#[track_caller]
fn ok_within(cmd: Command, limit: Duration) -> String {
    let (out, d) = run_within(cmd, limit);
    assert!(out.status.success(), "command failed\n{d}");
    String::from_utf8(out.stdout).unwrap()
}

/// A command run as the `postgres` user.
fn as_postgres(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new("runuser");
    c.args(["-u", "postgres", "--", &format!("{BIN}/{program}")]).args(args);
    c
}

/// One PostgreSQL server of the test's own on 127.0.0.1; stopped (immediately) on drop.
struct Server {
    data: PathBuf,
    port: u16,
}

impl Server {
    fn pg_ctl(&self, args: &[&str]) -> (Output, String) {
        let mut a = vec!["-D", self.data.to_str().unwrap(), "-l"];
        let log = self.data.with_extension("log");
        a.push(log.to_str().unwrap());
        a.extend_from_slice(args);
        run_within(as_postgres("pg_ctl", &a), Duration::from_secs(60))
    }

    /// Starts the server on its port; a port taken meanwhile by someone else is a failure to
    /// retry with another (see `primary`).
    fn start(&self) -> bool {
        let (out, _) = self.pg_ctl(&["-w", "-t", "30", "-o", &format!("-p {}", self.port), "start"]);
        out.status.success()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.data.with_extension("log")).unwrap_or_default()
    }

    /// One SQL statement's rows, `|`-separated, through `psql` on TCP.
    fn sql(&self, statement: &str) -> String {
        let port = self.port.to_string();
        let mut c = Command::new(format!("{BIN}/psql"));
        c.args(["-h", "127.0.0.1", "-p", &port, "-U", "postgres", "-d", "postgres", "-XAtc", statement]);
        ok_within(c, Duration::from_secs(20)).trim().to_string()
    }

    /// Appends settings to the server's postgresql.conf (later lines win).
    fn configure(&self, lines: &str) {
        let mut f = std::fs::OpenOptions::new().append(true).open(self.data.join("postgresql.conf")).unwrap();
        writeln!(f, "\n# trellis pg_failover\n{lines}").unwrap();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-m", "immediate", "-w", "stop"]);
    }
}

/// The primary: synchronous replication to whichever standby connects (`*`), so a commit is
/// acknowledged only once the standby has flushed it.
fn primary(root: &Path) -> Server {
    let data = root.join("primary");
    ok_within(as_postgres("initdb", &["-D", data.to_str().unwrap(), "-A", "trust", "-U", "postgres"]), Duration::from_secs(120));
    let mut s = Server { data, port: 0 };
    s.configure(&format!(
        "listen_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\nmax_connections = 100\n\
         synchronous_standby_names = '*'\nsynchronous_commit = on\nwal_level = replica\nmax_wal_senders = 4",
        root.display()
    ));
    for _ in 0..10 {
        s.port = free_port();
        if s.start() {
            return s;
        }
    }
    panic!("the primary did not start:\n{}", s.log());
}

/// A streaming standby of `primary`, made by `pg_basebackup -R`; itself asks for no synchronous
/// standby, so that once promoted (alone) its commits do not wait for one.
fn standby(root: &Path, primary: &Server) -> Server {
    let data = root.join("standby");
    let port = primary.port.to_string();
    ok_within(
        as_postgres(
            "pg_basebackup",
            &["-h", "127.0.0.1", "-p", &port, "-U", "postgres", "-D", data.to_str().unwrap(), "-R", "-X", "stream"],
        ),
        Duration::from_secs(120),
    );
    let mut s = Server { data, port: 0 };
    s.configure("synchronous_standby_names = ''");
    for _ in 0..10 {
        s.port = free_port();
        if s.start() {
            return s;
        }
    }
    panic!("the standby did not start:\n{}", s.log());
}

/// A TCP forwarder on loopback to the current primary, as HAProxy or pgbouncer would be. A
/// switch sends new connections to the new primary and leaves the sessions to the old one alone:
/// they end as the old server's side ends (its process killed), so the controllers' pools must
/// notice their dead connections themselves.
struct Forwarder {
    port: u16,
    to: Arc<AtomicU16>,
}

impl Forwarder {
    fn start(to: u16) -> Forwarder {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(AtomicU16::new(to));
        let t = target.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(("127.0.0.1", t.load(Ordering::SeqCst))) else {
                    // No primary there: the client sees its connection closed, as behind a proxy.
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let relay = |mut from: TcpStream, mut to: TcpStream| {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(Shutdown::Both);
                        let _ = from.shutdown(Shutdown::Both);
                    })
                };
                relay(client.try_clone().unwrap(), server.try_clone().unwrap());
                relay(server, client);
            }
        });
        Forwarder { port, to: target }
    }

    fn switch(&self, to: u16) {
        self.to.store(to, Ordering::SeqCst);
    }
}

/// `trellis ARGS` through the replica on `port`, bounded.
fn through(c: &Controller, port: u16, args: &[&str]) -> Command {
    let mut cmd = trellis_cmd(args);
    cmd.args(["--server", &format!("127.0.0.1:{port}")]);
    cmd.arg("--admin-token-file").arg(c.state.join("admin.token")).arg("--ca-file").arg(c.state.join("ca.pem"));
    cmd
}

/// A token for `node` through the replica on `port`: its id, or what was said.
fn create_token(c: &Controller, port: u16, node: &str) -> Result<String, String> {
    let (out, d) = run_within(through(c, port, &["token", "create", node]), Duration::from_secs(30));
    if !out.status.success() {
        return Err(d);
    }
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let t = EnrolmentToken::decode(&text).unwrap_or_else(|e| panic!("{e:?}: {d}"));
    Ok(hex::encode(t.id))
}

fn token_ids(c: &Controller, port: u16) -> Vec<String> {
    let list: serde_json::Value =
        serde_json::from_str(&ok_within(through(c, port, &["token", "list", "--json"]), Duration::from_secs(30))).unwrap();
    list.as_array().unwrap().iter().map(|t| t["id"].as_str().unwrap().to_string()).collect()
}

fn audit(c: &Controller, port: u16) -> Vec<serde_json::Value> {
    let list: serde_json::Value =
        serde_json::from_str(&ok_within(through(c, port, &["audit", "list", "--json"]), Duration::from_secs(30))).unwrap();
    list.as_array().unwrap().clone()
}

/// Two `trellis serve` replicas on one PostgreSQL, through a forwarder. Decisions are made all
/// along through the first; the primary is killed (`pg_ctl stop -m immediate`), the standby
/// promoted and the forwarder switched to it. Each replica, without a restart, decides again
/// within 60 s; every token acknowledged before the kill is there after it, the audit records
/// before the kill are the first records after it, and `audit verify` passes through each.
#[test]
fn controllers_follow_a_promoted_standby_and_lose_nothing_acknowledged() {
    // It starts PostgreSQL servers of its own as the postgres user.
    if !can_run(Need::Root) || !Path::new(BIN).join("pg_basebackup").exists() {
        assert!(!std::env::var("TRELLIS_TEST_REQUIRE_ALL").is_ok_and(|v| !v.is_empty() && v != "0"), "{BIN} is missing");
        return;
    }
    let root = TempDir::new("pgfo");
    let mut chown = Command::new("chown");
    chown.args(["postgres", root.path().to_str().unwrap()]);
    ok_within(chown, Duration::from_secs(5));
    let primary = primary(root.path());
    let standby = standby(root.path(), &primary);
    // The standby streams and is synchronous before anything is decided.
    let deadline = Instant::now() + Duration::from_secs(30);
    while primary.sql("SELECT sync_state FROM pg_stat_replication") != "sync" {
        assert!(Instant::now() < deadline, "the standby is not synchronous:\n{}\n{}", primary.log(), standby.log());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(standby.sql("SELECT pg_is_in_recovery()"), "t");

    let forwarder = Forwarder::start(primary.port);
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", forwarder.port);
    let mut c = Controller::start_on(Some(url), &[]);
    let second = free_port();
    c.serve(second);
    let replicas = [c.port, second];
    ok_within(through(&c, c.port, &["apply", "lab/basic"]), Duration::from_secs(60));
    for &port in &replicas {
        create_token(&c, port, "db-1").unwrap_or_else(|d| panic!("{d}"));
    }

    // Decisions all along, through the first replica: what is acknowledged is recorded.
    let stop = Arc::new(AtomicBool::new(false));
    let acked: Arc<Mutex<Vec<String>>> = Arc::default();
    let load = {
        let (stop, acked, c_state, port) = (stop.clone(), acked.clone(), c.state.clone(), c.port);
        std::thread::spawn(move || {
            let (mut refused, started) = (Vec::new(), Instant::now());
            while !stop.load(Ordering::SeqCst) && started.elapsed() < Duration::from_secs(180) {
                let mut cmd = trellis_cmd(&["token", "create", "op-1", "--server", &format!("127.0.0.1:{port}")]);
                cmd.arg("--admin-token-file").arg(c_state.join("admin.token")).arg("--ca-file").arg(c_state.join("ca.pem"));
                let (out, d) = run_within(cmd, Duration::from_secs(30));
                if out.status.success() {
                    let t = EnrolmentToken::decode(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
                    acked.lock().unwrap().push(hex::encode(t.id));
                } else {
                    refused.push(d);
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            refused
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked.lock().unwrap().len() < 5 {
        assert!(Instant::now() < deadline, "no decisions under load");
        std::thread::sleep(Duration::from_millis(50));
    }
    let before = audit(&c, second);

    // The primary is lost, the standby promoted, the forwarder switched.
    let (out, d) = primary.pg_ctl(&["-m", "immediate", "-w", "stop"]);
    assert!(out.status.success(), "{d}");
    let acked_before_kill = acked.lock().unwrap().clone();
    let (out, d) = standby.pg_ctl(&["-w", "-t", "30", "promote"]);
    assert!(out.status.success(), "{d}\n{}", standby.log());
    let promoted = Instant::now();
    assert_eq!(standby.sql("SELECT pg_is_in_recovery()"), "f");
    forwarder.switch(standby.port);

    // Every replica decides again, without a restart, within a bounded time.
    let mut took = Vec::new();
    for &port in &replicas {
        let deadline = promoted + Duration::from_secs(60);
        loop {
            match create_token(&c, port, "api-1") {
                Ok(_) => break,
                Err(d) => assert!(
                    Instant::now() < deadline,
                    "the replica on {port} did not decide again within 60 s of the promotion: {d}\n{}",
                    c.log(port)
                ),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        took.push(promoted.elapsed());
    }
    // The load goes on through the new primary.
    let resumed = acked.lock().unwrap().len();
    let deadline = Instant::now() + Duration::from_secs(60);
    while acked.lock().unwrap().len() < resumed + 3 {
        assert!(Instant::now() < deadline, "the load did not resume");
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::SeqCst);
    let refused = load.join().unwrap();
    let acked = acked.lock().unwrap().clone();
    eprintln!(
        "first decision after the promotion: {:?} through the first replica, {:?} through the second; \
         {} tokens acknowledged ({} before the kill), {} refused during the move",
        took[0],
        took[1],
        acked.len(),
        acked_before_kill.len(),
        refused.len()
    );
    for d in &refused {
        assert!(d.contains("the database is unavailable"), "a refusal during the move is the sentence: {d}");
    }

    // Nothing acknowledged is lost, whichever replica is asked.
    for &port in &replicas {
        let ids = token_ids(&c, port);
        let lost: Vec<&String> = acked.iter().filter(|id| !ids.contains(id)).collect();
        assert!(lost.is_empty(), "acknowledged tokens missing after the failover through {port}: {lost:?}");
        let after = audit(&c, port);
        assert!(after.len() > before.len() && after[..before.len()] == before[..], "the audit chain before the kill is kept");
        let out = ok_within(through(&c, port, &["audit", "verify"]), Duration::from_secs(30));
        assert!(out.contains("audit chain verified"), "{out}");
    }
    // The records the controllers wrote are on the promoted server itself.
    let n: usize = standby.sql("SELECT count(*) FROM audit").parse().unwrap();
    assert!(n >= before.len(), "{n} audit records on the promoted standby, {} before the kill", before.len());
    drop(c);
}

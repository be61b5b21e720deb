//! Service certificates end to end (ADR 0023), on SQLite and PostgreSQL: a module with a
//! `[module.certificate]` assigned to a node, its agent's key and certificate on disk, verified
//! by `openssl verify` and by a TLS client (`openssl s_client -verify_hostname`) against the
//! mesh CA; `trellis certs` lists it; the module taken away, the files go.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use trellis_testing::cmd::{ok, run, sh, Proc};
use trellis_testing::{can_run, repo, Need, TempDir};

use crate::controller::{agent_bin, copy_dir, enrol, free_port, Controller, Db};

/// lab/basic with PostgreSQL on `postgres_on` (`op-1` or `db-1`), its key root's alone (no
/// group: the host's groups are not the test's business), in `dir`.
fn basic_with_postgres_on(dir: &Path, postgres_on: &str) {
    copy_dir(&repo().join("lab/basic"), dir);
    let pg = dir.join("modules/postgres.toml");
    let text = std::fs::read_to_string(&pg).unwrap().replace("group = \"postgres\"\n", "");
    std::fs::write(&pg, text).unwrap();
    let mesh = dir.join("mesh.toml");
    let mut text = std::fs::read_to_string(&mesh).unwrap();
    if postgres_on == "op-1" {
        text = text.replace("modules = [\"postgres\", \"ssh\", \"ping\"]", "modules = [\"ssh\", \"ping\"]").replace(
            "name = \"op-1\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]",
            "name = \"op-1\"\nnetworks = [\"lan\"]\nmodules = [\"postgres\", \"ping\"]",
        );
    }
    std::fs::write(&mesh, text).unwrap();
}

/// db-1 enrolled and its agent running files-only under `work` (long-polling `wait` seconds):
/// the agent, its root and its log.
fn db_1_agent(c: &Controller, work: &Path, wait: &str) -> (Proc, std::path::PathBuf, std::path::PathBuf) {
    let state = work.join("agent-db-1");
    let root = work.join("root-db-1");
    ok(enrol(&c.token("db-1", &[]), &state));
    let log = work.join("agent.log");
    let mut cmd = agent_bin();
    cmd.args(["run", "--files-only", "--wait", wait, "--state-dir", state.to_str().unwrap(), "--root", root.to_str().unwrap()]);
    let agent = Proc(cmd.stdout(Stdio::null()).stderr(std::fs::File::create(&log).unwrap()).spawn().unwrap());
    (agent, root, log)
}

/// `openssl verify` of the files in `dir` for `name`: whether it verifies, and what it said.
fn verifies(dir: &Path, name: &str) -> (bool, String) {
    let p = |f: &str| dir.join(f).to_str().unwrap().to_string();
    let (out, d) = run(sh(
        "openssl",
        &[
            "verify",
            "-x509_strict",
            "-purpose",
            "sslserver",
            "-verify_hostname",
            name,
            "-CAfile",
            &p("ca.pem"),
            "-untrusted",
            &p("chain.pem"),
            &p("cert.pem"),
        ],
    ));
    (out.status.success(), d)
}

#[test]
fn a_module_assigned_to_a_node_brings_its_certificate_which_a_tls_client_verifies() {
    if !can_run(Need::Program("openssl")) {
        return;
    }
    let mut dbs = vec![Db::Sqlite];
    if can_run(Need::Postgres) {
        dbs.push(Db::Postgres);
    }
    for db in dbs {
        let c = Controller::start(db);
        let work = TempDir::new("certs");
        let (without, with) = (work.path().join("without"), work.path().join("with"));
        basic_with_postgres_on(&without, "op-1");
        basic_with_postgres_on(&with, "db-1");
        c.ok(&["apply", without.to_str().unwrap()]);

        let (_agent, root, log) = db_1_agent(&c, work.path(), "5");
        let logs = || format!("--- agent\n{}\n--- serve\n{}", std::fs::read_to_string(&log).unwrap_or_default(), c.log(c.port));
        let until = |what: &str, secs: u64, done: &dyn Fn() -> bool| {
            let deadline = Instant::now() + Duration::from_secs(secs);
            while !done() {
                assert!(Instant::now() < deadline, "{what} within {secs} s ({db:?})\n{}", logs());
                std::thread::sleep(Duration::from_millis(20));
            }
        };
        until("db-1's first bundle applied", 30, &|| root.join("etc/trellis/node.toml").exists());
        let dir = root.join("etc/trellis/certs/postgres");
        assert!(!dir.exists(), "no certificate before the module is assigned");

        // Assigned: the certificate is on disk and verifies. The time from the apply's answer
        // until then is printed (measured by `trellis-dev`-style runs, not asserted).
        c.ok(&["apply", with.to_str().unwrap()]);
        let assigned = Instant::now();
        until("the certificate for postgres verifies", 30, &|| dir.join("cert.pem").exists() && verifies(&dir, "postgres.basic.mesh").0);
        eprintln!("module assigned -> certificate on disk and verified: {} ms ({db:?})", assigned.elapsed().as_millis());
        let (good, d) = verifies(&dir, "db-1.basic.mesh");
        assert!(good, "the node's own name too\n{d}");
        let (good, d) = verifies(&dir, "api.basic.mesh");
        assert!(!good, "a name the node does not serve\n{d}");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(dir.join("key.pem")).unwrap().permissions().mode() & 0o777, 0o600, "no group: root's alone");

        // A TLS client verifies postgres.basic.mesh against the mesh CA, as `sslmode=verify-full`
        // does; another name it refuses.
        let port = free_port().to_string();
        let p = |f: &str| dir.join(f).to_str().unwrap().to_string();
        let _server = Proc(
            sh(
                "openssl",
                &[
                    "s_server",
                    "-quiet",
                    "-accept",
                    &format!("127.0.0.1:{port}"),
                    "-cert",
                    &p("cert.pem"),
                    "-key",
                    &p("key.pem"),
                    "-cert_chain",
                    &p("chain.pem"),
                ],
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
        );
        until("openssl s_server listening", 10, &|| std::net::TcpStream::connect(("127.0.0.1", port.parse::<u16>().unwrap())).is_ok());
        let ca = root.join("etc/trellis/ca.pem");
        assert!(ca.exists(), "every node holds the mesh CA");
        let client = |name: &str| {
            let mut cmd = sh(
                "openssl",
                &[
                    "s_client",
                    "-connect",
                    &format!("127.0.0.1:{port}"),
                    "-servername",
                    name,
                    "-verify_hostname",
                    name,
                    "-verify_return_error",
                    "-CAfile",
                    ca.to_str().unwrap(),
                ],
            );
            cmd.stdin(Stdio::null());
            run(cmd)
        };
        let (out, d) = client("postgres.basic.mesh");
        assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("Verify return code: 0 (ok)"), "{d}");
        let (out, d) = client("api.basic.mesh");
        assert!(!out.status.success(), "a name the certificate does not carry must not verify\n{d}");

        // Listed for the operator, with the serial on disk.
        let on_disk = trellis_pki::services::inspect_service(&std::fs::read_to_string(dir.join("cert.pem")).unwrap()).unwrap();
        let listed: serde_json::Value = serde_json::from_str(&c.ok(&["certs", "--json"])).unwrap();
        let entry = listed.as_array().unwrap().iter().find(|e| e["node"] == "db-1").unwrap_or_else(|| panic!("{listed}"));
        assert_eq!((entry["module"].as_str(), entry["serial"].as_str()), (Some("postgres"), Some(on_disk.serial.as_str())), "{entry}");
        assert_eq!(entry["declared"], true);
        let human = c.ok(&["certs"]);
        assert!(human.contains("db-1") && human.contains("postgres.basic.mesh") && human.contains(&on_disk.serial), "{human}");

        // Taken away: the files go, and the agent says nothing is wrong.
        c.ok(&["apply", without.to_str().unwrap()]);
        until("the certificate removed", 30, &|| !dir.exists());
        let listed: serde_json::Value = serde_json::from_str(&c.ok(&["certs", "--json"])).unwrap();
        let entry = listed.as_array().unwrap().iter().find(|e| e["node"] == "db-1").unwrap();
        assert_eq!(entry["declared"], false, "{entry}");
    }
}

/// The review of 2026-12-02, finding 13: under the shipped unit (its `UMask` and capability
/// bounding set, read from `dist/trellis-agent.service`), the key's group could not be set (no
/// CAP_CHOWN) and the umask made every file 0600 and every directory 0700, root's alone: the
/// service could read neither its key nor the CA. The agent runs here as the unit runs it, and
/// the service's group reads its key, everyone the certificate, the chain and the CA.
#[test]
fn under_the_shipped_unit_a_services_group_reads_its_key_and_everyone_the_ca() {
    if !can_run(Need::Root) || !can_run(Need::Program("setpriv")) {
        return;
    }
    let unit = std::fs::read_to_string(repo().join("dist/trellis-agent.service")).unwrap();
    let value =
        |key: &str| unit.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_else(|| panic!("the unit has no {key}")).trim().to_string();
    let umask = value("UMask=");
    let caps: Vec<String> =
        value("CapabilityBoundingSet=").split_whitespace().map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase())).collect();
    let c = Controller::start(Db::Sqlite);
    let work = TempDir::new("certs-unit");
    let decl = work.path().join("decl");
    copy_dir(&repo().join("lab/basic"), &decl);
    // www-data: a service's group every Debian host has.
    let pg = decl.join("modules/postgres.toml");
    let text = std::fs::read_to_string(&pg).unwrap();
    assert!(text.contains("group = \"postgres\"\n"), "{text}");
    std::fs::write(&pg, text.replace("group = \"postgres\"\n", "group = \"www-data\"\n")).unwrap();
    c.ok(&["apply", decl.to_str().unwrap()]);
    let (state, root) = (work.path().join("agent-db-1"), work.path().join("root-db-1"));
    ok(enrol(&c.token("db-1", &[]), &state));
    let log = work.path().join("agent.log");
    let agent = agent_bin();
    let script = format!(
        "umask {umask}; exec setpriv --bounding-set=-all,{} -- {} run --files-only --wait 5 --state-dir {} --root {}",
        caps.join(","),
        agent.get_program().to_str().unwrap(),
        state.display(),
        root.display()
    );
    let _agent = Proc(
        std::process::Command::new("sh")
            .args(["-c", &script])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let dir = root.join("etc/trellis/certs/postgres");
    let deadline = Instant::now() + Duration::from_secs(40);
    while !(dir.join("cert.pem").exists() && dir.join("key.pem").exists()) {
        assert!(
            Instant::now() < deadline,
            "no certificate for postgres within 40 s\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = |p: &Path| std::fs::metadata(p).unwrap();
    let group = ok(sh("getent", &["group", "www-data"]));
    let www_data: u32 =
        group.split(':').nth(2).and_then(|g| g.trim().parse().ok()).unwrap_or_else(|| panic!("getent group www-data: {group}"));
    let key = meta(&dir.join("key.pem"));
    assert_eq!((key.permissions().mode() & 0o777, key.gid()), (0o640, www_data), "the key is its service's group's to read");
    for f in ["cert.pem", "chain.pem", "ca.pem"] {
        assert_eq!(meta(&dir.join(f)).permissions().mode() & 0o777, 0o644, "{f}");
    }
    assert_eq!(meta(&root.join("etc/trellis/ca.pem")).permissions().mode() & 0o777, 0o644, "the mesh CA clients are told to use");
    for d in ["etc", "etc/trellis", "etc/trellis/certs", "etc/trellis/certs/postgres"] {
        assert_eq!(meta(&root.join(d)).permissions().mode() & 0o777, 0o755, "{d}");
    }
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!said.contains("Operation not permitted"), "{said}");
}

/// A one-minute lifetime: the agent renews at two thirds of it (less its jitter) with a new key,
/// the files are replaced whole, and the new certificate verifies; the controller audited both.
#[test]
fn a_short_lived_certificate_is_renewed_with_a_new_key_before_it_expires() {
    if !can_run(Need::Program("openssl")) {
        return;
    }
    let c = Controller::start(Db::Sqlite);
    let work = TempDir::new("certs-renew");
    let decl = work.path().join("decl");
    basic_with_postgres_on(&decl, "db-1");
    let mesh = decl.join("mesh.toml");
    let text = std::fs::read_to_string(&mesh)
        .unwrap()
        .replace("domain = \"basic.mesh\"\n", "domain = \"basic.mesh\"\nservice_cert_lifetime = \"1m\"\n");
    std::fs::write(&mesh, text).unwrap();
    c.ok(&["apply", decl.to_str().unwrap()]);
    let (_agent, root, log) = db_1_agent(&c, work.path(), "2");
    let dir = root.join("etc/trellis/certs/postgres");
    let read = || {
        let cert = std::fs::read_to_string(dir.join("cert.pem")).ok()?;
        let key = std::fs::read_to_string(dir.join("key.pem")).ok()?;
        Some((trellis_pki::services::inspect_service(&cert).ok()?, key))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let (first, first_key) = loop {
        if let Some(r) = read() {
            break r;
        }
        assert!(Instant::now() < deadline, "no certificate\n{}", std::fs::read_to_string(&log).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(first.not_after - first.not_before, 60 + 60, "a minute, and the minute of grace before it");
    // Renewed at two thirds of the minute counted from issuance (not from the backdated
    // not_before), less up to a twelfth: 35-40 s after issuance.
    let deadline = Instant::now() + Duration::from_secs(45);
    let (second, second_key) = loop {
        if let Some((info, key)) = read().filter(|(i, _)| i.serial != first.serial) {
            break (info, key);
        }
        assert!(Instant::now() < deadline, "not renewed\n{}", std::fs::read_to_string(&log).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(second.not_after > first.not_after);
    let renewed_after = second.not_before - first.not_before;
    assert!((34..=41).contains(&renewed_after), "renewed {renewed_after} s after issuance, not at two thirds of its minute");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    assert!(now < first.not_after, "renewed before the first expired");
    assert_ne!(second_key, first_key, "a new key for the new certificate");
    let (good, d) = verifies(&dir, "postgres.basic.mesh");
    assert!(good, "{d}");
    let audit = c.ok(&["audit", "list", "--json"]);
    let issued = audit.matches("\"service certificate issued\"").count();
    assert!(issued >= 2, "both issuances audited: {audit}");
}

/// A certificate that fails on the node, where the controller cannot see it (here the key's
/// group does not exist on the host, so the agent writes no key and sends no CSR): the agent
/// reports it, and `trellis certs` and `trellis status` name the node, the module and why.
#[test]
fn a_certificate_failing_on_the_node_is_reported_to_the_operator() {
    let c = Controller::start(Db::Sqlite);
    let work = TempDir::new("certs-failing");
    let decl = work.path().join("decl");
    basic_with_postgres_on(&decl, "db-1");
    let pg = decl.join("modules/postgres.toml");
    let text =
        std::fs::read_to_string(&pg).unwrap().replace("[module.certificate]\n", "[module.certificate]\ngroup = \"trellisnosuchgroup\"\n");
    std::fs::write(&pg, text).unwrap();
    c.ok(&["apply", decl.to_str().unwrap()]);
    let (_agent, root, log) = db_1_agent(&c, work.path(), "5");
    let deadline = Instant::now() + Duration::from_secs(30);
    let entry = loop {
        let listed: serde_json::Value = serde_json::from_str(&c.ok(&["certs", "--json"])).unwrap();
        let pg = listed.as_array().unwrap().iter().find(|e| e["node"] == "db-1" && e["module"] == "postgres").cloned();
        if let Some(pg) = pg.filter(|p| p["node_error"].is_string()) {
            break pg;
        }
        assert!(Instant::now() < deadline, "no report from the node: {listed}\n{}", std::fs::read_to_string(&log).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(100));
    };
    let said = entry["node_error"].as_str().unwrap();
    assert!(said.contains("group trellisnosuchgroup does not exist on this host"), "{entry}");
    assert!(entry["serial"].is_null() && entry["held_serial"].is_null(), "nothing was issued or written: {entry}");
    assert!(!root.join("etc/trellis/certs/postgres/key.pem").exists());
    let status = c.ok(&["status"]);
    assert!(
        status.contains("db-1: certificate for postgres has not been issued, failing on the node: certificate for postgres: group trellisnosuchgroup does not exist"),
        "{status}"
    );
    let human = c.ok(&["certs"]);
    assert!(human.contains("failing on the node: certificate for postgres: group trellisnosuchgroup"), "{human}");
}

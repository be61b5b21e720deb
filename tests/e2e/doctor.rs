//! `trellis-agent doctor` on a host that lacks what it checks: nothing on PATH (no wireguard-go,
//! no nft, no traefik), a state directory open to others, a token whose controller does not
//! answer, an ingress node, and (as root, through setpriv) no CAP_NET_ADMIN. Each ✗ line must
//! say so, and the command must fail.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use trellis_core::token::EnrolmentToken;
use trellis_testing::cmd::run;
use trellis_testing::{can_run, is_root, Need, TempDir};

use crate::support::agent;

/// A token for a controller nobody serves (port 1 on loopback refuses at once).
fn token_file(dir: &std::path::Path) -> std::path::PathBuf {
    let token = EnrolmentToken {
        controllers: vec!["127.0.0.1:1".into()],
        ca_fingerprint: [7; 32],
        id: [1; 8],
        secret: [2; 24],
        node: "db-1".into(),
        expires: 4_000_000_000,
    };
    let path = dir.join("db-1.token");
    std::fs::write(&path, token.encode().expect("a token")).expect("writing the token");
    path
}

#[test]
fn doctor_says_what_a_bare_host_lacks() {
    let dir = TempDir::new("doctor");
    let state = dir.join("state");
    std::fs::create_dir(&state).expect("the state directory");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("etc/trellis")).expect("the root");
    std::fs::write(root.join("etc/trellis/ingress.toml"), "").expect("an ingress node's file");
    let token = token_file(&dir);

    // As root the capabilities are dropped from the bounding set, so the agent runs without
    // CAP_NET_ADMIN; as another user it has none to begin with.
    let mut cmd = if is_root() {
        if !can_run(Need::Program("setpriv")) {
            return;
        }
        // Found on the PATH of the test, before the agent's is emptied.
        let path = std::env::var_os("PATH").unwrap_or_default();
        let setpriv = std::env::split_paths(&path).map(|d| d.join("setpriv")).find(|p| p.is_file()).expect("setpriv on PATH");
        let mut c = Command::new(setpriv);
        c.args(["--bounding-set", "-net_admin,-net_bind_service", "--"]).arg(agent());
        c
    } else {
        Command::new(agent())
    };
    cmd.arg("doctor").arg("--state-dir").arg(&state).arg("--root").arg(&root).arg("--token-file").arg(&token);
    cmd.env("PATH", dir.join("no-bin"));
    let (out, d) = run(cmd);
    assert_eq!(out.status.code(), Some(1), "{d}");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let line = |name: &str| text.lines().find(|l| l.starts_with(&format!("✗ {name}"))).unwrap_or_else(|| panic!("no ✗ {name}\n{d}"));
    assert!(line("wireguard-go").contains("apt-get install wireguard-go"), "{d}");
    assert!(line("nft ").contains("not on PATH"), "{d}");
    assert!(line("capabilities").contains("CAP_NET_ADMIN"), "{d}");
    assert!(line("state directory").contains("chmod 700"), "{d}");
    assert!(line("controller 127.0.0.1:1").contains("cannot connect"), "{d}");
    assert!(line("clock").contains("no controller answered"), "{d}");
    assert!(line("Traefik").contains("no traefik is on PATH"), "{d}");
    assert!(text.lines().any(|l| l.starts_with("✓ --wireguard auto picks")), "the TUN device is there, so gotatun can run\n{d}");
    assert!(text.trim_end().lines().last().is_some_and(|l| l.starts_with("not ready: ")), "{d}");
}

#[test]
fn doctor_json_and_an_enrolled_node_without_its_controller() {
    let dir = TempDir::new("doctor-json");
    let state = dir.join("state");
    std::fs::create_dir(&state).expect("the state directory");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    std::fs::write(
        state.join("identity.toml"),
        "node = \"db-1\"\nmesh = \"basic\"\ncontrollers = [\"127.0.0.1:1\"]\nsigning_public_key = \"AAAA\"\nstate = \"active\"\n",
    )
    .expect("an identity");
    let mut cmd = Command::new(agent());
    cmd.arg("doctor").arg("--state-dir").arg(&state).arg("--root").arg(dir.path()).arg("--json");
    cmd.env("PATH", dir.join("no-bin"));
    let (out, d) = run(cmd);
    assert_eq!(out.status.code(), Some(1), "{d}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}\n{d}"));
    assert_eq!(v["ready"], false, "{d}");
    assert_eq!(v["controllers_from"], "identity", "{d}");
    assert_eq!(v["wireguard_auto"], "gotatun", "{d}");
    let check = |name: &str| {
        v["checks"].as_array().expect("checks").iter().find(|c| c["name"] == name).cloned().unwrap_or_else(|| panic!("no {name}\n{d}"))
    };
    // No ca.pem in the state directory: the controller cannot be checked, and says why.
    let c = check("controller 127.0.0.1:1");
    assert_eq!(c["ok"], false, "{d}");
    assert!(c["detail"].as_str().is_some_and(|s| s.contains("ca.pem")), "{d}");
    assert_eq!(check("state directory")["ok"], true, "{d}");
    assert_eq!(check("Traefik")["ok"], true, "not an ingress node\n{d}");
}

/// As root, in a mount namespace where /dev/net is empty and a network namespace of its own:
/// no TUN device, so neither wireguard-go nor the embedded backends can run, and `auto` has
/// nothing left.
#[test]
fn doctor_without_a_tun_device() {
    if !can_run(Need::Root) || !can_run(Need::Program("unshare")) {
        return;
    }
    let dir = TempDir::new("doctor-tun");
    let script = format!(
        "mount -t tmpfs tmpfs /dev/net && PATH={} exec {} doctor --state-dir {}",
        dir.join("no-bin").display(),
        agent(),
        dir.join("state").display()
    );
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--net", "--propagation", "private", "sh", "-c", &script]);
    let (out, d) = run(cmd);
    assert_eq!(out.status.code(), Some(1), "{d}");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.lines().any(|l| l.starts_with("✗ TUN device") && l.contains("/dev/net/tun")), "{d}");
    assert!(text.lines().any(|l| l.starts_with("✗ --wireguard auto picks") && l.contains("gotatun")), "{d}");
}

/// Before enrolment, against a real controller: the token's address answers, verified by its
/// fingerprint, and the clocks agree; the same token with another fingerprint is refused
/// before anything is sent (what `enrol` would refuse), and says so.
#[test]
fn doctor_checks_the_controller_a_token_names() {
    use crate::controller::{Controller, Db};
    let ctl = Controller::start(Db::Sqlite);
    ctl.ok(&["apply", "lab/basic"]);
    let token = ctl.token("db-1", &[]);
    let dir = TempDir::new("doctor-token");
    let good = dir.join("good.token");
    std::fs::write(&good, &token).expect("the token");
    let mut other = EnrolmentToken::decode(&token).expect("a token");
    other.ca_fingerprint[0] ^= 1;
    let bad = dir.join("bad.token");
    std::fs::write(&bad, other.encode().expect("a token")).expect("the token");
    let address = format!("controller 127.0.0.1:{}", ctl.port);

    let doctor = |file: &std::path::Path| {
        let mut cmd = Command::new(agent());
        cmd.arg("doctor")
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--root")
            .arg(dir.path())
            .arg("--token-file")
            .arg(file)
            .arg("--json");
        let (out, d) = run(cmd);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}\n{d}"));
        let find = |name: &str| {
            v["checks"].as_array().expect("checks").iter().find(|c| c["name"] == name).cloned().unwrap_or_else(|| panic!("no {name}\n{d}"))
        };
        (find(&address), find("clock"), d)
    };
    let (reach, clock, d) = doctor(&good);
    assert_eq!(reach["ok"], true, "{d}");
    assert!(reach["detail"].as_str().is_some_and(|s| s.contains("the token's CA fingerprint")), "{d}");
    assert_eq!(clock["ok"], true, "{d}");
    let (reach, clock, d) = doctor(&bad);
    assert_eq!(reach["ok"], false, "{d}");
    assert!(reach["detail"].as_str().is_some_and(|s| s.contains("does not match the token")), "{d}");
    assert_eq!(clock["ok"], false, "{d}");
}

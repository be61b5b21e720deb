//! The compiled ruleset loaded with `nft -f` into a network namespace, and traffic through it:
//! what the policy allows is open, everything else on the overlay interface is dropped.

use std::process::{Child, Stdio};

use trellis_testing::cmd::{ok, run, sh};
use trellis_testing::{can_run, Need, TempDir};

use crate::support::{trellis, Netns};

fn address(conf: &str, v6: bool) -> String {
    let line = conf.lines().find(|l| l.starts_with("Address = ")).expect("Address line");
    let addrs: Vec<&str> = line.trim_start_matches("Address = ").split(", ").collect();
    let a = addrs.iter().find(|a| a.contains(':') == v6).expect("address of the family");
    a.split('/').next().unwrap().to_string()
}

struct Listeners(Vec<Child>);

impl Drop for Listeners {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn reach(client: &Netns, src: &str, dst: &str, port: u16) -> bool {
    let six = if dst.contains(':') { "-6" } else { "-4" };
    let (out, _) = run(client.cmd(&["nc", six, "-z", "-n", "-w", "2", "-s", src, dst, &port.to_string()]));
    out.status.success()
}

#[test]
fn compiled_ruleset_loads_and_enforces_the_policy() {
    if !can_run(Need::Root) {
        return;
    }
    let out = TempDir::new("nft");
    ok({
        let mut c = trellis();
        c.args(["compile", "lab/basic", "--all", "--out", out.path().to_str().unwrap()]);
        c
    });
    let read = |n: &str, f: &str| std::fs::read_to_string(out.path().join(n).join("etc/trellis").join(f)).unwrap();
    let (db4, db6) = (address(&read("db-1", "wireguard.conf"), false), address(&read("db-1", "wireguard.conf"), true));
    let (op4, op6) = (address(&read("op-1", "wireguard.conf"), false), address(&read("op-1", "wireguard.conf"), true));
    let (api4, api6) = (address(&read("api-1", "wireguard.conf"), false), address(&read("api-1", "wireguard.conf"), true));

    let db = Netns::new("db");
    let cl = Netns::new("cl");
    // The overlay interface is a veth named like the WireGuard one, so the ruleset's
    // `iifname` matches exactly as it does on a node.
    ok(sh("ip", &["link", "add", "trellis0", "netns", &db.name, "type", "veth", "peer", "name", "trellis0", "netns", &cl.name]));
    db.ok(&["ip", "addr", "add", &format!("{db4}/16"), "dev", "trellis0"]);
    db.ok(&["ip", "addr", "add", &format!("{db6}/64"), "dev", "trellis0", "nodad"]);
    let outsider = "10.88.255.254";
    for a in [format!("{op4}/16"), format!("{api4}/16"), format!("{outsider}/16")] {
        cl.ok(&["ip", "addr", "add", &a, "dev", "trellis0"]);
    }
    for a in [format!("{op6}/64"), format!("{api6}/64")] {
        cl.ok(&["ip", "addr", "add", &a, "dev", "trellis0", "nodad"]);
    }
    db.ok(&["ip", "link", "set", "trellis0", "up"]);
    cl.ok(&["ip", "link", "set", "trellis0", "up"]);

    let ruleset = out.path().join("db-1/etc/trellis/nftables.conf");
    db.ok(&["nft", "-f", ruleset.to_str().unwrap()]);
    // Loading again replaces the table in one transaction instead of failing or duplicating.
    db.ok(&["nft", "-f", ruleset.to_str().unwrap()]);
    let listed = db.ok(&["nft", "list", "table", "inet", "trellis"]);
    assert_eq!(listed.matches("comment \"ssh rule 1: from group:admins\"").count(), 2, "{listed}");
    assert_eq!(listed.matches("chain input").count(), 1, "{listed}");

    let mut listeners = Listeners(Vec::new());
    for port in ["22", "5432", "8000"] {
        for fam in ["-4", "-6"] {
            let child = db
                .cmd(&["nc", fam, "-l", "-k", port])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("nc listener");
            listeners.0.push(child);
        }
    }
    // Wait until all six listeners are bound, rather than guessing how long that takes.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let listening = db.ok(&["ss", "-ltnH"]);
        let bound =
            ["22", "5432", "8000"].iter().map(|p| listening.lines().filter(|l| l.contains(&format!(":{p} "))).count()).sum::<usize>();
        if bound >= 6 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "listeners did not start: {listening}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    // Without the ruleset everything would be open; with it only what the policy says.
    let cases = [
        (&op4, &db4, 22, true, "op-1 is an admin: ssh"),
        (&op4, &db4, 5432, true, "admins may reach postgres"),
        (&api4, &db4, 5432, true, "module:api may reach postgres"),
        (&api4, &db4, 22, false, "api-1 is not an admin"),
        (&op4, &db4, 8000, false, "db-1 runs no module on 8000"),
        (&outsider.to_string(), &db4, 5432, false, "an address that is no node of the mesh"),
        (&api6, &db6, 5432, true, "IPv6: module:api may reach postgres"),
        (&api6, &db6, 22, false, "IPv6: api-1 is not an admin"),
        (&op6, &db6, 22, true, "IPv6: admins may ssh"),
    ];
    let mut wrong = Vec::new();
    for (src, dst, port, open, why) in cases {
        let seen = reach(&cl, src, dst, port);
        if seen != open {
            wrong.push(format!(
                "{src} -> {dst}:{port}: expected {}, saw {} ({why})",
                if open { "open" } else { "closed" },
                if seen { "open" } else { "closed" }
            ));
        }
    }
    assert!(wrong.is_empty(), "the ruleset does not enforce the policy:\n{}\n{listed}", wrong.join("\n"));

    // ICMP: the ping module admits the whole mesh, but not an outsider.
    let ping = |src: &str| run(cl.cmd(&["ping", "-c", "1", "-W", "2", "-I", src, &db4])).0.status.success();
    assert!(ping(&api4), "ping from a mesh node is admitted");
    assert!(!ping(outsider), "ping from outside the mesh is dropped");
    drop(listeners);
}

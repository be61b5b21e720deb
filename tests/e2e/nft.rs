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

/// The `packets N` of the first counter in `listing`.
fn packets(listing: &str) -> u64 {
    let at = listing.find("counter packets ").unwrap_or_else(|| panic!("no counter in\n{listing}"));
    listing[at + "counter packets ".len()..].split_whitespace().next().and_then(|n| n.parse().ok()).expect("a packet count")
}

/// An exit's ruleset in a namespace between the underlay (a host on the internet side) and the
/// overlay (a veth named like the WireGuard interface, the exit's user on its other end): the
/// user's connection to the internet goes out and its replies come back in, while a host on the
/// underlay that routes the overlay's prefix through the exit and sends with another node's
/// overlay address reaches nothing of the mesh, and the exit does not forward into the ranges
/// the IANA registries mark as not globally reachable.
#[test]
fn an_exit_admits_replies_into_the_overlay_and_nothing_spoofed_from_the_underlay() {
    if !can_run(Need::Root) {
        return;
    }
    let out = TempDir::new("nft-exit");
    ok({
        let mut c = trellis();
        c.args(["compile", "lab/exit", "--all", "--out", out.path().to_str().unwrap()]);
        c
    });
    let read = |n: &str, f: &str| std::fs::read_to_string(out.path().join(n).join("etc/trellis").join(f)).unwrap();
    let [exit1, laptop1, laptop2] = ["exit-1", "laptop-1", "laptop-2"].map(|n| address(&read(n, "wireguard.conf"), false));
    let (web, bench, exit_underlay) = ("198.51.100.80", "198.18.0.5", "198.51.100.10");

    let internet = Netns::new("inet");
    let exit = Netns::new("exit");
    let user = Netns::new("user");
    ok(sh("ip", &["link", "add", "trellis0", "netns", &exit.name, "type", "veth", "peer", "name", "trellis0", "netns", &user.name]));
    ok(sh("ip", &["link", "add", "eth0", "netns", &exit.name, "type", "veth", "peer", "name", "eth0", "netns", &internet.name]));
    // The worst case: no reverse-path filter stops a source address that belongs elsewhere, so
    // only the ruleset stands between the underlay and the overlay.
    for key in ["all", "default", "eth0", "trellis0"] {
        exit.ok(&["sysctl", "-qw", &format!("net.ipv4.conf.{key}.rp_filter=0")]);
    }
    exit.ok(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    exit.ok(&["ip", "addr", "add", &format!("{exit1}/16"), "dev", "trellis0"]);
    exit.ok(&["ip", "addr", "add", &format!("{exit_underlay}/24"), "dev", "eth0"]);
    user.ok(&["ip", "addr", "add", &format!("{laptop1}/16"), "dev", "trellis0"]);
    for a in [format!("{web}/24"), format!("{bench}/32"), format!("{laptop2}/32")] {
        internet.ok(&["ip", "addr", "add", &a, "dev", "eth0"]);
    }
    for ns in [&exit, &user, &internet] {
        for dev in ["trellis0", "eth0"] {
            let _ = run(ns.cmd(&["ip", "link", "set", dev, "up"]));
        }
    }
    user.ok(&["ip", "route", "add", "default", "via", &exit1, "dev", "trellis0"]);
    exit.ok(&["ip", "route", "add", "198.18.0.0/15", "via", web]);
    // The attacker's route: the overlay's prefix through the exit's underlay address.
    internet.ok(&["ip", "route", "add", "10.88.0.0/16", "via", exit_underlay]);
    let ruleset = out.path().join("exit-1/etc/trellis/nftables.conf");
    exit.ok(&["nft", "-f", ruleset.to_str().unwrap()]);
    // Counts what reaches the overlay side with laptop-2's address as its source, before any
    // filter of the receiving node could look at it.
    user.ok(&["nft", "add", "table", "inet", "probe"]);
    user.ok(&["nft", "add", "chain", "inet", "probe", "pre", "{ type filter hook prerouting priority -300; }"]);
    user.ok(&["nft", "add", "rule", "inet", "probe", "pre", "ip", "saddr", &laptop2, "counter"]);

    let mut listeners = Listeners(Vec::new());
    for ns in [&internet, &user] {
        let child = ns
            .cmd(&["nc", "-4", "-l", "-k", "80"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nc listener");
        listeners.0.push(child);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while ![&internet, &user].iter().all(|ns| ns.ok(&["ss", "-ltnH"]).contains(":80 ")) {
        assert!(std::time::Instant::now() < deadline, "listeners did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let listed = exit.ok(&["nft", "list", "table", "inet", "trellis"]);

    // The exit's user: out to the internet, and the replies back in (TCP and ICMP).
    assert!(reach(&user, &laptop1, web, 80), "laptop-1's connection to the web server through the exit\n{listed}");
    let ping = |ns: &Netns, src: &str, dst: &str| run(ns.cmd(&["ping", "-c", "1", "-W", "2", "-I", src, dst])).0.status.success();
    assert!(ping(&user, &laptop1, web), "laptop-1's ping to the web server through the exit\n{listed}");
    // Not into a range no exit forwards to (benchmarking, 198.18.0.0/15), though it is routed.
    assert!(!reach(&user, &laptop1, bench, 80), "the exit forwarded laptop-1 to {bench}\n{listed}");

    // The attack: laptop-2's overlay address, from the underlay, towards laptop-1.
    let _ = reach(&internet, &laptop2, &laptop1, 80);
    let _ = ping(&internet, &laptop2, &laptop1);
    let arrived = packets(&user.ok(&["nft", "list", "chain", "inet", "probe", "pre"]));
    assert_eq!(arrived, 0, "packets from the underlay with laptop-2's overlay address reached laptop-1 through the exit\n{listed}");
    drop(listeners);
}

/// Whether a datagram sent from `src` in `client` to `dst:port` reached the listener `server`
/// runs there (bound to every address), read from what it printed.
fn datagram(client: &Netns, server: &Netns, src: &str, dst: &str, port: u16, dir: &TempDir) -> bool {
    let mark = dir.path().join(format!("udp-{port}.out"));
    let f = std::fs::File::create(&mark).expect("listener's output");
    let l = Listeners(vec![server.cmd(&["nc", "-4", "-u", "-l", &port.to_string()]).stdin(Stdio::null()).stdout(f).spawn().expect("nc")]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !server.ok(&["ss", "-lunH"]).contains(&format!(":{port} ")) {
        assert!(std::time::Instant::now() < deadline, "the udp listener on {port} did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let mut c =
        client.cmd(&["nc", "-4", "-u", "-n", "-w", "1", "-s", src, dst, &port.to_string()]).stdin(Stdio::piped()).spawn().expect("nc");
    {
        use std::io::Write;
        let _ = c.stdin.take().expect("stdin").write_all(b"trellis-probe\n");
    }
    let _ = c.wait();
    std::thread::sleep(std::time::Duration::from_millis(300));
    drop(l);
    std::fs::read_to_string(&mark).unwrap_or_default().contains("trellis-probe")
}

/// A host beside a node on its LAN (the review of 2026-12-02, finding 1): Linux delivers a
/// packet to any local address whatever interface it came in on, so a neighbour that routes the
/// overlay's prefixes to the node's LAN address would reach every service bound to its overlay
/// address, past every rule; and one that takes another node's overlay address as its own would
/// be taken for that node. Both are dropped; the rest of the underlay is left be.
#[test]
fn the_underlay_reaches_nothing_of_the_overlay() {
    if !can_run(Need::Root) {
        return;
    }
    let out = TempDir::new("nft-underlay");
    ok({
        let mut c = trellis();
        c.args(["compile", "lab/basic", "--all", "--out", out.path().to_str().unwrap()]);
        c
    });
    let read = |n: &str| std::fs::read_to_string(out.path().join(n).join("etc/trellis/wireguard.conf")).unwrap();
    let (db4, db6) = (address(&read("db-1"), false), address(&read("db-1"), true));
    let api4 = address(&read("api-1"), false);
    let (db_lan4, db_lan6, nb_lan4, nb_lan6) = ("192.0.2.12", "2001:db8::12", "192.0.2.99", "2001:db8::99");

    let db = Netns::new("udb");
    let nb = Netns::new("unb");
    let peer = Netns::new("upeer");
    ok(sh("ip", &["link", "add", "trellis0", "netns", &db.name, "type", "veth", "peer", "name", "trellis0", "netns", &peer.name]));
    ok(sh("ip", &["link", "add", "eth0", "netns", &db.name, "type", "veth", "peer", "name", "eth0", "netns", &nb.name]));
    // The worst case: no reverse-path filter stops a source that belongs elsewhere.
    for key in ["all", "default", "eth0", "trellis0"] {
        db.ok(&["sysctl", "-qw", &format!("net.ipv4.conf.{key}.rp_filter=0")]);
    }
    db.ok(&["ip", "addr", "add", &format!("{db4}/16"), "dev", "trellis0"]);
    db.ok(&["ip", "addr", "add", &format!("{db6}/64"), "dev", "trellis0", "nodad"]);
    db.ok(&["ip", "addr", "add", &format!("{db_lan4}/24"), "dev", "eth0"]);
    db.ok(&["ip", "addr", "add", &format!("{db_lan6}/64"), "dev", "eth0", "nodad"]);
    nb.ok(&["ip", "addr", "add", &format!("{nb_lan4}/24"), "dev", "eth0"]);
    nb.ok(&["ip", "addr", "add", &format!("{nb_lan6}/64"), "dev", "eth0", "nodad"]);
    // The neighbour takes api-1's overlay address too (api-1 is admitted to postgres).
    nb.ok(&["ip", "addr", "add", &format!("{api4}/32"), "dev", "eth0"]);
    for (ns, dev) in [(&db, "trellis0"), (&db, "eth0"), (&nb, "eth0"), (&peer, "trellis0")] {
        ns.ok(&["ip", "link", "set", dev, "up"]);
    }
    // The attacker's routes: the overlay's prefixes through db-1's LAN addresses.
    nb.ok(&["ip", "route", "add", "10.88.0.0/16", "via", db_lan4]);
    nb.ok(&["ip", "-6", "route", "add", "fd88:0:0:1::/64", "via", db_lan6]);
    let ruleset = out.path().join("db-1/etc/trellis/nftables.conf");
    db.ok(&["nft", "-f", ruleset.to_str().unwrap()]);
    let listed = db.ok(&["nft", "list", "table", "inet", "trellis"]);

    let mut listeners = Listeners(Vec::new());
    for fam in ["-4", "-6"] {
        let child = db.cmd(&["nc", fam, "-l", "-k", "5432"]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn();
        listeners.0.push(child.expect("nc listener"));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while db.ok(&["ss", "-ltnH"]).lines().filter(|l| l.contains(":5432 ")).count() < 2 {
        assert!(std::time::Instant::now() < deadline, "listeners did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // The neighbour reaches db-1 on the underlay: the trellis table filters the overlay only,
    // and these rows show the attack's packets do arrive.
    assert!(reach(&nb, nb_lan4, db_lan4, 5432), "the neighbour reaches db-1's LAN address\n{listed}");
    assert!(reach(&nb, nb_lan6, db_lan6, 5432), "the neighbour reaches db-1's LAN address over IPv6\n{listed}");
    assert!(datagram(&nb, &db, nb_lan4, db_lan4, 9998, &out), "a datagram from the neighbour's own address arrives\n{listed}");
    // The attacks.
    assert!(!reach(&nb, nb_lan4, &db4, 5432), "the neighbour reached postgres at db-1's overlay address from the LAN\n{listed}");
    assert!(!reach(&nb, nb_lan6, &db6, 5432), "the neighbour reached postgres at db-1's IPv6 overlay address from the LAN\n{listed}");
    assert!(
        !datagram(&nb, &db, &api4, db_lan4, 9999, &out),
        "a datagram from the LAN claiming api-1's overlay address ({api4}) was delivered\n{listed}"
    );
    drop(listeners);
}

/// A hub relays between peers of one interface, and the kernel tells the sender of each relayed
/// packet to send straight to its peer (an ICMP redirect), which the overlay has no such path for
/// (found from outside, issue 33). The hub's ruleset sends none: a-1's ping to b-1 through hub-1
/// draws no redirect, where the same hub without the ruleset draws one per packet.
#[test]
fn a_hub_relays_without_sending_redirects() {
    if !can_run(Need::Root) {
        return;
    }
    let out = TempDir::new("nft-redirects");
    ok({
        let mut c = trellis();
        c.args(["compile", "lab/cgnat", "--all", "--out", out.path().to_str().unwrap()]);
        c
    });
    let read = |n: &str| std::fs::read_to_string(out.path().join(n).join("etc/trellis/wireguard.conf")).unwrap();
    let (hub4, a4, b4) = (address(&read("hub-1"), false), address(&read("a-1"), false), address(&read("b-1"), false));
    let hub = Netns::new("rhub");
    let a = Netns::new("ra");
    ok(sh("ip", &["link", "add", "trellis0", "netns", &hub.name, "type", "veth", "peer", "name", "trellis0", "netns", &a.name]));
    hub.ok(&["ip", "addr", "add", &format!("{hub4}/16"), "dev", "trellis0"]);
    a.ok(&["ip", "addr", "add", &format!("{a4}/32"), "dev", "trellis0"]);
    hub.ok(&["ip", "link", "set", "trellis0", "up"]);
    a.ok(&["ip", "link", "set", "trellis0", "up"]);
    hub.ok(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    // a-1 sends b-1's traffic to the hub, as its AllowedIPs under hub-1 do.
    a.ok(&["ip", "route", "add", &format!("{hub4}/32"), "dev", "trellis0"]);
    a.ok(&["ip", "route", "add", &format!("{b4}/32"), "via", &hub4]);
    a.ok(&["nft", "add", "table", "inet", "probe"]);
    a.ok(&["nft", "add", "chain", "inet", "probe", "pre", "{ type filter hook prerouting priority -300; }"]);
    a.ok(&["nft", "add", "rule", "inet", "probe", "pre", "icmp", "type", "redirect", "counter"]);
    let redirects = || {
        let _ = run(a.cmd(&["ping", "-c", "2", "-i", "0.2", "-W", "1", &b4]));
        packets(&a.ok(&["nft", "list", "chain", "inet", "probe", "pre"]))
    };
    // The test can see one: without the ruleset the hub redirects.
    assert!(redirects() >= 1, "the hub without its ruleset sent no redirect: the test cannot tell");
    let before = packets(&a.ok(&["nft", "list", "chain", "inet", "probe", "pre"]));
    let ruleset = out.path().join("hub-1/etc/trellis/nftables.conf");
    hub.ok(&["nft", "-f", ruleset.to_str().unwrap()]);
    let listed = hub.ok(&["nft", "list", "table", "inet", "trellis"]);
    assert_eq!(redirects(), before, "the hub sent redirects into the overlay\n{listed}");
}

/// A sender and a receiver of datagrams in Python, each run in a namespace: `listen PORT SECS`
/// prints `SOURCE:PORT TEXT` per datagram and answers each; `send SRC SPORT DST DPORT TEXT`.
const UDP: &str = r#"
import socket, sys
if sys.argv[1] == "listen":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", int(sys.argv[2]))); s.settimeout(float(sys.argv[3]))
    try:
        while True:
            d, a = s.recvfrom(2000); s.sendto(b"ack", a); print(f"{a[0]}:{a[1]} {d.decode()}", flush=True)
    except socket.timeout:
        pass
else:
    src, sport, dst, dport, msg = sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((src, sport)); s.sendto(msg.encode(), (dst, dport))
"#;

/// An attacker's review of the fix for finding 1: a host on a hub's LAN that takes a-1's overlay
/// address sent into a flow between a-1 and b-1 through the hub (its datagram matched the flow's
/// conntrack entry, and the forward chain accepted established traffic before anything looked at
/// where it came from). The hub's ruleset drops what enters the overlay from outside it with an
/// overlay source, before any flow is accepted.
#[test]
fn a_host_on_a_hubs_lan_cannot_join_a_flow_it_relays() {
    if !can_run(Need::Root) || !can_run(Need::Program("python3")) {
        return;
    }
    let out = TempDir::new("nft-inject");
    ok({
        let mut c = trellis();
        c.args(["compile", "lab/cgnat", "--all", "--out", out.path().to_str().unwrap()]);
        c
    });
    let read = |n: &str| std::fs::read_to_string(out.path().join(n).join("etc/trellis/wireguard.conf")).unwrap();
    let (hub4, a4, b4) = (address(&read("hub-1"), false), address(&read("a-1"), false), address(&read("b-1"), false));
    let mesh = std::fs::read_to_string(trellis_testing::repo().join("lab/cgnat/mesh.toml")).unwrap();
    let overlay =
        mesh.lines().find_map(|l| l.strip_prefix("overlay_ipv4 = ")).expect("lab/cgnat's overlay_ipv4").trim_matches('"').to_string();
    let (hub, a, b, lan) = (Netns::new("ihub"), Netns::new("ia"), Netns::new("ib"), Netns::new("ilan"));
    // The hub's overlay is a bridge named like the WireGuard interface, a-1 and b-1 on its ports.
    hub.ok(&["ip", "link", "add", "trellis0", "type", "bridge"]);
    for (peer, port) in [(&a, "pa"), (&b, "pb")] {
        ok(sh("ip", &["link", "add", port, "netns", &hub.name, "type", "veth", "peer", "name", "trellis0", "netns", &peer.name]));
        hub.ok(&["ip", "link", "set", port, "master", "trellis0"]);
        hub.ok(&["ip", "link", "set", port, "up"]);
        peer.ok(&["ip", "link", "set", "trellis0", "up"]);
    }
    ok(sh("ip", &["link", "add", "eth0", "netns", &hub.name, "type", "veth", "peer", "name", "eth0", "netns", &lan.name]));
    for dev in ["trellis0", "eth0"] {
        hub.ok(&["ip", "link", "set", dev, "up"]);
    }
    lan.ok(&["ip", "link", "set", "eth0", "up"]);
    hub.ok(&["ip", "addr", "add", &format!("{hub4}/16"), "dev", "trellis0"]);
    hub.ok(&["ip", "addr", "add", "192.0.2.1/24", "dev", "eth0"]);
    hub.ok(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    // Loose reverse-path filtering, systemd's default: a source that is routed anywhere passes.
    for key in ["all", "default", "eth0", "trellis0"] {
        hub.ok(&["sysctl", "-qw", &format!("net.ipv4.conf.{key}.rp_filter=2")]);
    }
    for (peer, addr) in [(&a, &a4), (&b, &b4)] {
        peer.ok(&["ip", "addr", "add", &format!("{addr}/32"), "dev", "trellis0"]);
        peer.ok(&["ip", "route", "add", &overlay, "via", &hub4, "dev", "trellis0", "onlink"]);
    }
    lan.ok(&["ip", "addr", "add", "192.0.2.99/24", "dev", "eth0"]);
    lan.ok(&["ip", "addr", "add", &format!("{a4}/32"), "dev", "eth0"]);
    lan.ok(&["ip", "route", "add", &format!("{b4}/32"), "via", "192.0.2.1", "src", &a4]);
    let ruleset = out.path().join("hub-1/etc/trellis/nftables.conf");
    hub.ok(&["nft", "-f", ruleset.to_str().unwrap()]);
    let listed = hub.ok(&["nft", "list", "table", "inet", "trellis"]);

    let listener =
        b.cmd(&["python3", "-c", UDP, "listen", "6000", "4"]).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("python3");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let send = |ns: &Netns, sport: &str, text: &str| {
        ns.ok(&["python3", "-c", UDP, "send", &a4, sport, &b4, "6000", text]);
        std::thread::sleep(std::time::Duration::from_millis(300));
    };
    // a-1 opens the flow, b-1 answers it: the hub relays both ways.
    send(&a, "5000", "from-a-1");
    send(&lan, "5000", "injected-into-the-flow");
    send(&lan, "5001", "a-new-flow");
    let heard = String::from_utf8(listener.wait_with_output().unwrap().stdout).unwrap();
    assert!(heard.contains("from-a-1"), "a-1's datagram did not reach b-1 through the hub: the test cannot tell\n{heard}\n{listed}");
    assert!(!heard.contains("injected-into-the-flow"), "a host on the hub's LAN joined a-1's flow to b-1\n{heard}\n{listed}");
    assert!(!heard.contains("a-new-flow"), "a host on the hub's LAN reached b-1 as a-1\n{heard}\n{listed}");
}

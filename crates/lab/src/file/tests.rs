//! The lab file's tests: each refusal one sentence naming the file and the host, step or
//! expectation at fault, and what the steps do to the expectations in force.

/// A TLS expectation names where it goes and the name it verifies; `name` and `refused` belong
/// to TLS alone.
#[test]
fn a_tls_expectation_names_its_target_port_and_name() {
    let dir = trellis_testing::TempDir::new("labfile-tls");
    let head = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/basic.toml")).unwrap();
    let file = dir.join("lab.toml");
    let tls = "[[expect]]\nfrom = \"api-1\"\nproto = \"tls\"\n";
    for (tail, wrong) in [
        (format!("{tls}to = \"db-1\"\nport = 5432\nname = \"postgres.basic.mesh\"\nresult = \"refused\"\n"), None),
        (format!("{tls}to = \"db-1\"\nport = 5432\n"), Some("is a TLS handshake: give `to`, `port` and the `name` it verifies")),
        (format!("{tls}to = \"db-1\"\nname = \"postgres.basic.mesh\"\n"), Some("is a TLS handshake")),
        (format!("{tls}to = \"db-1\"\nport = 5432\nname = \"p\"\nvia = \"db-1\"\n"), Some("and no `dns` or `via`")),
        (
            "[[expect]]\nfrom = \"api-1\"\nto = \"db-1\"\nport = 5432\nname = \"p\"\n".to_string(),
            Some("gives `name`, which only a `proto = \"tls\"`"),
        ),
        (
            "[[expect]]\nfrom = \"api-1\"\nto = \"db-1\"\nport = 5432\nresult = \"refused\"\n".to_string(),
            Some("expects `refused`, which only"),
        ),
    ] {
        std::fs::write(&file, format!("{head}\n{tail}")).unwrap();
        let r = super::load(&file);
        match (wrong, r) {
            (None, r) => assert!(r.is_ok(), "{tail}: {:?}", r.err()),
            (Some(w), Ok(_)) => panic!("{tail}: loaded; wanted {w:?}"),
            (Some(w), Err(e)) => assert!(e.to_string().contains(w), "{tail}: {e}"),
        }
    }
}

/// A route through a host that shares no net with the router is refused where it is named.
#[test]
fn a_hosts_route_goes_via_a_host_it_shares_a_net_with() {
    let head = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/basic.toml")).unwrap();
    for (from, to, said) in [
        (
            "routes = { \"10.88.0.0/16\" = \"db-1\" }",
            "routes = { \"10.88.0.0/16\" = \"db-9\" }",
            "route 10.88.0.0/16 goes via `db-9`, which is no lab host",
        ),
        ("routes = { \"10.88.0.0/16\" = \"db-1\" }", "routes = { \"10.88.0.0\" = \"db-1\" }", "route \"10.88.0.0\" is not a prefix"),
        (
            "routes = { \"10.88.0.0/16\" = \"db-1\" }",
            "routes = { \"fd88::/64\" = \"db-1\" }",
            "has no address of its family on a net this host is on",
        ),
    ] {
        assert!(head.contains(from), "lab/basic.toml has {from}");
        let e = load_text("routes", &head.replace(from, to)).unwrap_err();
        assert!(e.contains("host `neighbour`: ") && e.contains(said), "{e}");
    }
}

/// A DNS expectation that names no answer would be met by an empty reply: refused at load.
#[test]
fn a_dns_expectation_names_its_answer_or_nxdomain() {
    let dir = trellis_testing::TempDir::new("labfile");
    let head = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/basic.toml")).unwrap();
    let file = dir.join("lab.toml");
    for (tail, ok) in [
        ("[[expect]]\nfrom = \"op-1\"\ndns = \"db-1.basic.mesh\"\n", false),
        ("[[expect]]\nfrom = \"op-1\"\ndns = \"db-1.basic.mesh\"\nanswer = []\n", false),
        ("[[expect]]\nfrom = \"op-1\"\ndns = \"x.basic.mesh\"\nanswer = [\"db-1\"]\nresult = \"nxdomain\"\n", false),
        ("[[expect]]\nfrom = \"op-1\"\ndns = \"x.basic.mesh\"\nresult = \"nxdomain\"\n", true),
        // No answer at all: a resolver the from-host may not reach.
        ("[[expect]]\nfrom = \"op-1\"\nto = \"db-1\"\ndns = \"x.basic.mesh\"\nresult = \"closed\"\n", true),
        ("[[expect]]\nfrom = \"op-1\"\ndns = \"x.basic.mesh\"\nanswer = [\"db-1\"]\nresult = \"closed\"\n", false),
    ] {
        std::fs::write(&file, format!("{head}\n{tail}")).unwrap();
        let r = super::load(&file);
        assert_eq!(r.is_ok(), ok, "{tail}: {:?}", r.err());
        if let Err(e) = r {
            assert!(e.to_string().contains("give `answer = [NODE, ...]`, `result = \"nxdomain\"` or `result = \"closed\"`"), "{e}");
        }
    }
}

/// Loads `text` as a lab file next to the shipped ones; the error's text, if any.
fn load_text(tag: &str, text: &str) -> Result<super::LabFile, String> {
    let dir = trellis_testing::TempDir::new(&format!("labfile-{tag}"));
    let file = dir.join("lab.toml");
    std::fs::write(&file, text).unwrap();
    super::load(&file).map(|(lab, _)| lab).map_err(|e| e.to_string().replace(&file.display().to_string(), "FILE"))
}

const HA: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/ha.toml"));

/// Replicas need the lab's PostgreSQL; a step kills a running controller (never the last)
/// or applies a declaration and says what that changes. Each refusal is one sentence naming
/// the file and the host or step at fault.
#[test]
fn controllers_postgres_and_steps_are_checked() {
    let no_pg = HA.replace("role = \"postgres\"", "role = \"node\"");
    let two_pg = HA.replace("name = \"op-1\"\naddresses", "name = \"op-1\"\nrole = \"postgres\"\naddresses");
    let one_ctl =
        no_pg.replace("name = \"ctl-2\"\nrole = \"controller\"", "name = \"ctl-2\"").split("# A crash").next().unwrap().to_string();
    let kill_node = HA.replace("kill = \"ctl-1\"", "kill = \"web-1\"");
    let kill_twice = HA.replace("[[step]]\nkill = \"ctl-1\"", "[[step]]\nkill = \"ctl-1\"\n\n[[step]]\nkill = \"ctl-1\"");
    let kill_both = HA.replace("[[step]]\nkill = \"ctl-1\"", "[[step]]\nkill = \"ctl-1\"\n\n[[step]]\nkill = \"ctl-2\"");
    let both = HA.replace("kill = \"ctl-1\"", "kill = \"ctl-1\"\napply = \"ha/metrics\"");
    let neither = HA.replace("kill = \"ctl-1\"", "");
    let silent_apply = HA.split("  [[step.expect]]").next().unwrap().to_string();
    let same = HA.replace("  port = 9100\n  result = \"open\"", "  port = 9100\n  result = \"closed\"");
    let unknown_role = HA.replace("role = \"postgres\"", "role = \"database\"");
    for (tag, text, want) in [
        ("ha", HA.to_string(), ""),
        ("one-controller-sqlite", one_ctl, ""),
        (
            "no-pg",
            no_pg,
            "FILE: hosts `ctl-1`, `ctl-2` have role = \"controller\" but no host has role = \"postgres\"; replicas share one PostgreSQL, so add a host with role = \"postgres\" or keep one controller",
        ),
        ("two-pg", two_pg, "FILE: hosts `pg`, `op-1` have role = \"postgres\"; the lab runs one PostgreSQL"),
        ("kill-node", kill_node, "FILE: step 1 kills `web-1`, which is not a host with role = \"controller\""),
        ("kill-twice", kill_twice, "FILE: step 2 kills `ctl-1`, which an earlier step killed"),
        ("kill-both", kill_both, "FILE: step 2 kills `ctl-2`, the last controller running; a lab keeps one"),
        ("both", both, "FILE: step 1 needs exactly one of `kill = HOST`, `apply = DIR`, `stop = HOST`, `revoke = NODE`, `pause = HOST`, `resume = HOST`, `renew = NODE`, `rotate = \"signing-key\"` or `\"ca\"`, `rebind = NET` and `quiet = SECONDS`"),
        ("neither", neither, "FILE: step 1 needs exactly one of `kill = HOST`, `apply = DIR`, `stop = HOST`, `revoke = NODE`, `pause = HOST`, `resume = HOST`, `renew = NODE`, `rotate = \"signing-key\"` or `\"ca\"`, `rebind = NET` and `quiet = SECONDS`"),
        ("silent", silent_apply, "FILE: step 2 applies \"ha/metrics\" but names no expectation; give the ones it changes"),
        ("same", same, "FILE: step 2 expectation 1 is already in force; a step lists what it changes"),
        ("role", unknown_role, "unknown variant `database`, expected one of `node`, `controller`, `postgres`"),
    ] {
        match load_text(tag, &text) {
            Ok(_) => assert!(want.is_empty(), "{tag}: loaded, but should fail with {want:?}"),
            Err(e) => assert!(!want.is_empty() && e.contains(want), "{tag}: {e}"),
        }
    }
}

/// A throughput expectation names its target and a port the filter admits, and expects
/// nothing but data moving.
#[test]
fn a_throughput_expectation_names_to_and_port_only() {
    let lab = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/throughput.toml"));
    assert_eq!(load_text("tp", lab).unwrap().expect.iter().filter(|e| e.proto == Some(super::Proto::Throughput)).count(), 3);
    let want = "FILE: expectation 1 measures throughput: give `to` and `port` (a TCP port the target's filter admits from `from`), and no `result` or `dns`";
    for (tag, text) in [
        ("tp-port", lab.replacen("port = 5432\n", "", 1)),
        ("tp-to", lab.replacen("to = \"db-1\"\n", "", 1)),
        ("tp-result", lab.replacen("port = 5432\n", "port = 5432\nresult = \"open\"\n", 1)),
    ] {
        assert_eq!(load_text(tag, &text).unwrap_err(), want, "{tag}");
    }
}

/// A typo in `proto` or `result` is refused at load, at its line and column, before any
/// namespace is made.
#[test]
fn a_typo_in_proto_or_result_is_refused_at_load_with_its_place() {
    let lab =
        |expect: &str| format!("[lab]\nname = \"typo\"\ndeclaration = \"basic\"\n\n[[expect]]\nfrom = \"op-1\"\nto = \"db-1\"\n{expect}");
    assert_eq!(
        load_text("proto-typo", &lab("proto = \"icmpp\"\n")).unwrap_err(),
        "FILE:8:9: unknown variant `icmpp`, expected one of `tcp`, `udp`, `icmp`, `throughput`, `tls`, `https`, `path`"
    );
    assert_eq!(
        load_text("result-typo", &lab("port = 5432\nresult = \"close\"\n")).unwrap_err(),
        "FILE:9:10: unknown variant `close`, expected one of `open`, `closed`, `nxdomain`, `refused`, `direct`, `relayed`"
    );
}

/// An HTTPS expectation names where it goes and the host it asks for; `host` and
/// `answered_by` belong to it alone, and `answered_by` means open.
#[test]
fn an_https_expectation_names_its_target_and_host() {
    let lab = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/expose.toml"));
    let loaded = load_text("https", lab).unwrap();
    let https: Vec<_> = loaded.expect.iter().filter(|e| e.proto == Some(super::Proto::Https)).collect();
    assert_eq!(https.len(), 2);
    assert_eq!((https[0].port(), https[1].port()), (Some(443), Some(8080)));
    let head = "[lab]\nname = \"h\"\ndeclaration = \"expose-off\"\n[[net]]\nname = \"n\"\nipv4 = \"192.0.2.0/24\"\n[[host]]\nname = \"c\"\nrole = \"controller\"\naddresses = { n = \"192.0.2.1\" }\n[[expect]]\nfrom = \"c\"\n";
    for (tag, tail, want) in [
        ("https-host", "to = \"c\"\nproto = \"https\"\n", "is an HTTPS request: give `to`"),
        ("https-name", "to = \"c\"\nproto = \"https\"\nhost = \"a.example\"\nname = \"x\"\n", "and no `dns`, `via` or `name`"),
        ("tcp-host", "to = \"c\"\nport = 1\nhost = \"a.example\"\n", "which only a `proto = \"https\"` expectation uses"),
        (
            "https-by",
            "to = \"c\"\nproto = \"https\"\nhost = \"a.example\"\nanswered_by = [\"c\"]\nresult = \"refused\"\n",
            "needs the runners that may answer, and `result = \"open\"`",
        ),
    ] {
        let err = load_text(tag, &format!("{head}{tail}")).unwrap_err();
        assert!(err.contains(want), "{tag}: {err}");
    }
    assert!(load_text("https-ok", &format!("{head}to = \"c\"\nproto = \"https\"\nhost = \"a.example\"\nresult = \"refused\"\n")).is_ok());
}

/// A step's expectations replace those with the same check and keep the others.
#[test]
fn steps_replace_the_expectations_they_name() {
    let lab = load_text("steps", HA).unwrap();
    assert_eq!(lab.expectations(0), lab.expect);
    assert_eq!(lab.expectations(1), lab.expect, "a kill changes no expectation");
    let after = lab.expectations(2);
    assert_eq!(after.len(), lab.expect.len());
    let port = after.iter().find(|e| e.from == "op-1" && e.port == Some(9100)).unwrap();
    assert_eq!(port.result, Some(super::Outcome::Open));
    let dns = after.iter().find(|e| e.dns.as_deref() == Some("metrics.ha.mesh")).unwrap();
    assert_eq!(dns.answer.as_deref().unwrap(), ["web-1", "api-1", "db-1"]);
    let closed = after.iter().find(|e| e.from == "api-1" && e.port == Some(9100)).unwrap();
    assert_eq!(closed.result, Some(super::Outcome::Closed), "an expectation no step names stays");
    let dir = std::path::Path::new("lab");
    assert_eq!(lab.action(0, dir), super::Action::Kill("ctl-1".into()));
    assert_eq!(lab.action(1, dir), super::Action::Apply(dir.join("ha/metrics")));
}

const POOL: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/pool.toml"));

/// A pool's host table becomes its `count` hosts, named as the controller names members, at
/// consecutive addresses; a stop takes the expectations naming its host out of force.
#[test]
fn pool_hosts_are_expanded_and_a_stop_ends_their_expectations() {
    let lab = load_text("pool", POOL).unwrap();
    let members: Vec<(&str, &str)> =
        lab.host.iter().filter(|h| h.pool.is_some()).map(|h| (h.name.as_str(), h.addresses["lan"].as_str())).collect();
    assert_eq!(members, [("ci-1", "192.0.2.21"), ("ci-2", "192.0.2.22")]);
    assert_eq!(lab.pools()["ci"].len(), 2);
    assert_eq!(lab.action(0, std::path::Path::new("lab")), super::Action::Stop("ci-2".into()));
    let after = lab.expectations(1);
    assert_eq!(after.len(), lab.expect.len() - 2, "the two naming ci-2 go");
    assert!(after.iter().all(|e| !e.names("ci-2")) && after.iter().any(|e| e.names("ci-1")));
}

#[test]
fn pool_hosts_and_stops_are_checked() {
    let named = POOL.replace("pool = \"ci\"\ncount = 2", "name = \"r\"\npool = \"ci\"\ncount = 2");
    let zero = POOL.replace("count = 2", "count = 0");
    let outside = POOL.replace("count = 2", "count = 240");
    let many = POOL.replace("count = 2", "count = 4000000000");
    let stop_node = POOL.replace("stop = \"ci-2\"", "stop = \"web-1\"");
    let stop_twice = format!("{POOL}\n[[step]]\nstop = \"ci-2\"\n");
    let stop_expect = format!("{POOL}  [[step.expect]]\n  from = \"ci-1\"\n  to = \"web-1\"\n  proto = \"icmp\"\n");
    for (tag, text, want) in [
        ("named", named, "a [[host]] of a pool has `pool` and `count` (1 to 250), no `name`"),
        ("zero", zero, "a [[host]] of a pool has `pool` and `count` (1 to 250)"),
        ("many", many, "a [[host]] of a pool has `pool` and `count` (1 to 250)"),
        ("outside", outside, "host `ci-236` address 192.0.3.0 is not inside net `lan`"),
        ("stop-node", stop_node, "step 1 stops `web-1`, which is not a host of a pool"),
        ("stop-twice", stop_twice, "step 2 stops `ci-2`, which an earlier step stopped"),
        ("stop-expect", stop_expect, "step 1 stops `ci-2` and names expectations"),
    ] {
        match load_text(tag, &text) {
            Ok(_) => panic!("{tag}: loaded, but should fail with {want:?}"),
            Err(e) => assert!(e.contains(want), "{tag}: {e}"),
        }
    }
}

const REVOKE: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/revoke.toml"));
const ROTATE: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/rotate.toml"));

/// A rotation step rotates the signing key or the mesh CA, and nothing else, in a lab of
/// one controller.
#[test]
fn a_rotation_step_rotates_the_signing_key_or_the_ca_only() {
    let lab = load_text("rotate", ROTATE).unwrap();
    assert_eq!(lab.action(0, std::path::Path::new("lab")), super::Action::Rotate("signing-key".into()));
    assert_eq!(lab.action(1, std::path::Path::new("lab")), super::Action::Rotate("ca".into()));
    let other = ROTATE.replace("rotate = \"signing-key\"", "rotate = \"admin-token\"");
    assert_eq!(load_text("rotate", &other).unwrap_err(), "FILE: step 1 rotates \"admin-token\"; \"signing-key\" and \"ca\" rotate");
}

/// A pause names a node host not paused already and no expectation; a resume names a host
/// paused before; the paused host's expectations are out of force in between.
#[test]
fn pauses_and_resumes_are_checked_and_take_expectations_out_of_force_in_between() {
    let lab = load_text("revoke", REVOKE).unwrap();
    let names = |steps: usize| lab.expectations(steps).iter().filter(|e| e.names("op-1")).count();
    let before = names(0);
    assert!(before > 0, "lab/revoke.toml expects something of op-1");
    assert_eq!((names(1), names(2)), (0, 0), "paused, then still paused while db-1 is revoked");
    assert!(names(3) > 0, "resumed, op-1 is expected again");
    assert_eq!(lab.action(0, std::path::Path::new("lab")), super::Action::Pause("op-1".into()));
    assert_eq!(lab.action(2, std::path::Path::new("lab")), super::Action::Resume("op-1".into()));
    let twice = REVOKE.replace("[[step]]\npause = \"op-1\"", "[[step]]\npause = \"op-1\"\n\n[[step]]\npause = \"op-1\"");
    let unpaused = REVOKE.replace("[[step]]\npause = \"op-1\"", "[[step]]\npause = \"api-1\"");
    let controller = REVOKE.replace("pause = \"op-1\"", "pause = \"controller\"");
    for (tag, text, want) in [
        ("twice", twice, "FILE: step 2 pauses `op-1`, which an earlier step paused or stopped"),
        ("unpaused", unpaused, "FILE: step 3 resumes `op-1`, which no earlier step paused"),
        ("controller", controller, "FILE: step 1 pauses `controller`, which is not a node host of the lab"),
    ] {
        assert_eq!(load_text(tag, &text).err().as_deref(), Some(want), "{tag}");
    }
}

/// A renewal step, checked against the lab file and against the declaration in force.
mod renew {
    const RENEW: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/renew.toml"));

    fn declaration(name: &str) -> trellis_core::Declaration {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lab").join(name);
        let mut files = vec![("mesh.toml".to_string(), std::fs::read_to_string(root.join("mesh.toml")).unwrap())];
        for m in std::fs::read_dir(root.join("modules")).unwrap().flatten() {
            files.push((format!("modules/{}", m.file_name().to_string_lossy()), std::fs::read_to_string(m.path()).unwrap()));
        }
        trellis_core::load::load_relative(&files, |p| p.to_string()).declaration.expect("a valid declaration")
    }

    /// A renew step names a node host whose agent runs, and no expectation; the declaration in
    /// force gives the node a certificate short-lived enough to wait for.
    #[test]
    fn a_renew_step_names_a_running_node_with_a_short_lived_certificate() {
        let dir = trellis_testing::TempDir::new("labfile-renew");
        let load = |text: &str| {
            let file = dir.join("lab.toml");
            std::fs::write(&file, text).unwrap();
            crate::file::load(&file).map(|(lab, _)| lab).map_err(|e| e.to_string().replace(&file.display().to_string(), "FILE"))
        };
        let lab = load(RENEW).unwrap();
        assert_eq!(lab.action(0, std::path::Path::new("lab")), crate::file::Action::Renew("db-1".into()));
        let expects =
            RENEW.replace("renew = \"db-1\"", "renew = \"db-1\"\n  [[step.expect]]\n  from = \"db-1\"\n  to = \"app-1\"\n  port = 22\n");
        for (tag, text, want) in [
            (
                "controller",
                RENEW.replace("renew = \"db-1\"", "renew = \"controller\""),
                "FILE: step 1 renews `controller`'s certificates, and `controller` is not a node host of the lab",
            ),
            ("expects", expects, "FILE: step 1 renews certificates, which changes no traffic"),
            (
                "paused",
                RENEW.replace("[[step]]\nrenew", "[[step]]\npause = \"db-1\"\n\n[[step]]\nrenew"),
                "FILE: step 2 renews `db-1`'s certificates, and an earlier step paused or stopped its agent",
            ),
        ] {
            match load(&text) {
                Ok(_) => panic!("{tag}: loaded, but should fail with {want:?}"),
                Err(e) => assert!(e.contains(want), "{tag}: {e}"),
            }
        }
        let renew = declaration("renew");
        crate::file::check_renewal(1, "db-1", &renew).unwrap();
        let e = crate::file::check_renewal(1, "app-1", &renew).unwrap_err().to_string();
        assert_eq!(e, "step 1 renews the certificates of `app-1`, which runs no module with a [module.certificate] in the declaration");
        let e = crate::file::check_renewal(1, "db-1", &declaration("basic")).unwrap_err().to_string();
        assert!(e.contains("which live 86400 s") && e.contains("service_cert_lifetime = \"1m\""), "{e}");
    }
}

const NAT: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/nat.toml"));

/// `mapping` belongs to a net with `nat`, and is `endpoint-independent` (the default) or
/// `symmetric`; a typo is refused at its line and column.
#[test]
fn a_nets_mapping_needs_nat_and_a_known_value() {
    let lab = load_text("nat", NAT).unwrap();
    let mapping = |net: &str| lab.net(net).unwrap().mapping;
    assert_eq!((mapping("home-a"), mapping("carrier-a")), (None, Some(super::Mapping::Symmetric)));
    let explicit = NAT.replacen("nat = \"internet\"\n", "nat = \"internet\"\nmapping = \"endpoint-independent\"\n", 1);
    assert_eq!(load_text("explicit", &explicit).unwrap().net("home-a").unwrap().mapping, Some(super::Mapping::EndpointIndependent));
    let no_nat = NAT.replacen("ipv4 = \"198.51.100.0/24\"\n", "ipv4 = \"198.51.100.0/24\"\nmapping = \"symmetric\"\n", 1);
    assert_eq!(
        load_text("no-nat", &no_nat).unwrap_err(),
        "FILE: net `internet` gives `mapping` but no `nat`; only a NAT router maps ports"
    );
    let typo = NAT.replacen("\nmapping = \"symmetric\"", "\nmapping = \"cone\"", 1);
    assert_eq!(load_text("typo", &typo).unwrap_err(), "FILE:28:11: unknown variant `cone`, expected `endpoint-independent` or `symmetric`");
}

/// A rebind names a declared net with a NAT router; it is a step of its own.
#[test]
fn a_rebind_step_names_a_net_with_nat() {
    let lab = load_text("nat", NAT).unwrap();
    assert_eq!(lab.action(0, std::path::Path::new("lab")), super::Action::Rebind("home-a".into()));
    assert_eq!(lab.expectations(1), lab.expect, "a rebind changes no expectation; every row is checked again");
    for (tag, text, want) in [
        ("unknown", NAT.replace("rebind = \"home-a\"", "rebind = \"home-c\""), "FILE: step 1 rebinds net `home-c`, which is not declared"),
        (
            "no-nat",
            NAT.replace("rebind = \"home-a\"", "rebind = \"internet\""),
            "FILE: step 1 rebinds net `internet`, which has no `nat` router to forget its mappings",
        ),
        ("two", NAT.replace("rebind = \"home-a\"", "rebind = \"home-a\"\nkill = \"controller\""), "FILE: step 1 needs exactly one of"),
    ] {
        let err = load_text(tag, &text).unwrap_err();
        assert!(err.starts_with(want), "{tag}: {err}");
    }
}

/// A quiet step gives 1 to 600 seconds and no expectation; it is a step of its own.
#[test]
fn a_quiet_step_gives_its_seconds_and_no_expectation() {
    let lab = load_text("nat", NAT).unwrap();
    assert_eq!(lab.action(1, std::path::Path::new("lab")), super::Action::Quiet(30));
    let row = "[[step.expect]]\nfrom = \"home-1\"\nto = \"home-2\"\nproto = \"icmp\"\nresult = \"open\"\n";
    for (tag, text, want) in [
        ("zero", NAT.replace("quiet = 30", "quiet = 0"), "FILE: step 2 is quiet for 0 s; give 1 to 600 seconds"),
        ("long", NAT.replace("quiet = 30", "quiet = 601"), "FILE: step 2 is quiet for 601 s; give 1 to 600 seconds"),
        ("expect", NAT.replace("quiet = 30", &format!("quiet = 30\n{row}")), "FILE: step 2 is quiet, which changes no traffic"),
        ("two", NAT.replace("quiet = 30", "quiet = 30\nrebind = \"home-a\""), "FILE: step 2 needs exactly one of"),
    ] {
        let err = load_text(tag, &text).unwrap_err();
        assert!(err.starts_with(want), "{tag}: {err}");
    }
}

/// A path row names two node hosts and `direct` or `relayed`, nothing else; `direct` and
/// `relayed` belong to path rows alone.
#[test]
fn a_path_expectation_names_two_nodes_and_direct_or_relayed() {
    let lab = load_text("nat", NAT).unwrap();
    let paths: Vec<_> = lab.expect.iter().filter(|e| e.proto == Some(super::Proto::Path)).map(|e| e.result.unwrap().as_str()).collect();
    assert_eq!(paths, ["direct", "direct", "relayed"]);
    let row = "[[expect]]\nfrom = \"home-1\"\nto = \"home-2\"\nproto = \"path\"\nresult = \"direct\"\n";
    let with = |tail: &str| NAT.replacen("[[expect]]\n", &format!("{tail}\n[[expect]]\n"), 1);
    let shape = "FILE: expectation 1 checks a path: give `to` and `result = \"direct\"` or `\"relayed\"`, and no `port`, `dns`, `via`, `name`, `host` or `answered_by`";
    for (tag, text, want) in [
        ("open", with(&row.replace("\"direct\"", "\"open\"")), shape.to_string()),
        ("no-result", with(&row.replace("result = \"direct\"\n", "")), shape.to_string()),
        ("port", with(&format!("{row}port = 5201\n")), shape.to_string()),
        ("no-to", with(&row.replace("to = \"home-2\"\n", "")), shape.to_string()),
        (
            "controller",
            with(&row.replace("to = \"home-2\"", "to = \"controller\"")),
            "FILE: expectation 1 checks the path from `home-1` to `controller`, and `controller` is not a node host (a path is read from both agents)".into(),
        ),
        (
            "tcp-direct",
            with("[[expect]]\nfrom = \"home-1\"\nto = \"home-2\"\nport = 22\nresult = \"relayed\"\n"),
            "FILE: expectation 1 expects `relayed`, which only a `proto = \"path\"` expectation can be".into(),
        ),
    ] {
        assert_eq!(load_text(tag, &text).err().as_deref(), Some(want.as_str()), "{tag}");
    }
    let typo = with(&row.replace("\"direct\"", "\"drect\""));
    assert!(load_text("typo", &typo).unwrap_err().contains("unknown variant `drect`"));
}

/// A revocation takes the revoked node's path rows out of force (it has no path to anyone) and
/// keeps its other rows: lab/fleet's db-1, revoked at step 2.
#[test]
fn a_revocation_ends_the_revoked_nodes_path_rows() {
    let fleet = load_text("fleet", include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/fleet.toml"))).unwrap();
    let db_paths =
        |steps: usize| fleet.expectations(steps).iter().filter(|e| e.proto == Some(super::Proto::Path) && e.names("db-1")).count();
    assert!(db_paths(1) > 0, "lab/fleet.toml checks db-1's paths");
    assert_eq!(db_paths(2), 0);
    assert!(fleet.expectations(2).iter().any(|e| e.names("db-1")));
}

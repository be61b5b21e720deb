//! Every problem `trellis check` must report, each with its place, through one helper.

use crate::support::{lines, load_text};

/// Loads `mesh` (and modules) and compares every diagnostic, in order, with `expect`.
#[track_caller]
fn check(mesh: &str, modules: &[(&str, &str)], expect: &[&str]) {
    let loaded = load_text(mesh, modules);
    // Through the load cache (ADR 0034), the same.
    let sources: Vec<trellis_core::SourceFile> =
        modules.iter().map(|(p, t)| trellis_core::SourceFile { path: format!("modules/{p}"), text: t.to_string() }).collect();
    let mesh_file = trellis_core::SourceFile { path: "mesh.toml".into(), text: mesh.to_string() };
    let cached = trellis_core::load::load_cached(&mesh_file, &sources, &mut Default::default());
    assert_eq!(lines(&cached.diagnostics), lines(&loaded.diagnostics), "through the load cache");
    assert_eq!(cached.declaration, loaded.declaration, "through the load cache");
    let mut diags = loaded.diagnostics.clone();
    if let Some(decl) = &loaded.declaration {
        let checked = trellis_core::explain::check(decl);
        // The controller checks with the addresses it stores, placed from the revision before:
        // any allocation gives the same diagnostics (here each node takes another's address).
        if let Ok(first) = trellis_core::allocate(decl, &Default::default()) {
            let other = trellis_core::Allocation {
                ipv4: first.ipv4.keys().cloned().zip(first.ipv4.values().rev().copied()).collect(),
                ..Default::default()
            };
            let placed = trellis_core::allocate(decl, &other).unwrap();
            assert!(first.ipv4.len() < 2 || placed != first, "the other allocation differs");
            assert_eq!(lines(&trellis_core::explain::check_allocated(decl, &placed)), lines(&checked), "checked with other addresses");
        }
        diags.extend(checked);
    }
    let got = lines(&diags);
    let want: String = expect.iter().map(|l| format!("{l}\n")).collect();
    assert_eq!(got, want, "\n--- got ---\n{got}--- want ---\n{want}");
    let has_errors = diags.iter().any(|d| d.is_error());
    assert_eq!(has_errors, expect.iter().any(|l| l.contains(": error: ")));
}

const HEAD: &str = "[mesh]\nname = \"t\"\ndomain = \"t.mesh\"\noverlay_ipv4 = \"10.88.0.0/24\"\n";

const PG: &str = "[module]\nname = \"pg\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"5432\"]\nfrom = [\"node:a\"]\n";

#[test]
fn a_valid_mesh_has_no_diagnostics() {
    check(&format!("{HEAD}[networks]\nlan = {{}}\n[[node]]\nname = \"a\"\nnetworks = [\"lan\"]\n[[node]]\nname = \"b\"\nmodules = [\"pg\"]\n[[node.endpoint]]\naddress = \"192.0.2.1:51820\"\nreachable_from = [\"lan\"]\n"), &[("pg.toml", PG)], &[]);
}

#[test]
fn unknown_keys_are_named_with_the_keys_allowed_there() {
    check(
        &format!("{HEAD}colour = \"red\"\n[[node]]\nname = \"a\"\nscope = \"internal\"\n"),
        &[("pg.toml", "[module]\nname = \"pg\"\n[[allow]]\nproto = \"tcp\"\nports = [\"5432\"]\nfrom = [\"node:a\"]\nscope = \"lan\"\n")],
        &[
            "mesh.toml:5:1: error: unknown key `colour` in [mesh]; allowed keys: name, domain, overlay_ipv4, overlay_ipv6, port, interface, mtu, service_cert_lifetime, min_agent_version",
            "mesh.toml:8:1: error: unknown key `scope` in [[node]]; allowed keys: name, hub, networks, groups, modules, address_ipv4, address_ipv6, endpoint, public_key, exit, direct",
            "modules/pg.toml:7:1: error: unknown key `scope` in [[allow]]; allowed keys: proto, ports, from",
        ],
    );
}

#[test]
fn a_rule_must_name_its_sources() {
    check(
        &format!("{HEAD}[[node]]\nname = \"a\"\n"),
        &[("pg.toml", "[module]\nname = \"pg\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"5432\"]\n\n[[allow]]\nproto = \"tcp\"\nports = [\"5433\"]\nfrom = []\n")],
        &[
            "modules/pg.toml:4:1: error: [[allow]] has no `from`: every rule must name its sources (\"node:NAME\", \"group:NAME\", \"module:NAME\" or \"mesh\")",
            "modules/pg.toml:8:1: error: [[allow]] has an empty `from`: every rule must name its sources (\"node:NAME\", \"group:NAME\", \"module:NAME\" or \"mesh\")",
        ],
    );
}

#[test]
fn sources_must_name_declared_things() {
    check(
        &format!("{HEAD}[groups]\nops = [\"a\"]\n[[node]]\nname = \"a\"\nmodules = [\"pg\"]\n"),
        &[("pg.toml", "[module]\nname = \"pg\"\n[[allow]]\nproto = \"tcp\"\nports = [\"5432\"]\nfrom = [\"node:ghost\", \"group:devs\", \"module:api\", \"mesh\", \"host:a\"]\n")],
        &[
            "modules/pg.toml:6:9: error: rule of module `pg` names source `node:ghost`, but no node `ghost` is declared (declared: a)",
            "modules/pg.toml:6:23: error: rule of module `pg` names source `group:devs`, but no group `devs` is declared (declared: ops)",
            "modules/pg.toml:6:37: error: rule of module `pg` names source `module:api`, but no module `api` is declared (declared: pg)",
            "modules/pg.toml:6:59: error: source \"host:a\" must be \"node:NAME\", \"group:NAME\", \"module:NAME\", \"pool:NAME\", \"expose:NAME\" or \"mesh\"",
        ],
    );
}

#[test]
fn nodes_must_name_declared_networks_groups_and_modules() {
    check(
        &format!("{HEAD}[networks]\nlan = {{}}\n[[node]]\nname = \"a\"\nnetworks = [\"wan\"]\ngroups = [\"ops\"]\nmodules = [\"web\"]\n"),
        &[],
        &[
            // Each at the name it is about (issue 12: these pointed at the `[[node]]` line).
            "mesh.toml:9:13: error: node `a` sits on network `wan`, which is not declared in [networks] (declared: lan)",
            "mesh.toml:10:11: error: node `a` names group `ops`, which is not declared in [groups] (none are declared)",
            "mesh.toml:11:12: error: node `a` runs module `web`, which has no manifest in modules/ (none are declared)",
        ],
    );
}

#[test]
fn duplicate_names_are_refused() {
    check(
        &format!("{HEAD}[[node]]\nname = \"a\"\n[[node]]\nname = \"a\"\n[[node]]\nname = \"pg\"\n"),
        &[("pg.toml", PG), ("pg2.toml", PG)],
        &[
            "mesh.toml:7:1: error: duplicate node `a`: already declared at mesh.toml:5:1",
            "modules/pg.toml:1:1: error: module `pg` has the name of node declared at mesh.toml:9:1; nodes and modules share the DNS zone, so their names must differ",
            "modules/pg2.toml:1:1: error: duplicate module `pg`: already declared at modules/pg.toml:1:1",
            "modules/pg2.toml:1:1: error: module `pg` has the name of node declared at mesh.toml:9:1; nodes and modules share the DNS zone, so their names must differ",
        ],
    );
}

/// Modules of one name are duplicates that each name the first; with no node of that name, none
/// of them takes a node's name in the zone.
#[test]
fn a_module_declared_twice_is_a_duplicate_not_a_node_clash() {
    check(
        &format!("{HEAD}[[node]]\nname = \"a\"\n"),
        &[("pg.toml", PG), ("pg2.toml", PG), ("pg3.toml", PG)],
        &[
            "modules/pg2.toml:1:1: error: duplicate module `pg`: already declared at modules/pg.toml:1:1",
            "modules/pg3.toml:1:1: error: duplicate module `pg`: already declared at modules/pg.toml:1:1",
        ],
    );
}

#[test]
fn cidrs_must_be_valid_and_must_not_overlap() {
    check(
        "[mesh]\nname = \"t\"\ndomain = \"t.mesh\"\noverlay_ipv4 = \"10.88.0.1/16\"\noverlay_ipv6 = \"fd88::/200\"\n",
        &[],
        &[
            "mesh.toml:4:16: error: `overlay_ipv4` 10.88.0.1/16 has host bits set; did you mean 10.88.0.0/16?",
            "mesh.toml:5:16: error: `overlay_ipv6` \"fd88::/200\" is not a valid CIDR of its address family",
        ],
    );
    check(
        &format!("{HEAD}[networks]\nlan = {{}}\n[[node]]\nname = \"a\"\n[[node.endpoint]]\naddress = \"10.88.0.9:51820\"\nreachable_from = [\"lan\"]\n"),
        &[],
        &["mesh.toml:9:1: error: endpoint 10.88.0.9:51820 of node `a` lies inside the overlay pool; an underlay address must not overlap the overlay"],
    );
    check(
        "[mesh]\nname = \"t\"\ndomain = \"t.mesh\"\n",
        &[],
        &["mesh.toml:1:1: error: [mesh] needs `overlay_ipv4`, `overlay_ipv6` or both: the overlay has no address pool"],
    );
}

#[test]
fn pinned_addresses_must_be_in_the_pool_and_unique() {
    check(
        &format!("{HEAD}[[node]]\nname = \"a\"\naddress_ipv4 = \"10.99.0.1\"\n[[node]]\nname = \"b\"\naddress_ipv4 = \"10.88.0.7\"\n[[node]]\nname = \"c\"\naddress_ipv4 = \"10.88.0.7\"\n[[node]]\nname = \"d\"\naddress_ipv4 = \"10.88.0.255\"\n"),
        &[],
        &[
            "mesh.toml:5:1: error: node `a` pins `address_ipv4` 10.99.0.1, which is not a usable address of the pool 10.88.0.0/24",
            "mesh.toml:11:1: error: node `c` pins 10.88.0.7, which node `b` pins already",
            "mesh.toml:14:1: error: node `d` pins `address_ipv4` 10.88.0.255, which is not a usable address of the pool 10.88.0.0/24",
        ],
    );
}

#[test]
fn an_exhausted_pool_is_reported() {
    let mut mesh = "[mesh]\nname = \"t\"\ndomain = \"t.mesh\"\noverlay_ipv4 = \"10.88.0.0/30\"\n".to_string();
    for n in ["a", "b", "c"] {
        mesh.push_str(&format!("[[node]]\nname = \"{n}\"\n"));
    }
    check(&mesh, &[], &["mesh.toml:1:1: error: `overlay_ipv4` 10.88.0.0/30 is exhausted: 3 nodes are declared but it holds 2 usable addresses; use a larger pool"]);
}

#[test]
fn ports_must_be_valid_and_icmp_has_none() {
    check(
        &format!("{HEAD}[[node]]\nname = \"a\"\n"),
        &[("m.toml", "[module]\nname = \"m\"\n[[allow]]\nproto = \"tcp\"\nports = [\"0\", \"70000\", \"90-80\", \"http\", \"8000-8100\"]\nfrom = [\"mesh\"]\n[[allow]]\nproto = \"icmp\"\nports = [\"1\"]\nfrom = [\"mesh\"]\n[[allow]]\nproto = \"udp\"\nfrom = [\"mesh\"]\n[[allow]]\nproto = \"sctp\"\nfrom = [\"mesh\"]\n")],
        &[
            "modules/m.toml:5:10: error: port \"0\" is not a port (1-65535) or a range \"FIRST-LAST\" with FIRST <= LAST",
            "modules/m.toml:5:15: error: port \"70000\" is not a port (1-65535) or a range \"FIRST-LAST\" with FIRST <= LAST",
            "modules/m.toml:5:24: error: port \"90-80\" is not a port (1-65535) or a range \"FIRST-LAST\" with FIRST <= LAST",
            "modules/m.toml:5:33: error: port \"http\" is not a port (1-65535) or a range \"FIRST-LAST\" with FIRST <= LAST",
            "modules/m.toml:7:1: error: [[allow]] with proto \"icmp\" takes no `ports`: ICMP has no ports",
            "modules/m.toml:11:1: error: [[allow]] with proto \"udp\" needs `ports`; an allow rule without ports would open every port",
            "modules/m.toml:15:9: error: `proto` \"sctp\" must be \"tcp\", \"udp\" or \"icmp\"",
        ],
    );
}

#[test]
fn hubs_need_endpoints_and_endpoints_declared_networks() {
    check(
        &format!("{HEAD}[networks]\nlan = {{}}\n[[node]]\nname = \"h\"\nhub = true\n[[node]]\nname = \"a\"\n[[node.endpoint]]\naddress = \"192.0.2.1:51820\"\nreachable_from = [\"wan\"]\n[[node.endpoint]]\naddress = \"192.0.2.1\"\nreachable_from = []\n"),
        &[],
        &[
            "mesh.toml:7:1: error: hub `h` has no [[node.endpoint]]: a hub relays for nodes that dial it, so it needs an endpoint they can reach",
            "mesh.toml:12:1: error: endpoint 192.0.2.1:51820 of node `a` is reachable from `wan`, which is not declared in [networks] (declared: lan)",
            "mesh.toml:16:11: error: endpoint `address` \"192.0.2.1\" must be IP:PORT or [IPv6]:PORT, with a port from 1 to 65535",
        ],
    );
}

#[test]
fn public_keys_must_be_wireguard_keys() {
    check(
        &format!("{HEAD}[[node]]\nname = \"a\"\npublic_key = \"not-a-key\"\n[[node]]\nname = \"b\"\npublic_key = \"AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=\"\n[[node]]\nname = \"c\"\npublic_key = \"AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=\"\n"),
        &[],
        &[
            "mesh.toml:7:14: error: `public_key` \"not-a-key\" is not a WireGuard public key (44 characters of base64, 32 bytes)",
            "mesh.toml:11:1: error: node `c` declares the same `public_key` as node `b`; every node needs its own key",
        ],
    );
}

#[test]
fn wrong_types_and_missing_keys_are_named() {
    check(
        "[mesh]\nname = \"t\"\ndomain = \"t.mesh\"\noverlay_ipv4 = \"10.88.0.0/24\"\nport = \"51820\"\n[[node]]\nhub = \"yes\"\n",
        &[],
        &[
            "mesh.toml:5:8: error: `port` in [mesh] must be an integer, found string",
            "mesh.toml:6:1: error: [[node]] is missing the required key `name`",
            "mesh.toml:7:7: error: `hub` in [[node]] must be true or false, found string",
        ],
    );
}

#[test]
fn toml_syntax_errors_have_a_place() {
    let loaded = load_text("[mesh]\nname = \"t\n", &[]);
    assert!(loaded.declaration.is_none());
    let got = lines(&loaded.diagnostics);
    assert!(got.starts_with("mesh.toml:2:10: error: invalid TOML: "), "{got}");
}

#[test]
fn every_problem_is_reported_at_once_sorted_by_file_and_line() {
    check(
        &format!("{HEAD}[[node]]\nname = \"a\"\nmodules = [\"nope\"]\n[[node]]\nname = \"B\"\n"),
        &[("x.toml", "[module]\nname = \"x\"\n[[allow]]\nproto = \"tcp\"\nports = [\"1\"]\n"), ("w.toml", "[modul]\n")],
        &[
            "mesh.toml:7:12: error: node `a` runs module `nope`, which has no manifest in modules/ (declared: x)",
            "mesh.toml:8:1: error: node name \"B\" must be a DNS label: 1-63 of a-z, 0-9 and '-', not starting or ending with '-'",
            "modules/w.toml:1:1: error: a module manifest needs a [module] table with `name`",
            "modules/w.toml:1:2: error: unknown key `modul` in modules/w.toml; allowed keys: module, allow",
            "modules/x.toml:3:1: error: [[allow]] has no `from`: every rule must name its sources (\"node:NAME\", \"group:NAME\", \"module:NAME\" or \"mesh\")",
        ],
    );
}

#[test]
fn failing_policy_tests_say_what_the_policy_does() {
    let mesh = format!("{HEAD}[networks]\nlan = {{}}\n[[node]]\nname = \"a\"\nnetworks = [\"lan\"]\n[[node]]\nname = \"b\"\nmodules = [\"pg\"]\nnetworks = [\"lan\"]\n[[node.endpoint]]\naddress = \"192.0.2.1:51820\"\nreachable_from = [\"lan\"]\n[[node]]\nname = \"c\"\n\n[[test]]\nfrom = \"node:a\"\nto = \"module:pg\"\nproto = \"tcp\"\nport = 5432\nexpect = \"deny\"\n\n[[test]]\nfrom = \"node:c\"\nto = \"node:b\"\nproto = \"tcp\"\nport = 5432\nexpect = \"allow\"\n\n[[test]]\nfrom = \"node:a\"\nto = \"node:b\"\nproto = \"icmp\"\nexpect = \"allow\"\n\n[[test]]\nfrom = \"node:a\"\nto = \"node:b\"\nproto = \"tcp\"\nport = 5432\nexpect = \"allow\"\n");
    let pg_from_a_and_c = "[module]\nname = \"pg\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"5432\"]\nfrom = [\"node:a\", \"node:c\"]\n";
    check(
        &mesh,
        &[("pg.toml", pg_from_a_and_c)],
        &[
            "mesh.toml:10:1: warning: no path between `b` and `c`: neither can dial an endpoint of the other and the mesh declares no hub; declare an endpoint reachable from the other's networks, or a hub both can reach",
            "mesh.toml:20:1: error: test from node:a to module:pg (tcp 5432) expects deny, but the policy allows it on b by module pg rule 1 (modules/pg.toml:4:1)",
            "mesh.toml:27:1: error: test from node:c to node:b (tcp 5432) expects allow, but the filter on b admits it and there is no path between c and b",
            "mesh.toml:34:1: error: test from node:a to node:b (icmp) expects allow, but the policy denies it on b: no rule of its modules [pg] admits a on icmp",
        ],
    );
}

#[test]
fn a_certificate_table_takes_only_plain_names_and_known_keys() {
    check(
        &format!("{HEAD}service_cert_lifetime = \"30s\"\n[[node]]\nname = \"a\"\nmodules = [\"pg\"]\n"),
        &[(
            "pg.toml",
            "[module]\nname = \"pg\"\n\n[module.certificate]\ngroup = \"../etc\"\nreload = \"-x.service\"\nmode = \"0644\"\n",
        )],
        &[
            "mesh.toml:5:25: error: `service_cert_lifetime` \"30s\" must be a duration from \"1m\" to \"90d\", such as \"24h\"",
            "modules/pg.toml:5:9: error: `group` \"../etc\" in [module.certificate] is not a plain group name (1-64 of letters, digits, '-', '_', '.', '@', not starting with '-' or '.')",
            "modules/pg.toml:6:10: error: `reload` \"-x.service\" in [module.certificate] is not a plain systemd unit name (1-64 of letters, digits, '-', '_', '.', '@', not starting with '-' or '.')",
            "modules/pg.toml:7:1: error: unknown key `mode` in [module.certificate]; allowed keys: group, reload",
        ],
    );
}

/// The review of 2026-12-02, finding 7: `reload` took any unit (`poweroff.target`,
/// `reboot.target`: every node running the module went down after each renewal) and `group` any
/// group (`users`: every service key readable by every user).
#[test]
fn a_certificate_reloads_only_a_service_and_gives_its_key_only_to_a_services_group() {
    let case = |key: &str, value: &str| {
        let pg = format!("[module]\nname = \"pg\"\n\n[module.certificate]\n{key} = \"{value}\"\n");
        let loaded = crate::support::load_text(&format!("{HEAD}[[node]]\nname = \"a\"\nmodules = [\"pg\"]\n"), &[("pg.toml", &pg)]);
        crate::support::lines(&loaded.diagnostics)
    };
    for unit in [
        "poweroff.target",
        "reboot.target",
        "rescue.target",
        "postgresql",
        "ssh.service",
        "sshd.service",
        "trellis-agent.service",
        "systemd-networkd.service",
        "dbus.service",
        ".service",
    ] {
        let got = case("reload", unit);
        assert!(got.starts_with(&format!("modules/pg.toml:5:10: error: `reload` \"{unit}\" in [module.certificate] ")), "{unit}: {got}");
    }
    assert!(case("reload", "poweroff.target").contains("is not a service unit (`NAME.service`)"));
    assert!(case("reload", "ssh.service").contains("takes the node, its network or the way in down"));
    for group in ["users", "staff", "root", "sudo", "adm", "shadow", "docker", "lxd"] {
        let got = case("group", group);
        assert!(
            got.starts_with(&format!("modules/pg.toml:5:9: error: `group` \"{group}\" in [module.certificate] is a group of every user")),
            "{group}: {got}"
        );
    }
    assert_eq!(case("reload", "postgresql.service"), "");
    assert_eq!(case("reload", "postgresql@15-main.service"), "");
    assert_eq!(case("group", "postgres"), "");
}

#[test]
fn an_empty_certificate_table_asks_for_the_defaults() {
    let decl = crate::support::valid(
        &format!("{HEAD}[[node]]\nname = \"a\"\nmodules = [\"pg\"]\n"),
        &[("pg.toml", "[module]\nname = \"pg\"\n[module.certificate]\n")],
    );
    let m = decl.module("pg").unwrap();
    assert_eq!(m.certificate, Some(trellis_core::decl::CertificateSpec::default()));
    assert_eq!(decl.mesh.service_cert_secs, trellis_core::decl::DEFAULT_SERVICE_CERT_SECS);
}

/// `[mesh] min_agent_version` (issue 21, item 3) is a release, or refused where it is written.
#[test]
fn a_minimum_agent_version_is_a_release() {
    check(
        &format!("{HEAD}min_agent_version = \"0.2\"\n[[node]]\nname = \"a\"\n"),
        &[],
        &["mesh.toml:5:21: error: `min_agent_version` \"0.2\" is not a release (MAJOR.MINOR.PATCH, such as \"0.2.0\" or \"1.0.0-rc.1\")"],
    );
    let decl = crate::support::valid(&format!("{HEAD}min_agent_version = \"0.2.0-rc.1\"\n[[node]]\nname = \"a\"\n"), &[]);
    assert_eq!(decl.mesh.min_agent_version.map(|r| r.to_string()).as_deref(), Some("0.2.0-rc.1"));
    assert_eq!(crate::support::valid(&format!("{HEAD}[[node]]\nname = \"a\"\n"), &[]).mesh.min_agent_version, None);
}

//! Exposures (ADR 0026): what `check` refuses (each with its place), `expose:NAME` as a rule
//! source, and what the compiler gives ingress nodes and runners: exactly the ingress nodes
//! admitted on exactly the port, and backends that are exactly the runners holding keys.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use proptest::prelude::*;
use trellis_core::compile::{INGRESS_TOML, NFTABLES_CONF};
use trellis_core::decl::PublicKey;
use trellis_core::plan::TRAEFIK_YML;
use trellis_core::topology::Topology;
use trellis_core::traefik::IngressFile;
use trellis_core::{compile, Declaration, Keys};

use crate::support::{lines, load_text, valid};

const HEAD: &str = "[mesh]\nname = \"x\"\ndomain = \"x.mesh\"\noverlay_ipv4 = \"10.88.0.0/24\"\n\n[networks]\ninternet = {}\n";

/// A node on the internet; one that runs no module has an endpoint there (the runners dial it).
fn node(name: &str, modules: &[&str]) -> String {
    let m: Vec<String> = modules.iter().map(|m| format!("\"{m}\"")).collect();
    let mut s = format!("\n[[node]]\nname = \"{name}\"\nnetworks = [\"internet\"]\nmodules = [{}]\n", m.join(", "));
    if modules.is_empty() {
        let n: u32 = name.bytes().map(u32::from).sum::<u32>() % 250 + 1;
        s += &format!("[[node.endpoint]]\naddress = \"198.51.100.{n}:51820\"\nreachable_from = [\"internet\"]\n");
    }
    s
}

fn nodes() -> String {
    [node("edge-1", &[]), node("edge-2", &[]), node("web-1", &["web"]), node("web-2", &["web"]), node("db-1", &[])].concat()
}

const ACME: &str = "\n[acme]\ndirectory = \"https://acme.example.net/dir\"\nemail = \"ops@example.com\"\n";

const SHOP: &str =
    "\n[[expose]]\nname = \"shop\"\nhostnames = [\"shop.example.com\"]\nmodule = \"web\"\nport = 8080\nvia = [\"edge-1\", \"edge-2\"]\n";

const WEB: &str = "[module]\nname = \"web\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"8080\"]\nfrom = [\"expose:shop\"]\n";

#[track_caller]
fn check(mesh: &str, modules: &[(&str, &str)], expect: &[&str]) {
    let loaded = load_text(mesh, modules);
    let mut diags = loaded.diagnostics.clone();
    if let Some(decl) = &loaded.declaration {
        diags.extend(trellis_core::explain::check(decl));
    }
    let got = lines(&diags);
    let want: String = expect.iter().map(|l| format!("{l}\n")).collect();
    assert_eq!(got, want, "\n--- got ---\n{got}--- want ---\n{want}");
    assert_eq!(loaded.declaration.is_none(), expect.iter().any(|l| l.contains(": error: ")));
}

#[test]
fn a_declared_exposure_admitted_by_its_module_is_valid() {
    check(&format!("{HEAD}{}{ACME}{SHOP}", nodes()), &[("web.toml", WEB)], &[]);
}

#[test]
fn an_exposure_that_no_rule_admits_on_its_port_is_refused_naming_exposure_module_and_port() {
    let web = "[module]\nname = \"web\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"9090\"]\nfrom = [\"expose:shop\"]\n";
    check(
        &format!("{HEAD}{}{ACME}{SHOP}", nodes()),
        &[("web.toml", web)],
        &[
            "mesh.toml:47:1: error: exposure `shop` sends to port 8080 of module `web`, but no rule of module `web` admits it there; add [[allow]] proto = \"tcp\", ports = [\"8080\"], from = [\"expose:shop\"] to modules/web.toml",
            "modules/web.toml:7:9: error: rule of module `web` admits `expose:shop` on ports 9090, but exposure `shop` sends only to tcp port 8080; admit it in a rule with proto = \"tcp\", ports = [\"8080\"] and nothing else",
        ],
    );
    // A rule on the port that admits others but not the exposure does not count either.
    let web = "[module]\nname = \"web\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"8080\"]\nfrom = [\"node:edge-1\", \"node:edge-2\"]\n";
    check(
        &format!("{HEAD}{}{ACME}{SHOP}", nodes()),
        &[("web.toml", web)],
        &["mesh.toml:47:1: error: exposure `shop` sends to port 8080 of module `web`, but no rule of module `web` admits it there; add [[allow]] proto = \"tcp\", ports = [\"8080\"], from = [\"expose:shop\"] to modules/web.toml"],
    );
}

/// The review of 2026-12-02, finding 14: ADR 0026 says an edge is admitted to nothing it does not
/// serve, but a rule that admitted `expose:NAME` on the exposure's port could admit it on other
/// ports, and on UDP, too.
#[test]
fn an_exposure_admitted_beyond_its_port_or_over_another_protocol_is_refused() {
    let wide =
        "[module]\nname = \"web\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"8080\", \"22\", \"8000-8100\"]\nfrom = [\"expose:shop\"]\n";
    check(
        &format!("{HEAD}{}{ACME}{SHOP}", nodes()),
        &[("web.toml", wide)],
        &["modules/web.toml:7:9: error: rule of module `web` admits `expose:shop` on ports 22, 8000-8100, but exposure `shop` sends only to tcp port 8080; admit it in a rule with proto = \"tcp\", ports = [\"8080\"] and nothing else"],
    );
    let udp = format!("{WEB}\n[[allow]]\nproto = \"udp\"\nports = [\"8080\"]\nfrom = [\"node:db-1\", \"expose:shop\"]\n");
    check(
        &format!("{HEAD}{}{ACME}{SHOP}", nodes()),
        &[("web.toml", &udp)],
        &["modules/web.toml:12:22: error: rule of module `web` admits `expose:shop` on proto \"udp\", but exposure `shop` sends only to tcp port 8080; admit it in a rule with proto = \"tcp\", ports = [\"8080\"] and nothing else"],
    );
}

/// The review of 2026-12-02, finding 4: `[acme]` values were copied into TOML and then YAML
/// without escaping, and a directory spelled with TOML escapes wrote arbitrary Traefik static
/// configuration on every ingress node. The review's own declaration is refused where written;
/// so is every quote, backslash, brace, space or control, in either value.
#[test]
fn acme_values_that_would_read_as_more_than_one_string_are_refused() {
    let injected = r#"'https://127.0.0.1:1/dir\"\naccessLog:\n\u0020\u0020filePath:\u0020\"scratch/inject/written-by-traefik.log\"\nCertificatesResolvers:\n\u0020\u0020x:\n\u0020\u0020\u0020\u0020acme:\n\u0020\u0020\u0020\u0020\u0020\u0020caServer:\u0020\"https://127.0.0.1:1/dir'"#;
    let acme = |directory: &str, email: &str| format!("\n[acme]\ndirectory = {directory}\nemail = {email}\n");
    let loaded = load_text(&format!("{HEAD}{}{}{SHOP}", nodes(), acme(injected, "\"ops@example.com\"")), &[("web.toml", WEB)]);
    let got = lines(&loaded.diagnostics);
    assert!(
        loaded.declaration.is_none() && got.contains(r#"error: [acme] `directory` "https://127.0.0.1:1/dir\\\"\\naccessLog:"#),
        "{got}"
    );
    for bad in [
        r#""https://ca.example/dir\"x""#,
        r#"'https://ca.example/a\b'"#,
        r#""https://ca.example/{x}""#,
        r#""https://ca.example/a'b""#,
        r#""https:///dir""#,
        r#""https://ca.example/\u0000""#,
    ] {
        let loaded = load_text(&format!("{HEAD}{}{}{SHOP}", nodes(), acme(bad, "\"ops@example.com\"")), &[("web.toml", WEB)]);
        assert!(loaded.declaration.is_none(), "directory {bad} was taken");
    }
    for bad in [r#"'ops\@example.com'"#, r#""o{p}s@example.com""#, r#""ops@example""#, r#""ops@exa mple.com""#, r#"'o"ps@example.com'"#] {
        let loaded = load_text(&format!("{HEAD}{}{}{SHOP}", nodes(), acme("\"https://ca.example/dir\"", bad)), &[("web.toml", WEB)]);
        assert!(loaded.declaration.is_none(), "email {bad} was taken");
    }
    // What a real directory is written with is taken.
    let ok = acme("\"https://acme-v02.api.letsencrypt.org:443/directory?x=1&y=%2F#top\"", "\"ops+acme@mail.example.com\"");
    check(&format!("{HEAD}{}{ok}{SHOP}", nodes()), &[("web.toml", WEB)], &[]);
}

/// The agent reads `ingress.toml` as the declaration was read: a file whose strings would not
/// stay one string in Traefik's static configuration is refused, naming the key; what it takes
/// is written there as one YAML string, and back into TOML by TOML's own serializer.
#[test]
fn the_ingress_file_refuses_what_the_declaration_would_and_is_written_by_serializers() {
    for (text, key) in [
        ("listen = [443]\nacme_directory = \"https://x.example/\\\"\\ncaServer: x\"\n", "`acme_directory`"),
        ("listen = [443]\nacme_directory = \"https://x.example/dir\"\nacme_email = \"a\\\\b@example.com\"\n", "`acme_email`"),
        ("listen = [443]\nacme_directory = \"http://x.example/dir\"\n", "`acme_directory`"),
    ] {
        let e = IngressFile::parse("edge-1", text).expect_err(text);
        assert!(e.starts_with(key), "{text}: {e}");
    }
    let taken = IngressFile {
        node: "edge-1".into(),
        listen: vec![443, 8443],
        acme_directory: Some("https://ca.example:14000/dir?a=1&b=%22#x".into()),
        acme_email: Some("ops+acme@example.com".into()),
    };
    let back = IngressFile::parse("edge-1", &taken.write()).unwrap();
    assert_eq!(
        (back.listen.clone(), back.acme_directory.clone(), back.acme_email.clone()),
        (taken.listen.clone(), taken.acme_directory.clone(), taken.acme_email.clone())
    );
    let paths = trellis_core::traefik::StaticPaths {
        dynamic_dir: "/etc/trellis/traefik".into(),
        acme_storage: "/var/lib/x/acme.json".into(),
        api: "127.0.0.1:9".into(),
    };
    let yml = trellis_core::traefik::static_config(&back, &paths);
    assert!(yml.contains("\n      caServer: \"https://ca.example:14000/dir?a=1&b=%22#x\"\n      storage: \"/var/lib/x/acme.json\"\n      email: \"ops+acme@example.com\"\n"), "{yml}");
    // Every top-level key is one the template writes, once.
    let top: Vec<&str> = yml.lines().filter(|l| !l.starts_with([' ', '#'])).collect();
    assert_eq!(top, ["global:", "entryPoints:", "providers:", "api:", "ping:", "log:", "certificatesResolvers:"], "{yml}");
}

#[test]
fn unknown_via_and_module_are_refused_where_written() {
    let shop = "\n[[expose]]\nname = \"shop\"\nhostnames = [\"shop.example.com\"]\nmodule = \"wbe\"\nport = 8080\nvia = [\"edge-1\", \"edge-9\", \"edge-1\"]\n";
    check(
        &format!("{HEAD}{}{ACME}{shop}", nodes()),
        &[("web.toml", WEB)],
        &[
            "mesh.toml:50:10: error: exposure `shop` exposes module `wbe`, which has no manifest in modules/ (declared: web)",
            "mesh.toml:52:18: error: exposure `shop` goes via `edge-9`, which is not a declared node (declared: db-1, edge-1, edge-2, web-1, web-2)",
            "mesh.toml:52:28: error: exposure `shop` names `edge-1` in `via` twice",
            "modules/web.toml:7:9: error: rule of module `web` names source `expose:shop`, but exposure `shop` exposes module `wbe`; its ingress nodes are admitted only to the module they serve",
        ],
    );
}

#[test]
fn a_hostname_given_twice_acme_without_acme_and_mixed_tls_on_one_port_are_refused() {
    let two = "\n[[expose]]\nname = \"shop\"\nhostnames = [\"shop.example.com\"]\nmodule = \"web\"\nport = 8080\nvia = [\"edge-1\"]\n\n[[expose]]\nname = \"shop2\"\nhostnames = [\"www.example.com\", \"shop.example.com\"]\nmodule = \"web\"\nport = 8080\nvia = [\"edge-1\"]\ntls = \"passthrough\"\n";
    let web = "[module]\nname = \"web\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"8080\"]\nfrom = [\"expose:shop\", \"expose:shop2\"]\n";
    check(
        &format!("{HEAD}{}{two}", nodes()),
        &[("web.toml", web)],
        &[
            "mesh.toml:43:1: error: exposure `shop` takes its certificates from ACME (`tls = \"acme\"`, the default), but the declaration has no [acme] table with its `directory`",
            "mesh.toml:52:33: error: hostname `shop.example.com` of exposure `shop2` is already served by exposure `shop` at mesh.toml:45:14; a name has one exposure",
            "mesh.toml:56:7: error: exposure `shop2` listens on port 443 of `edge-1` with tls \"passthrough\", but exposure `shop` listens there with tls \"acme\"; one port of an ingress node has one TLS mode",
        ],
    );
}

#[test]
fn unknown_keys_and_bad_values_of_expose_and_acme_are_refused_where_written() {
    let bad = "\n[acme]\ndirectory = \"http://acme.example.net/dir\"\ncontact = \"x\"\n\n[[expose]]\nname = \"shop\"\nhostnames = [\"*.example.com\", \"shop\"]\nmodule = \"web\"\nport = 0\nvia = []\ntls = \"tls\"\nsources = [\"10.0.0.1/8\", \"nowhere\"]\nscope = \"public\"\n";
    check(
        &format!("{HEAD}{}{bad}", nodes()),
        &[("web.toml", WEB)],
        &[
            "mesh.toml:44:13: error: [acme] `directory` \"http://acme.example.net/dir\" must be an https:// URL of an ACME directory (a host, then only the characters a URL is written with: no quotes, backslashes, braces or spaces)",
            "mesh.toml:45:1: error: unknown key `contact` in [acme]; allowed keys: directory, email",
            "mesh.toml:47:1: error: [[expose]] has an empty `via`: name the ingress node(s) that serve it",
            "mesh.toml:49:14: error: hostname \"*.example.com\" is not a public DNS name (two or more labels of a-z, 0-9 and '-', no wildcard)",
            "mesh.toml:49:31: error: hostname \"shop\" is not a public DNS name (two or more labels of a-z, 0-9 and '-', no wildcard)",
            "mesh.toml:51:8: error: [[expose]] `port` 0 is not a valid TCP port (1-65535)",
            "mesh.toml:53:7: error: [[expose]] `tls` \"tls\" must be \"acme\", \"passthrough\" or \"none\"",
            "mesh.toml:54:12: error: exposure source 10.0.0.1/8 has host bits set; did you mean 10.0.0.0/8?",
            "mesh.toml:54:26: error: exposure source \"nowhere\" is not a CIDR prefix such as \"203.0.113.0/24\"",
            "mesh.toml:55:1: error: unknown key `scope` in [[expose]]; allowed keys: name, hostnames, module, port, via, listen, tls, sources",
            // The exposure did not parse, so the rule's source names nothing.
            "modules/web.toml:7:9: error: rule of module `web` names source `expose:shop`, but no exposure `shop` is declared (none are declared)",
        ],
    );
}

#[test]
fn an_unknown_exposure_as_a_source_is_refused() {
    let web = "[module]\nname = \"web\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"8080\"]\nfrom = [\"expose:shop\", \"expose:shopp\"]\n";
    check(
        &format!("{HEAD}{}{ACME}{SHOP}", nodes()),
        &[("web.toml", web)],
        &["modules/web.toml:7:24: error: rule of module `web` names source `expose:shopp`, but no exposure `shopp` is declared (declared: shop)"],
    );
}

#[test]
fn acme_on_another_port_than_443_is_warned_about() {
    let shop = SHOP.replace("port = 8080\n", "port = 8080\nlisten = 8443\n");
    check(
        &format!("{HEAD}{}{ACME}{shop}", nodes()),
        &[("web.toml", WEB)],
        &["mesh.toml:47:1: warning: exposure `shop` takes ACME certificates but listens on 8443: TLS-ALPN-01 validation reaches port 443 only, so the edge must also be reached at 443 through a port forward"],
    );
}

fn key(i: u8) -> PublicKey {
    PublicKey([i + 1; 32])
}

fn file<'c>(c: &'c trellis_core::Compiled, node: &str, path: &str) -> Option<&'c trellis_core::FileResource> {
    c.nodes[node].files.iter().find(|f| f.path == path)
}

#[test]
fn ingress_nodes_get_routes_to_the_keyed_runners_and_peer_with_them_and_nothing_else() {
    let d = valid(&format!("{HEAD}{}{ACME}{SHOP}", nodes()), &[("web.toml", WEB)]);
    let mut keys = Keys::default();
    for (i, n) in ["edge-1", "edge-2", "web-1", "db-1"].iter().enumerate() {
        keys.set(n, Some(key(i as u8)));
    }
    let c = compile(&Arc::new(d.clone()), &keys, &Default::default(), None).unwrap();
    let yml = file(&c, "edge-1", TRAEFIK_YML).expect("an ingress node has Traefik's routes").content.to_string();
    let web1 = c.allocation.ipv4["web-1"];
    let web2 = c.allocation.ipv4["web-2"];
    assert!(yml.contains(&format!("- url: \"http://{web1}:8080\"")), "{yml}");
    // web-2 has no key yet: no tunnel reaches it, so it is no backend.
    assert!(!yml.contains(&web2.to_string()), "{yml}");
    assert!(yml.contains("rule: \"Host(`shop.example.com`)\""), "{yml}");
    assert!(yml.contains("certResolver: \"trellis\""), "{yml}");
    assert!(yml.contains("sourceRange: [\"0.0.0.0/0\", \"::/0\"]"), "{yml}");
    let ingress = IngressFile::parse("edge-1", &file(&c, "edge-1", INGRESS_TOML).unwrap().content.to_string()).unwrap();
    assert_eq!(ingress.listen, vec![443]);
    assert_eq!(ingress.acme_directory.as_deref(), Some("https://acme.example.net/dir"));
    assert_eq!(ingress.acme_email.as_deref(), Some("ops@example.com"));
    for n in ["web-1", "web-2", "db-1"] {
        assert!(file(&c, n, TRAEFIK_YML).is_none() && file(&c, n, INGRESS_TOML).is_none(), "{n} is no ingress");
    }
    let peers = |n: &str| -> Vec<String> { c.nodes[n].plan.peers.iter().map(|p| p.name().to_string()).collect() };
    assert_eq!(peers("edge-1"), vec!["web-1"]);
    assert_eq!(c.nodes["edge-1"].plan.left_out.iter().map(|n| n.to_string()).collect::<Vec<_>>(), vec!["web-2"]);
    assert_eq!(peers("web-1"), vec!["edge-1", "edge-2"]);
    assert!(peers("db-1").is_empty());
    // web-2 enrols: it becomes a backend, by the key change alone.
    keys.set("web-2", Some(key(9)));
    let c = compile(&Arc::new(d), &keys, &Default::default(), Some(c)).unwrap();
    let yml = file(&c, "edge-2", TRAEFIK_YML).unwrap().content.to_string();
    assert!(yml.contains(&format!("- url: \"http://{web1}:8080\"")) && yml.contains(&format!("- url: \"http://{web2}:8080\"")), "{yml}");
    assert!(c.rendered.contains(&"edge-2".to_string()));
}

#[test]
fn explain_names_the_ingress_nodes_the_backends_and_the_admitting_rule() {
    let d = valid(&format!("{HEAD}{}{ACME}{SHOP}", nodes()), &[("web.toml", WEB)]);
    let alloc = trellis_core::allocate(&d, &Default::default()).unwrap();
    let topo = Topology::new(&d, &alloc, &Keys::default());
    let text = trellis_core::explain::explain_exposure(&topo, "shop").unwrap();
    assert!(text.contains("ingress nodes (each runs Traefik): edge-1, edge-2"), "{text}");
    assert!(text.contains("backends: the runners of module web that hold a key: web-1, web-2"), "{text}");
    assert!(text.contains("admitted by module web rule 1 (modules/web.toml:4:1): tcp 8080 from expose:shop"), "{text}");
    assert!(trellis_core::explain::explain_exposure(&topo, "nothing").is_none());
}

/// The addresses in the nftables lines of a rule admitting `port`, per rendered file.
fn admitted_on(nft: &str, port: u16) -> BTreeSet<IpAddr> {
    let mut out = BTreeSet::new();
    for line in nft.lines().filter(|l| l.contains(&format!("tcp dport {{ {port} }}"))) {
        out.extend(crate::support::saddrs(nft, line).iter().filter_map(|a| a.parse::<IpAddr>().ok()));
    }
    out
}

/// The backends' addresses in an ingress node's Traefik routes.
fn backends(yml: &str) -> BTreeSet<IpAddr> {
    yml.lines()
        .filter_map(|l| l.trim().strip_prefix("- url: \"http://"))
        .filter_map(|r| r.split(':').next())
        .filter_map(|a| a.parse().ok())
        .collect()
}

/// A mesh of `n` nodes (`n0`, `n1`, ...): `runs` run module web, `via` are the exposure's ingress
/// nodes, `keyed` hold keys.
fn generated(n: usize, runs: &[bool], via: &[bool], keyed: &[bool]) -> (Declaration, Keys) {
    let mut mesh = format!("{HEAD}{ACME}");
    for (i, &run) in runs.iter().enumerate().take(n) {
        mesh += &node(&format!("n{i}"), if run { &["web"] } else { &[] });
    }
    let via: Vec<String> = (0..n).filter(|&i| via[i]).map(|i| format!("\"n{i}\"")).collect();
    mesh += &format!(
        "\n[[expose]]\nname = \"shop\"\nhostnames = [\"shop.example.com\"]\nmodule = \"web\"\nport = 8080\nvia = [{}]\n",
        via.join(", ")
    );
    // Another rule on another port, from every node: the exposure must not widen it, nor it the exposure.
    let web = format!("{WEB}\n[[allow]]\nproto = \"tcp\"\nports = [\"9100\"]\nfrom = [\"mesh\"]\n");
    let d = valid(&mesh, &[("web.toml", &web)]);
    let mut keys = Keys::default();
    for i in (0..n).filter(|&i| keyed[i]) {
        keys.set(&format!("n{i}"), Some(key(i as u8)));
    }
    (d, keys)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64), .. ProptestConfig::default() })]

    /// On every runner, the rule of the exposure admits exactly the ingress nodes' overlay
    /// addresses, on exactly the exposed port; every ingress node's backends are exactly the
    /// runners with a key; and no other node has Traefik's files.
    #[test]
    fn exactly_the_ingress_nodes_are_admitted_on_exactly_the_port_and_the_backends_are_the_keyed_runners(
        n in 2usize..9,
        runs in proptest::collection::vec(any::<bool>(), 9),
        via in proptest::collection::vec(any::<bool>(), 9),
        keyed in proptest::collection::vec(any::<bool>(), 9),
        first in 0usize..9,
    ) {
        let mut via = via;
        via[first % n] = true;
        let (d, keys) = generated(n, &runs, &via, &keyed);
        let c = compile(&Arc::new(d), &keys, &Default::default(), None).unwrap();
        let addr = |i: usize| IpAddr::V4(c.allocation.ipv4[&format!("n{i}")]);
        let ingress: BTreeSet<IpAddr> = (0..n).filter(|&i| via[i]).map(addr).collect();
        let keyed_runners: BTreeSet<IpAddr> = (0..n).filter(|&i| runs[i] && keyed[i]).map(addr).collect();
        for i in 0..n {
            let name = format!("n{i}");
            let nft = file(&c, &name, NFTABLES_CONF).unwrap().content.to_string();
            if runs[i] {
                prop_assert_eq!(admitted_on(&nft, 8080), ingress.clone(), "{}: port 8080", name);
                prop_assert_eq!(admitted_on(&nft, 9100).len(), n, "{}: the other rule admits every node", name);
            } else {
                prop_assert!(admitted_on(&nft, 8080).is_empty(), "{} runs no web but admits on 8080", name);
            }
            match file(&c, &name, TRAEFIK_YML) {
                Some(f) => {
                    prop_assert!(via[i], "{} is no ingress but has Traefik's routes", name);
                    prop_assert_eq!(backends(&f.content.to_string()), keyed_runners.clone(), "{}: backends", name);
                }
                None => prop_assert!(!via[i], "ingress {} has no Traefik routes", name),
            }
        }
    }
}

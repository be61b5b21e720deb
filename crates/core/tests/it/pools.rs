//! Pools of short-lived nodes: the `[[pool]]` table, its checks, `pool:NAME` as a source, and
//! members compiled as nodes once the controller adds them.

use std::sync::Arc;

use trellis_core::decl::{duration_secs, Member, PublicKey, Source};
use trellis_core::explain;

use crate::support::{lines, load_text, valid};

const HEAD: &str = "[mesh]\nname = \"t\"\ndomain = \"t.mesh\"\noverlay_ipv4 = \"10.88.0.0/24\"\n";

const PING: &str = "[module]\nname = \"ping\"\n[[allow]]\nproto = \"icmp\"\nfrom = [\"pool:ci\"]\n";
const WEB: &str = "[module]\nname = \"web\"\n[[allow]]\nproto = \"tcp\"\nports = [\"80\"]\nfrom = [\"group:runners\"]\n";

fn mesh() -> String {
    format!(
        "{HEAD}[networks]\ninternet = {{}}\n[groups]\nrunners = []\n\
         [[node]]\nname = \"web-1\"\nnetworks = [\"internet\"]\nmodules = [\"ping\", \"web\"]\n\
         [[node.endpoint]]\naddress = \"192.0.2.1:51820\"\nreachable_from = [\"internet\"]\n\
         [[node]]\nname = \"db-1\"\nnetworks = [\"internet\"]\n\
         [[node.endpoint]]\naddress = \"192.0.2.2:51820\"\nreachable_from = [\"internet\"]\n\
         [[pool]]\nname = \"ci\"\nsize = 3\nnetworks = [\"internet\"]\ngroups = [\"runners\"]\nephemeral_after = \"10m\"\n"
    )
}

fn check(mesh: &str, modules: &[(&str, &str)], expect: &[&str]) {
    let loaded = load_text(mesh, modules);
    let mut diags = loaded.diagnostics.clone();
    if let Some(decl) = &loaded.declaration {
        diags.extend(explain::check(decl));
    }
    let got = lines(&diags);
    let want: String = expect.iter().map(|l| format!("{l}\n")).collect();
    assert_eq!(got, want, "\n--- got ---\n{got}--- want ---\n{want}");
}

fn member(name: &str) -> Member {
    Member { name: name.into(), pool: "ci".into(), address_ipv4: None, address_ipv6: None }
}

#[test]
fn a_pool_is_read_with_its_settings() {
    let d = valid(&mesh(), &[("ping.toml", PING), ("web.toml", WEB)]);
    let p = d.pool("ci").expect("pool ci");
    assert_eq!((p.size, p.ephemeral_after), (3, Some(600)));
    assert_eq!((p.networks.as_slice(), p.groups.as_slice()), (&["internet".to_string()][..], &["runners".to_string()][..]));
    assert_eq!(d.modules[0].allow[0].from, vec![Source::Pool("ci".into())]);
}

#[test]
fn a_rule_naming_only_an_empty_pool_is_not_a_warning() {
    // Members join when they enrol; `check` does not call the rule one that admits nothing.
    check(&mesh(), &[("ping.toml", PING), ("web.toml", WEB)], &[]);
}

#[test]
fn a_rule_naming_an_empty_group_no_pool_joins_still_warns() {
    let web = WEB.replace("group:runners", "group:ops");
    let mesh = mesh().replace("runners = []", "runners = []\nops = []");
    check(
        &mesh,
        &[("ping.toml", PING), ("web.toml", &web)],
        &["modules/web.toml:3:1: warning: rule 1 of module `web` names sources that contain no node; it admits nothing"],
    );
}

#[test]
fn members_are_nodes_with_the_pools_networks_groups_and_modules() {
    let d = valid(&mesh(), &[("ping.toml", PING), ("web.toml", WEB)]);
    let full = d.with_members(&[member("ci-1"), member("ci-2"), Member { pool: "gone".into(), ..member("gone-1") }]);
    assert_eq!(full.nodes.len(), d.nodes.len() + 2, "a member of an undeclared pool is left out");
    let m = full.node("ci-2").unwrap();
    assert_eq!((m.pool.as_deref(), m.endpoints.len(), m.groups.clone()), (Some("ci"), 0, vec!["runners".to_string()]));

    // pool:ci admits the members to ping on web-1; group:runners admits them to web.
    let topo = trellis_core::topology::Topology::new(
        &full,
        &trellis_core::allocate(&full, &Default::default()).unwrap(),
        &trellis_core::Keys::default(),
    );
    let (web, ci1, ci2, db) = (topo.index["web-1"], topo.index["ci-1"], topo.index["ci-2"], topo.index["db-1"]);
    let ping = topo.rules.iter().find(|r| r.module == "ping").unwrap();
    assert_eq!(ping.sources, vec![ci1, ci2]);
    assert_eq!(topo.admitting(ci2, web, trellis_core::decl::Proto::Tcp, Some(80)).len(), 1);
    assert!(topo.admitting(db, web, trellis_core::decl::Proto::Icmp, None).is_empty());
    let e = explain::explain(&topo, "ci-1", "web-1").unwrap();
    let text = e.to_text();
    assert!(text.contains("pool:ci (ci-1 is a member)"), "{text}");
}

#[test]
fn a_members_peers_come_from_the_policy_and_drop_it_when_it_leaves() {
    let d = valid(&mesh(), &[("ping.toml", PING), ("web.toml", WEB)]);
    let key = |b: u8| PublicKey([b; 32]);
    let keys: trellis_core::Keys =
        [("web-1", key(1)), ("db-1", key(2)), ("ci-1", key(3))].into_iter().map(|(n, k)| (n.to_string(), k)).collect();
    let with = Arc::new(d.with_members(&[member("ci-1")]).into_owned());
    let c = trellis_core::compile(&with, &keys, &Default::default(), None).unwrap();
    let wg = |c: &trellis_core::Compiled, n: &str| {
        c.nodes[n].files.iter().find(|f| f.path.ends_with("wireguard.conf")).unwrap().content.to_string()
    };
    assert!(wg(&c, "web-1").contains(&key(3).to_string()), "web-1 peers with ci-1");
    assert!(!wg(&c, "db-1").contains(&key(3).to_string()), "db-1 has no traffic with ci-1");
    assert!(wg(&c, "ci-1").contains("Endpoint = 192.0.2.1:51820"), "ci-1 dials web-1");
    let nft = c.nodes["web-1"].files.iter().find(|f| f.path.ends_with("nftables.conf")).unwrap().content.to_string();
    let ci1 = c.allocation.ipv4["ci-1"].to_string();
    assert!(nft.contains(&ci1), "web-1's filter admits ci-1's address:\n{nft}");

    // Recompiled from that output without the member: its peers drop it.
    assert!(matches!(d.with_members(&[]), std::borrow::Cow::Borrowed(_)), "no member added: the declaration is not copied");
    let without = Arc::new(d.with_members(&[]).into_owned());
    let mut keys = keys;
    keys.set("ci-1", None);
    let c2 = trellis_core::compile(&without, &keys, &Default::default(), Some(c)).unwrap();
    assert!(!c2.nodes.contains_key("ci-1"));
    assert!(!wg(&c2, "web-1").contains(&key(3).to_string()));
    let nft = c2.nodes["web-1"].files.iter().find(|f| f.path.ends_with("nftables.conf")).unwrap().content.to_string();
    assert!(!nft.contains(&ci1), "{nft}");
}

#[test]
fn pinned_member_addresses_are_kept() {
    let d = valid(&mesh(), &[("ping.toml", PING), ("web.toml", WEB)]);
    let m = Member { address_ipv4: Some("10.88.0.77".parse().unwrap()), ..member("ci-1") };
    let full = d.with_members(&[m]);
    let a = trellis_core::allocate(&full, &Default::default()).unwrap();
    assert_eq!(a.ipv4["ci-1"].to_string(), "10.88.0.77");
}

#[test]
fn pool_tables_are_checked() {
    let mesh = format!(
        "{HEAD}[networks]\ninternet = {{}}\n\
         [[node]]\nname = \"ci-3\"\n\
         [[pool]]\nname = \"ci\"\nsize = 0\nnetworks = [\"lan\"]\ngroups = [\"ops\"]\nmodules = [\"pg\"]\nephemeral_after = \"10 minutes\"\ncolour = \"red\"\n\
         [[pool]]\nname = \"CI\"\nsize = 2\n\
         [[pool]]\nname = \"ci\"\nsize = 1\nephemeral_after = \"0s\"\n\
         [[pool]]\nname = \"big\"\n"
    );
    check(
        &mesh,
        &[],
        &[
            "mesh.toml:11:8: error: pool `size` 0 must be from 1 to 65535",
            "mesh.toml:15:19: error: pool `ephemeral_after` \"10 minutes\" is not a duration such as \"30s\", \"10m\", \"1h\" or \"1d\"",
            "mesh.toml:16:1: error: unknown key `colour` in [[pool]]; allowed keys: name, size, networks, groups, modules, ephemeral_after",
            "mesh.toml:17:1: error: pool name \"CI\" must be a DNS label: 1-63 of a-z, 0-9 and '-', not starting or ending with '-'",
            "mesh.toml:23:19: error: pool `ephemeral_after` \"0s\" is not a duration such as \"30s\", \"10m\", \"1h\" or \"1d\"",
            "mesh.toml:24:1: error: [[pool]] is missing the required key `size`",
        ],
    );
}

#[test]
fn pool_references_and_names_are_checked() {
    let mesh = format!(
        "{HEAD}[networks]\ninternet = {{}}\n\
         [[node]]\nname = \"ci-3\"\n\
         [[node]]\nname = \"ci-x\"\n\
         [[pool]]\nname = \"ci\"\nsize = 4\nnetworks = [\"lan\"]\ngroups = [\"ops\"]\nmodules = [\"pg\"]\n\
         [[pool]]\nname = \"CI\"\nsize = 2\n\
         [[pool]]\nname = \"ci\"\nsize = 1\n\
         [[pool]]\nname = \"{}\"\nsize = 100\n",
        "a".repeat(61)
    );
    let module = "[module]\nname = \"ci-7\"\n[[allow]]\nproto = \"icmp\"\nfrom = [\"pool:ci\", \"pool:cd\"]\n";
    check(
        &mesh,
        &[("m.toml", module)],
        &[
            "mesh.toml:7:1: error: node `ci-3` is named like a member of pool `ci` (declared at mesh.toml:11:1), which the controller names `ci-1`, `ci-2`, ...; rename one of them",
            "mesh.toml:14:13: error: pool `ci` sits on network `lan`, which is not declared in [networks] (declared: internet)",
            "mesh.toml:15:11: error: pool `ci` names group `ops`, which is not declared in [groups] (none are declared)",
            "mesh.toml:16:12: error: pool `ci` runs module `pg`, which has no manifest in modules/ (declared: ci-7)",
            "mesh.toml:17:1: error: pool name \"CI\" must be a DNS label: 1-63 of a-z, 0-9 and '-', not starting or ending with '-'",
            "mesh.toml:20:1: error: duplicate pool `ci`: already declared at mesh.toml:11:1",
            "mesh.toml:23:1: error: pool `aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa` would name a member `aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-100`, longer than a DNS label (63); use a shorter name",
            "modules/m.toml:1:1: error: module `ci-7` is named like a member of pool `ci` (declared at mesh.toml:11:1), which the controller names `ci-1`, `ci-2`, ...; rename one of them",
            "modules/m.toml:5:20: error: rule of module `ci-7` names source `pool:cd`, but no pool `cd` is declared (declared: CI, aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa, ci)",
        ],
    );
}

#[test]
fn the_overlay_must_have_room_for_every_member_a_pool_may_hold() {
    // A /24 holds 254: two nodes and 252 members fit; 253 do not.
    let fits = mesh().replace("size = 3", "size = 252");
    check(&fits, &[("ping.toml", PING), ("web.toml", WEB)], &[]);
    let full = mesh().replace("size = 3", "size = 253");
    check(
        &full,
        &[("ping.toml", PING), ("web.toml", WEB)],
        &["mesh.toml:1:1: error: `overlay_ipv4` 10.88.0.0/24 holds 254 usable addresses, but 2 nodes and pools of up to 253 members may need 255; use a larger pool or smaller sizes"],
    );
}

#[test]
fn durations_need_a_unit_and_a_positive_count() {
    assert_eq!(duration_secs("30s"), Some(30));
    assert_eq!(duration_secs("10m"), Some(600));
    assert_eq!(duration_secs("1h"), Some(3600));
    assert_eq!(duration_secs("2d"), Some(172_800));
    for bad in ["", "10", "m", "0m", "-1m", "1.5h", "10 m", "1w", "99999999999999999999d"] {
        assert_eq!(duration_secs(bad), None, "{bad:?}");
    }
}

#[test]
fn members_are_numbered_from_the_lowest_free() {
    let d = valid(&mesh(), &[("ping.toml", PING), ("web.toml", WEB)]);
    let p = d.pool("ci").unwrap();
    assert_eq!(p.lowest_free([]), Some(1));
    assert_eq!(p.lowest_free([1, 3]), Some(2));
    assert_eq!(p.lowest_free([2, 1, 9]), Some(3));
    assert_eq!(p.lowest_free([1, 2, 3]), None, "size 3: full");
    assert_eq!(p.number_of("ci-12"), Some(12));
    for not in ["ci", "ci-", "ci-01", "ci-1a", "cd-1", "ci-1-2", "ci-0x1"] {
        assert_eq!(p.number_of(not), None, "{not}");
    }
}

//! Revocations followed to the data plane (ADR 0022), with the evidence agents send: a revoked
//! node is `revoking` until every node that held its key reported applying a version without it,
//! then `revoked`, with the completion audited once; a holder that never applies keeps it
//! `revoking` and is named, with why; a holder revoked too, or no longer declared, no longer
//! counts.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use base64::Engine;
use trellis_controller::{Controller, NodeIdentity};
use trellis_proto::{self as proto, AuditAction, EvidenceResult, NodeState};
use trellis_testing::controller::{Fixture, T0};

/// A mesh of these nodes on one LAN, each answering ping from the whole mesh: every node peers
/// with every other.
fn mesh(names: &[&str]) -> Vec<proto::DeclFile> {
    let mut mesh = String::from("[mesh]\nname = \"rev\"\ndomain = \"rev.mesh\"\noverlay_ipv4 = \"10.91.0.0/16\"\n\n[networks]\nlan = {}\n");
    for (i, n) in names.iter().enumerate() {
        mesh.push_str(&format!(
            "\n[[node]]\nname = \"{n}\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]\n[[node.endpoint]]\naddress = \"192.0.2.{}:51820\"\nreachable_from = [\"lan\"]\n",
            i + 1
        ));
    }
    let ping = "[module]\nname = \"ping\"\n\n[[allow]]\nproto = \"icmp\"\nfrom = [\"mesh\"]\n";
    vec![proto::DeclFile { path: "mesh.toml".into(), text: mesh }, proto::DeclFile { path: "modules/ping.toml".into(), text: ping.into() }]
}

const NODES: [&str; 4] = ["gone-1", "peer-1", "peer-2", "peer-3"];

/// An enrolled node as its agent is: its identity, the evidence sequence number it is at, and
/// whether it manages no WireGuard interface (`--wireguard none`, `--files-only`).
struct Agent {
    who: NodeIdentity,
    seq: i64,
    unmanaged: bool,
}

impl Agent {
    /// Reports applying (or failing to apply) `version`.
    async fn report(&mut self, c: &Controller, version: i64, result: EvidenceResult, error: Option<&str>) {
        self.seq += 1;
        let record = proto::Evidence {
            seq: self.seq,
            version,
            result,
            error: error.map(String::from),
            files: vec![],
            at: T0,
            unmanaged: self.unmanaged,
        };
        c.evidence(&self.who, &proto::EvidenceBatch { records: vec![record] }).await.unwrap();
    }

    /// Reports applying the version it is given now.
    async fn applies(&mut self, c: &Controller) -> i64 {
        let v = c.bundle(&self.who.name).unwrap().version;
        self.report(c, v, EvidenceResult::Applied, None).await;
        v
    }
}

/// The fixture with `mesh(NODES)` applied, every node enrolled, published, and applying its
/// bundle.
async fn enrolled(db: trellis_testing::Database) -> (Fixture, Vec<Agent>) {
    let fx = trellis_testing::controller::controller(db).await;
    let c = &fx.c;
    c.apply(&mesh(&NODES), Some(0)).await.unwrap();
    let agents = enrol_all(c, &NODES).await;
    (fx, agents)
}

async fn state(c: &Controller, name: &str) -> (NodeState, Option<proto::Revocation>) {
    let n = c.nodes().await.unwrap().into_iter().find(|n| n.name == name).unwrap();
    (n.state, n.revocation)
}

fn holding(r: &proto::Revocation) -> Vec<&str> {
    r.holding.iter().map(|h| h.name.as_str()).collect()
}

fn completions(audit: &[proto::AuditRecord], node: &str) -> usize {
    audit.iter().filter(|r| r.action == AuditAction::RevocationCompleted.as_str() && r.subject == node).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_node_is_revoking_until_the_last_of_its_peers_applied_a_bundle_without_its_key() {
    for db in trellis_testing::databases().await {
        let (fx, mut agents) = enrolled(db.clone()).await;
        let c = &fx.c;
        let before: Vec<i64> = agents[1..].iter().map(|a| c.bundle(&a.who.name).unwrap().version).collect();
        fx.clock.0.store(T0 + 10, Ordering::SeqCst);
        c.revoke("gone-1").await.unwrap();
        // Its certificate is refused at once; its peers still hold its key.
        let (s, r) = state(c, "gone-1").await;
        let r = r.unwrap();
        assert_eq!((s, r.holders_known, r.decided_at), (NodeState::Revoking, false, T0 + 10), "{db}: {r:?}");
        assert!(r.summary(T0 + 12).contains("has not run yet"), "{}", r.summary(T0 + 12));

        c.publish().await.unwrap();
        let (s, r) = state(c, "gone-1").await;
        let r = r.unwrap();
        assert_eq!(s, NodeState::Revoking);
        assert_eq!((r.holders_known, r.holders), (true, 3), "{db}: {r:?}");
        assert_eq!(holding(&r), ["peer-1", "peer-2", "peer-3"]);
        for (h, old) in r.holding.iter().zip(&before) {
            let now = c.bundle(&h.name).unwrap().version;
            assert!(now > *old, "{}'s bundle dropped the key in a new version", h.name);
            assert_eq!((h.dropped_in, h.applied_version), (Some(now), Some(*old)), "{db}: {h:?}");
        }

        fx.clock.0.store(T0 + 14, Ordering::SeqCst);
        agents[1].applies(c).await;
        agents[2].applies(c).await;
        let (s, r) = state(c, "gone-1").await;
        let r = r.unwrap();
        assert_eq!((s, holding(&r)), (NodeState::Revoking, vec!["peer-3"]), "{db}");
        let said = r.summary(T0 + 15);
        let v = c.bundle("peer-3").unwrap().version;
        assert!(said.contains(&format!("1 of 3 peer(s) still hold its key: peer-3 applied v{} < v{v}", before[2])), "{said}");
        assert_eq!(c.settle_revocations().await.unwrap(), 0, "nothing to complete yet");
        let status = c.status().await.unwrap();
        assert_eq!(status.iter().find(|n| n.name == "gone-1").unwrap().state, NodeState::Revoking, "status agrees with the roster");
        let scraped = c.scrape().await;
        assert!(scraped.lines().any(|l| l == "trellis_revocations_in_progress 1"), "{scraped}");
        assert!(scraped.lines().any(|l| l == "trellis_revocation_oldest_age_seconds 4"), "{scraped}");

        fx.clock.0.store(T0 + 17, Ordering::SeqCst);
        agents[3].applies(c).await;
        let (s, r) = state(c, "gone-1").await;
        let r = r.unwrap();
        assert_eq!((s, r.completed_at, r.seconds, r.holders), (NodeState::Revoked, Some(T0 + 17), 7, 3), "{db}: {r:?}");
        assert_eq!(c.revocation("gone-1").await.unwrap(), r, "the one node's revocation is the roster's");
        // The completion is audited once, by whichever look sees it first.
        assert_eq!(completions(&c.audit().await.unwrap(), "gone-1"), 0);
        fx.clock.0.store(T0 + 30, Ordering::SeqCst);
        assert_eq!(c.settle_revocations().await.unwrap(), 1);
        assert_eq!(c.settle_revocations().await.unwrap(), 0);
        c.publish().await.unwrap();
        let audit = c.audit().await.unwrap();
        assert_eq!(completions(&audit, "gone-1"), 1, "{db}");
        let done = audit.iter().find(|r| r.action == AuditAction::RevocationCompleted.as_str()).unwrap();
        assert_eq!(done.at, T0 + 30);
        assert!(done.detail.contains("3 holder(s), 7 s after the decision"), "{}", done.detail);
        assert_eq!(trellis_proto::audit::verify(&audit), Ok(audit.len()));
        // Recorded, it reads the same (from the stored completion).
        let (s, r) = state(c, "gone-1").await;
        assert_eq!((s, r.unwrap().seconds), (NodeState::Revoked, 7));
        let scraped = c.scrape().await;
        assert!(scraped.lines().any(|l| l == "trellis_revocations_in_progress 0"), "{scraped}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_applies_keeps_it_revoking_and_is_named_with_why() {
    for db in trellis_testing::databases().await {
        let (fx, mut agents) = enrolled(db.clone()).await;
        let c = &fx.c;
        let old = c.bundle("peer-2").unwrap().version;
        c.revoke("gone-1").await.unwrap();
        c.publish().await.unwrap();
        agents[1].applies(c).await;
        agents[3].applies(c).await;
        let new = c.bundle("peer-2").unwrap().version;
        agents[2].report(c, new, EvidenceResult::Failed, Some("nft: syntax error in line 3")).await;
        fx.clock.0.store(T0 + 3 * 3600, Ordering::SeqCst);
        c.publish().await.unwrap();
        assert_eq!(c.settle_revocations().await.unwrap(), 0);
        let r = c.revocation("gone-1").await.unwrap();
        assert_eq!(holding(&r), ["peer-2"], "{db}: {r:?}");
        let h = &r.holding[0];
        assert_eq!((h.applied_version, h.dropped_in), (Some(old), Some(new)));
        assert_eq!(h.last_error.as_deref(), Some("nft: syntax error in line 3"));
        assert_eq!(r.seconds, 3 * 3600, "revoking for as long as the clock says");
        let said = r.summary(T0 + 3 * 3600);
        assert!(
            said.contains(&format!(
                "1 of 3 peer(s) still hold its key: peer-2 applied v{old} < v{new}, offline 3 h, failing: nft: syntax error in line 3"
            )),
            "{said}"
        );
        assert_eq!(state(c, "gone-1").await.0, NodeState::Revoking);
        assert_eq!(completions(&c.audit().await.unwrap(), "gone-1"), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_revoked_too_or_no_longer_declared_no_longer_counts() {
    for db in trellis_testing::databases().await {
        let (fx, mut agents) = enrolled(db.clone()).await;
        let c = &fx.c;
        c.revoke("gone-1").await.unwrap();
        c.publish().await.unwrap();
        agents[1].applies(c).await;
        assert_eq!(holding(&c.revocation("gone-1").await.unwrap()), ["peer-2", "peer-3"]);

        // peer-3 is revoked too: it no longer counts as gone-1's holder, and is revoking itself,
        // held by the two peers left (gone-1 was out of their bundles already).
        c.revoke("peer-3").await.unwrap();
        assert_eq!(holding(&c.revocation("gone-1").await.unwrap()), ["peer-2"], "{db}");
        c.publish().await.unwrap();
        let r = c.revocation("peer-3").await.unwrap();
        assert_eq!((r.holders, holding(&r)), (2, vec!["peer-1", "peer-2"]), "{db}: {r:?}");

        // peer-2 is no longer declared: nothing holds gone-1's key any more that counts.
        c.apply(&mesh(&["gone-1", "peer-1", "peer-3"]), None).await.unwrap();
        c.publish().await.unwrap();
        let (s, r) = state(c, "gone-1").await;
        assert_eq!((s, r.unwrap().holders), (NodeState::Revoked, 1), "{db}: only peer-1 still counts, and it applied");
        assert_eq!(completions(&c.audit().await.unwrap(), "gone-1"), 1, "the publish run recorded the completion");
        // peer-3's revocation waits for peer-1 only.
        let r = c.revocation("peer-3").await.unwrap();
        assert_eq!((r.holders, holding(&r)), (1, vec!["peer-1"]), "{r:?}");
        agents[1].applies(c).await;
        assert!(c.revocation("peer-3").await.unwrap().complete());
        assert_eq!(c.settle_revocations().await.unwrap(), 1);
    }
}

/// A node revoked while pending was never given to a peer: it is revoked at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_revoked_before_it_took_part_is_revoked_at_once() {
    for db in trellis_testing::databases().await {
        let fx = trellis_testing::controller::controller(db.clone()).await;
        let c = Arc::new(fx.c);
        c.apply(&mesh(&NODES), Some(0)).await.unwrap();
        let t = c
            .create_token(&proto::TokenRequest { node: "gone-1".into(), ttl_secs: 600, require_approval: true, ..Default::default() })
            .await
            .unwrap();
        let token = trellis_core::token::EnrolmentToken::decode(&t.token).unwrap();
        let (req, _) = trellis_testing::controller::enrol_request(&token, trellis_testing::controller::wireguard_key(9));
        c.enrol(req).await.unwrap();
        c.revoke("gone-1").await.unwrap();
        let (s, r) = state(&c, "gone-1").await;
        let r = r.unwrap();
        assert_eq!((s, r.holders, r.seconds), (NodeState::Revoked, 0, 0), "{db}: {r:?}");
    }
}

/// Two replicas on one database: the state is computed from the records and the evidence, so
/// the other replica, which published nothing and received no evidence, says the same; and the
/// completion is audited once, by whichever looks first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_on_one_database_say_the_same_and_audit_the_completion_once() {
    for db in trellis_testing::databases().await {
        let (fx, mut agents) = enrolled(db.clone()).await;
        let (a, b) = (&fx.c, &trellis_testing::controller::controller(db.clone()).await.c);
        a.revoke("gone-1").await.unwrap();
        a.publish().await.unwrap();
        agents[1].applies(a).await;
        agents[2].applies(a).await;
        let here = a.revocation("gone-1").await.unwrap();
        assert_eq!(holding(&here), ["peer-3"], "{db}");
        assert_eq!(b.revocation("gone-1").await.unwrap(), here, "{db}: the other replica says the same");
        assert_eq!(state(b, "gone-1").await.0, NodeState::Revoking);
        agents[3].applies(a).await;
        assert!(b.revocation("gone-1").await.unwrap().complete(), "{db}");
        assert_eq!(b.settle_revocations().await.unwrap(), 1, "the other replica looks first");
        assert_eq!(a.settle_revocations().await.unwrap(), 0, "{db}: recorded once");
        assert_eq!(completions(&a.audit().await.unwrap(), "gone-1"), 1);
        assert_eq!(state(a, "gone-1").await, state(b, "gone-1").await);
    }
}

/// gw-1 and gw-2 on a LAN with two laptops of the ops group, which may print on an office LAN
/// reached through the routers of `via` (the first is the one chosen).
fn routed(via: &[&str]) -> Vec<proto::DeclFile> {
    let mut files = mesh(&["gw-1", "gw-2", "laptop-1", "laptop-2"]);
    let via: Vec<String> = via.iter().map(|v| format!("\"{v}\"")).collect();
    files[0].text = files[0].text.replace("[networks]", "[groups]\nops = [\"laptop-1\", \"laptop-2\"]\n\n[networks]");
    files[0].text.push_str(&format!(
        "\n[[route]]\nname = \"office\"\nprefixes = [\"192.168.10.0/24\"]\nvia = [{}]\n  [[route.allow]]\n  proto = \"tcp\"\n  ports = [\"631\"]\n  from = [\"group:ops\"]\n",
        via.join(", ")
    ));
    files
}

/// Enrols every node of `names` (the declaration applied already), publishes, and has each
/// apply its bundle.
async fn enrol_all(c: &Controller, names: &[&str]) -> Vec<Agent> {
    let mut agents = Vec::new();
    for (i, node) in names.iter().enumerate() {
        let t = c
            .create_token(&proto::TokenRequest { node: node.to_string(), ttl_secs: 600, require_approval: false, ..Default::default() })
            .await
            .unwrap();
        let token = trellis_core::token::EnrolmentToken::decode(&t.token).unwrap();
        let key = base64::engine::general_purpose::STANDARD.encode([i as u8 + 1; 32]);
        let (req, _) = trellis_testing::controller::enrol_request(&token, key);
        let enrolled = c.enrol(req).await.unwrap();
        let der = trellis_pki::pem_to_der(&enrolled.node_cert_pem, "CERTIFICATE").unwrap();
        agents.push(Agent { who: c.authenticate_node(Some(&der)).await.unwrap(), seq: 0, unmanaged: false });
    }
    c.publish().await.unwrap();
    for a in &mut agents {
        a.applies(c).await;
    }
    agents
}

/// A router removed from a route (ADR 0022): gw-1 stays in the mesh, but the laptops that sent
/// the office's traffic through it are to send it to gw-2. gw-1 is "withdrawing routes" until
/// both applied a bundle that does; a laptop that never applies keeps it so, named; the
/// completion is audited once. An apply that changes no route opens nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_removed_from_a_route_is_followed_until_every_node_that_sent_through_it_applied() {
    for db in trellis_testing::databases().await {
        let fx = trellis_testing::controller::controller(db.clone()).await;
        let c = &fx.c;
        c.apply(&routed(&["gw-1", "gw-2"]), Some(0)).await.unwrap();
        let names = ["gw-1", "gw-2", "laptop-1", "laptop-2"];
        let mut agents = enrol_all(c, &names).await;
        let office_via = |node: &str| {
            let conf = c.bundle(node).unwrap().signed.to_vec();
            let text = String::from_utf8_lossy(&conf).to_string();
            // The peer whose section routes the prefix: named in the comment before its `[Peer]`.
            let before = &text[..text.find("AllowedIPs = 192.168.10.0/24")?];
            let head = &before[..before.rfind("[Peer]")?];
            head.trim_end().lines().last()?.strip_prefix("# ")?.split(':').next().map(str::to_string)
        };
        assert_eq!(office_via("laptop-1").as_deref(), Some("gw-1"), "{db}: the first router is chosen");

        // The same declaration again changes no route: nothing to follow.
        c.apply(&routed(&["gw-1", "gw-2"]), None).await.unwrap();
        c.publish().await.unwrap();
        assert!(state(c, "gw-1").await.1.is_none(), "{db}");

        fx.clock.0.store(T0 + 10, Ordering::SeqCst);
        c.apply(&routed(&["gw-2"]), None).await.unwrap();
        c.publish().await.unwrap();
        let (s, r) = state(c, "gw-1").await;
        let r = r.unwrap_or_else(|| panic!("{db}: gw-1's routes are not followed"));
        assert_eq!(s, NodeState::Active, "{db}: gw-1 stays in the mesh");
        assert_eq!((r.kind, r.holders_known, r.decided_at), (proto::Withdrawal::Routes, true, T0 + 10), "{db}: {r:?}");
        assert_eq!(holding(&r), ["laptop-1", "laptop-2"], "{db}");
        for h in &r.holding {
            assert_eq!(h.dropped_in, Some(c.bundle(&h.name).unwrap().version), "{db}: {h:?}");
        }
        assert_eq!(office_via("laptop-1").as_deref(), Some("gw-2"));
        assert!(state(c, "gw-2").await.1.is_none(), "{db}: gw-2 took the route, it withdrew nothing");

        agents[2].applies(c).await;
        let (_, r) = state(c, "gw-1").await;
        let r = r.unwrap();
        let said = r.summary(T0 + 12);
        assert!(said.starts_with("withdrawing routes (for "), "{said}");
        assert!(said.contains("1 of 2 peer(s) still route through it: laptop-2 applied v"), "{said}");
        assert_eq!(c.settle_revocations().await.unwrap(), 0);

        fx.clock.0.store(T0 + 15, Ordering::SeqCst);
        agents[3].applies(c).await;
        let (s, r) = state(c, "gw-1").await;
        let r = r.unwrap();
        assert_eq!((s, r.completed_at, r.seconds, r.holders), (NodeState::Active, Some(T0 + 15), 5, 2), "{db}: {r:?}");
        assert_eq!(r.summary(T0 + 20), "routes withdrawn (in 5 s, 2 peer(s) stopped routing through it)");
        assert_eq!(c.settle_revocations().await.unwrap(), 1);
        assert_eq!(c.settle_revocations().await.unwrap(), 0);
        c.publish().await.unwrap();
        let audit = c.audit().await.unwrap();
        let done: Vec<_> = audit.iter().filter(|a| a.action == AuditAction::RoutesWithdrawn.as_str()).collect();
        assert_eq!(done.len(), 1, "{db}");
        assert_eq!(done[0].subject, "gw-1");
        assert!(done[0].detail.contains("2 holder(s), 5 s after the decision"), "{}", done[0].detail);
        assert_eq!(trellis_proto::audit::verify(&audit), Ok(audit.len()));
        // No revocation is said: gw-1 is no node revoking.
        let listed = c.nodes().await.unwrap();
        assert!(listed.iter().all(|n| n.state != NodeState::Revoking && n.state != NodeState::Removing), "{db}");
    }
}

/// hub-1 on the internet and a data centre relays between laptop-1 (internet) and db-1 (dc,
/// reachable only there); `hub` is the declaration's `hub = ...` of hub-1.
fn relayed(hub: bool) -> Vec<proto::DeclFile> {
    let mesh = format!(
        "[mesh]\nname = \"rev\"\ndomain = \"rev.mesh\"\noverlay_ipv4 = \"10.91.0.0/16\"\n\n[networks]\ninternet = {{}}\ndc = {{}}\n\n\
         [[node]]\nname = \"hub-1\"\nhub = {hub}\nnetworks = [\"internet\", \"dc\"]\nmodules = [\"ping\"]\n\
         [[node.endpoint]]\naddress = \"198.51.100.10:51820\"\nreachable_from = [\"internet\"]\n\
         [[node.endpoint]]\naddress = \"10.20.0.5:51820\"\nreachable_from = [\"dc\"]\n\n\
         [[node]]\nname = \"db-1\"\nnetworks = [\"dc\"]\nmodules = [\"ping\"]\n[[node.endpoint]]\naddress = \"10.20.0.10:51820\"\nreachable_from = [\"dc\"]\n\n\
         [[node]]\nname = \"laptop-1\"\nnetworks = [\"internet\"]\nmodules = [\"ping\"]\n"
    );
    let ping = "[module]\nname = \"ping\"\n\n[[allow]]\nproto = \"icmp\"\nfrom = [\"mesh\"]\n";
    vec![proto::DeclFile { path: "mesh.toml".into(), text: mesh }, proto::DeclFile { path: "modules/ping.toml".into(), text: ping.into() }]
}

/// A hub that is no longer one: laptop-1 and db-1 sent each other's traffic through hub-1;
/// without the hub they have no path, and hub-1 is "withdrawing routes" until both applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hub_no_longer_a_hub_is_followed_until_the_nodes_it_relayed_for_applied() {
    for db in trellis_testing::databases().await {
        let fx = trellis_testing::controller::controller(db.clone()).await;
        let c = &fx.c;
        c.apply(&relayed(true), Some(0)).await.unwrap();
        let mut agents = enrol_all(c, &["hub-1", "db-1", "laptop-1"]).await;
        c.apply(&relayed(false), None).await.unwrap();
        c.publish().await.unwrap();
        let (s, r) = state(c, "hub-1").await;
        let r = r.unwrap_or_else(|| panic!("{db}: the hub's relaying is not followed"));
        assert_eq!((s, r.kind), (NodeState::Active, proto::Withdrawal::Routes), "{db}");
        assert_eq!(holding(&r), ["db-1", "laptop-1"], "{db}");
        agents[1].applies(c).await;
        agents[2].applies(c).await;
        let r = state(c, "hub-1").await.1.unwrap();
        assert!(r.complete(), "{db}: {r:?}");
        assert_eq!(c.settle_revocations().await.unwrap(), 1);
    }
}

/// The review of 2026-12-02, finding 11: a holder whose agent manages no WireGuard interface
/// reported `applied` like any other, and the revocation read as if its data plane had dropped
/// the key. It still counts (it applied what it was given), but it is named as unverified in
/// the roster's sentence and in the completion's audit record, which says what the holders
/// reported, not what they did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_manages_no_interface_is_named_unverified() {
    for db in trellis_testing::databases().await {
        let (fx, mut agents) = enrolled(db.clone()).await;
        let c = &fx.c;
        agents[2].unmanaged = true;
        c.revoke("gone-1").await.unwrap();
        c.publish().await.unwrap();
        for a in &mut agents[1..] {
            a.applies(c).await;
        }
        let (s, r) = state(c, "gone-1").await;
        let r = r.unwrap();
        assert_eq!((s, r.unverified.clone()), (NodeState::Revoked, vec!["peer-2".to_string()]), "{db}: {r:?}");
        assert!(
            r.summary(T0).ends_with("3 peer(s) dropped its key; unverified, managing no WireGuard interface: peer-2)"),
            "{}",
            r.summary(T0)
        );
        assert_eq!(c.settle_revocations().await.unwrap(), 1);
        let audit = c.audit().await.unwrap();
        let done = audit.iter().find(|r| r.action == AuditAction::RevocationCompleted.as_str()).unwrap();
        assert!(
            done.detail.starts_with("every node that held its key reported applying a bundle without it: 3 holder(s)"),
            "{}",
            done.detail
        );
        assert!(
            done.detail
                .ends_with("; 1 of them (peer-2) manage no WireGuard interface, so nothing verifies that their data plane dropped it"),
            "{}",
            done.detail
        );
        // Recorded, it still says so.
        let (_, r) = state(c, "gone-1").await;
        assert_eq!(r.unwrap().unverified, ["peer-2"], "{db}");
    }
}

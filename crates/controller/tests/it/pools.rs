//! Pools of short-lived nodes, on SQLite and PostgreSQL: a reusable token enrols exactly `uses`
//! members under any concurrency, each named by the controller; members are in their peers'
//! bundles per policy, listed with their pool, and removed (audited) once out of contact.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use trellis_controller::{Controller, Error, Redemption};
use trellis_proto::{self as proto, AuditAction, NodeState, TokenState};
use trellis_testing::Database;

use super::{controller, enrol_request, x25519_public, Fixture, T0};

/// The files of `lab/pool`, each passed through `edit` (given its path and text).
fn lab_pool(edit: impl Fn(&str, String) -> String) -> Vec<proto::DeclFile> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lab/pool");
    ["mesh.toml", "modules/http.toml", "modules/ping.toml", "modules/postgres.toml"]
        .iter()
        .map(|p| proto::DeclFile { path: p.to_string(), text: edit(p, std::fs::read_to_string(dir.join(p)).unwrap()) })
        .collect()
}

/// `lab/pool` without its pool (and the rules naming it or its group), `node` declared in its
/// place.
fn lab_pool_without_pool(node: &str) -> Vec<proto::DeclFile> {
    lab_pool(|path, text| match path {
        "mesh.toml" => text.split("[[pool]]").next().unwrap().to_string() + node + text.split("ephemeral_after = \"5s\"\n").nth(1).unwrap(),
        _ => text.replace("group:runners", "node:web-1").replace("\"pool:ci\", ", ""),
    })
}

/// The basic fixture, then `lab/pool` applied over it (web-1, db-1 and the pool `ci` of 4).
async fn pool_fixture(url: Database) -> Fixture {
    let fx = controller(url).await;
    fx.c.apply(&lab_pool(|_, t| t), None).await.unwrap();
    fx
}

async fn on_both<F, Fut>(f: F)
where
    F: Fn(Fixture) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for url in trellis_testing::databases().await {
        // A clone kept here: a test that moves `fx.c` out drops the rest of the fixture at once.
        f(pool_fixture(url.clone()).await).await;
    }
}

async fn pool_token(c: &Controller, uses: u32) -> proto::TokenCreated {
    c.create_token(&proto::TokenRequest { ttl_secs: 600, pool: Some("ci".into()), uses: Some(uses), ..Default::default() }).await.unwrap()
}

/// A redemption of `token` with its own keys (`seed` makes the WireGuard key).
fn member_request(token: &str, seed: u8) -> proto::EnrolRequest {
    let (mut req, _) = enrol_request(token);
    req.wireguard_public_key = x25519_public(seed);
    req
}

fn bundle_text(c: &Controller, node: &str) -> String {
    let p = c.bundle(node).unwrap_or_else(|| panic!("{node} has no bundle"));
    String::from_utf8_lossy(&p.signed.to_vec()).into_owned()
}

/// Twice as many redemptions as the token allows, at once: exactly `uses` members, named
/// `ci-1` .. `ci-uses` (the lowest free numbers), each audited; the rest are refused as used.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_token_enrols_exactly_uses_members_under_concurrency() {
    on_both(|fx| async move {
        let c = Arc::new(fx.c);
        let t = pool_token(&c, 3).await;
        assert_eq!((t.node.as_str(), t.pool.as_deref(), t.uses), ("ci", Some("ci"), 3));
        let tasks: Vec<_> = (0..6u8)
            .map(|i| {
                let (c, req) = (c.clone(), member_request(&t.token, 10 + i));
                tokio::spawn(async move { c.enrol(req).await })
            })
            .collect();
        let mut names = BTreeSet::new();
        let mut refused = 0;
        for task in tasks {
            match task.await.unwrap() {
                Ok(r) => assert!(names.insert(r.node.clone()), "{} given twice", r.node),
                Err(Error::Redemption(Redemption::Used)) => refused += 1,
                Err(e) => panic!("{:?}: unexpected refusal: {e}", c.store().backend),
            }
        }
        let want: BTreeSet<String> = ["ci-1", "ci-2", "ci-3"].into_iter().map(String::from).collect();
        assert_eq!((names, refused), (want, 3), "{:?}", c.store().backend);
        let info = c.tokens().await.unwrap().into_iter().find(|i| i.id == t.id).unwrap();
        assert_eq!((info.state, info.used, info.uses), (TokenState::Used, 3, 3));
        let audit = c.audit().await.unwrap();
        let enrolled: BTreeSet<&str> = audit
            .iter()
            .filter(|r| r.action == AuditAction::NodeEnrolled.as_str() && r.detail.contains("pool ci"))
            .map(|r| r.subject.as_str())
            .collect();
        assert_eq!(enrolled, ["ci-1", "ci-2", "ci-3"].into_iter().collect());
    })
    .await;
}

/// The pool's size holds across tokens; a freed number is the next one given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_take_the_lowest_free_number_up_to_the_pools_size() {
    on_both(|fx| async move {
        let c = &fx.c;
        let t = pool_token(c, 10).await;
        for (i, want) in ["ci-1", "ci-2", "ci-3", "ci-4"].iter().enumerate() {
            assert_eq!(c.enrol(member_request(&t.token, 20 + i as u8)).await.unwrap().node, *want);
        }
        let other = pool_token(c, 10).await;
        let full = c.enrol(member_request(&other.token, 30)).await;
        assert!(matches!(full, Err(Error::Redemption(Redemption::PoolFull { ref pool, size: 4 })) if pool == "ci"), "{full:?}");
        assert_eq!(
            full.unwrap_err().to_string(),
            "pool `ci` holds 4 members already, its size; wait for one to be removed or raise `size`"
        );
        // ci-2 stops; past ephemeral_after (5 s) and the slack, it is removed, and its number is
        // the next one given.
        fx.clock.0.store(T0 + 10, std::sync::atomic::Ordering::SeqCst);
        c.store().touch_all(&[("ci-1".into(), T0 + 10), ("ci-3".into(), T0 + 10), ("ci-4".into(), T0 + 10)]).await.unwrap();
        fx.clock.0.store(T0 + 10 + 5 + trellis_controller::pools::SWEEP_SLACK, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(c.sweep_members().await.unwrap(), vec!["ci-2".to_string()]);
        assert_eq!(c.enrol(member_request(&other.token, 31)).await.unwrap().node, "ci-2");
        let used = c.tokens().await.unwrap().iter().map(|i| i.used).sum::<i64>();
        assert_eq!(used, 5, "the refusal used nothing");
    })
    .await;
}

/// A member is a node of the compiled mesh: peers per policy (pool:ci and group:runners admit
/// it; postgres does not), listed with its pool; out of contact, it is removed (audited) and its
/// peers' bundles drop it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_are_published_listed_and_removed_after_ephemeral_after() {
    on_both(|fx| async move {
        let c = &fx.c;
        let node_token = |n: &str| proto::TokenRequest { node: n.into(), ttl_secs: 600, require_approval: false, ..Default::default() };
        let mut peers = Vec::new();
        for (i, n) in ["web-1", "db-1"].iter().enumerate() {
            let t = c.create_token(&node_token(n)).await.unwrap();
            let enrolled = c.enrol(member_request(&t.token, 40 + i as u8)).await.unwrap();
            let der = trellis_pki::pem_to_der(&enrolled.node_cert_pem, "CERTIFICATE").unwrap();
            peers.push(c.authenticate_node(Some(&der)).await.unwrap());
        }
        let t = pool_token(c, 5).await;
        let r = c.enrol(member_request(&t.token, 50)).await.unwrap();
        assert_eq!(r.node, "ci-1");
        assert!(trellis_pki::inspect_pem(&r.node_cert_pem).unwrap().common_name == "ci-1", "the certificate names the member");
        c.publish().await.unwrap();
        let member_key = x25519_public(50);
        assert!(bundle_text(c, "web-1").contains(&member_key), "web-1 admits ci-1 (http, ping): they peer");
        assert!(bundle_text(c, "db-1").contains(&member_key), "db-1 admits ci-1 to ping: they peer");
        // What passes: ping (pool:ci) and HTTP (group:runners) on web-1; ping only on db-1.
        let passes = |e: &proto::Explanation| e.forward.iter().map(|r| format!("{} {}", r.module, r.matched.join(","))).collect::<Vec<_>>();
        let to_web = c.explain("ci-1", "web-1").await.unwrap();
        assert_eq!(passes(&to_web), ["http group:runners (ci-1 is a member)", "ping pool:ci (ci-1 is a member)"]);
        assert_eq!(passes(&c.explain("ci-1", "db-1").await.unwrap()), ["ping pool:ci (ci-1 is a member)"]);
        assert!(bundle_text(c, "ci-1").contains("Endpoint = 192.0.2.11:51820"), "ci-1 dials web-1");

        let nodes = c.nodes().await.unwrap();
        let m = nodes.iter().find(|n| n.name == "ci-1").unwrap();
        assert_eq!((m.state, m.pool.as_deref()), (NodeState::Active, Some("ci")));
        let v4 = m.ipv4.clone().expect("a member has an overlay address");
        assert!(v4.starts_with("10.89.0."), "{v4}");
        assert!(nodes.iter().filter(|n| n.name != "ci-1").all(|n| n.pool.is_none() && n.ipv4.as_deref() != Some(v4.as_str())));

        // In contact (a long-poll open counts), it stays; out of contact, it goes.
        let at = |s: i64| fx.clock.0.store(T0 + s, std::sync::atomic::Ordering::SeqCst);
        at(100);
        {
            let _polling = (c.polling("ci-1"), c.polling("web-1"));
            c.flush_contacts().await;
        }
        let web = c.store().node("web-1").await.unwrap().unwrap();
        assert_eq!(web.last_contact, Some(T0), "only members' long-polls are written as contact");
        assert_eq!(c.store().node("ci-1").await.unwrap().unwrap().last_contact, Some(T0 + 100));
        at(100 + 5 + trellis_controller::pools::SWEEP_SLACK);
        assert!(c.sweep_members().await.unwrap().is_empty(), "last contact at +100: not yet");
        at(100 + 5 + trellis_controller::pools::SWEEP_SLACK + 1);
        assert_eq!(c.sweep_members().await.unwrap(), vec!["ci-1".to_string()]);
        assert!(c.sweep_members().await.unwrap().is_empty(), "removed once");
        c.publish().await.unwrap();
        assert!(!bundle_text(c, "web-1").contains(&member_key), "web-1 drops ci-1");
        assert!(c.bundle("ci-1").is_none());
        // Listed as removing while its peers hold its key: until each reports applying a bundle
        // without it (ADR 0022).
        let listed = c.nodes().await.unwrap().into_iter().find(|n| n.name == "ci-1").expect("listed while its peers hold its key");
        let r = listed.revocation.unwrap();
        assert_eq!((listed.state, r.kind, r.holders), (NodeState::Removing, proto::Withdrawal::Removal, 2));
        assert_eq!(r.holding.iter().map(|h| h.name.as_str()).collect::<Vec<_>>(), ["db-1", "web-1"]);
        assert!(r.summary(T0 + 200).starts_with("removing (for "), "{}", r.summary(T0 + 200));
        for who in &peers {
            let version = c.bundle(&who.name).unwrap().version;
            let applied = proto::Evidence {
                seq: 1,
                version,
                result: proto::EvidenceResult::Applied,
                error: None,
                files: vec![],
                at: T0,
                unmanaged: false,
            };
            c.evidence(who, &proto::EvidenceBatch { records: vec![applied] }).await.unwrap();
        }
        assert!(c.nodes().await.unwrap().iter().all(|n| n.name != "ci-1"), "removed: every peer dropped its key");
        assert!(c.revocation("ci-1").await.unwrap().summary(T0).starts_with("removed (in 0 s, 2 peer(s) dropped its key)"));
        assert_eq!(c.settle_revocations().await.unwrap(), 1);
        let done = c.audit().await.unwrap().into_iter().filter(|r| r.action == AuditAction::RemovalCompleted.as_str()).count();
        assert_eq!(done, 1);
        let removed: Vec<_> = c.audit().await.unwrap().into_iter().filter(|r| r.action == AuditAction::NodeRemoved.as_str()).collect();
        assert_eq!(removed.len(), 1);
        assert_eq!(removed[0].subject, "ci-1");
        assert!(removed[0].detail.contains("ephemeral_after (5 s)"), "{}", removed[0].detail);
    })
    .await;
}

/// A retry of a redemption whose answer was lost is answered again, using nothing more; a pool
/// token is refused where it does not fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_answered_again_and_bad_pool_requests_are_refused() {
    on_both(|fx| async move {
        let c = &fx.c;
        let t = pool_token(c, 2).await;
        let req = member_request(&t.token, 60);
        let first = c.enrol(req.clone()).await.unwrap();
        let again = c.enrol(req.clone()).await.unwrap();
        assert_eq!((first.node.as_str(), again.node.as_str(), again.node_cert_pem == first.node_cert_pem), ("ci-1", "ci-1", true));
        let info = c.tokens().await.unwrap().into_iter().find(|i| i.id == t.id).unwrap();
        assert_eq!(info.used, 1, "a retry uses nothing");
        let mut other = member_request(&t.token, 61);
        other.node = "ci-9".into();
        assert!(matches!(c.enrol(other).await, Err(Error::Redemption(Redemption::OtherNode { .. }))));

        let r = c.create_token(&proto::TokenRequest { ttl_secs: 60, pool: Some("cd".into()), ..Default::default() }).await;
        assert_eq!(r.unwrap_err().to_string(), "pool `cd` is not declared in revision 2; declare it as a [[pool]] and apply first");
        let r = c.create_token(&proto::TokenRequest { ttl_secs: 60, pool: Some("ci".into()), uses: Some(0), ..Default::default() }).await;
        assert!(matches!(r, Err(Error::BadRequest(_))), "{r:?}");
        let r = c.create_token(&proto::TokenRequest { node: "db-1".into(), ttl_secs: 60, uses: Some(3), ..Default::default() }).await;
        assert!(matches!(r, Err(Error::BadRequest(_))), "{r:?}");
        // A member is not a declared node: it has no token of its own.
        let r = c.create_token(&proto::TokenRequest { node: "ci-1".into(), ttl_secs: 60, ..Default::default() }).await;
        assert!(matches!(r, Err(Error::NodeNotDeclared { .. })), "{r:?}");
        // A revoked pool token enrols nobody more; its members stay.
        c.revoke_token(&t.id).await.unwrap();
        assert!(matches!(c.enrol(member_request(&t.token, 62)).await, Err(Error::Redemption(Redemption::Revoked))));
        assert!(c.store().node("ci-1").await.unwrap().is_some());
        // A revoked member is removed by the next sweep, whatever its pool's ephemeral_after.
        c.revoke("ci-1").await.unwrap();
        assert_eq!(c.sweep_members().await.unwrap(), vec!["ci-1".to_string()]);
        assert!(c.store().node("ci-1").await.unwrap().is_none());
    })
    .await;
}

/// A new revision without the pool: its members leave the compiled mesh at once, the next sweep
/// removes them (audited), and its tokens enrol nobody more. An apply stores only the declared
/// nodes' addresses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_no_longer_declared_loses_its_members() {
    on_both(|fx| async move {
        let c = &fx.c;
        let t = pool_token(c, 4).await;
        c.enrol(member_request(&t.token, 70)).await.unwrap();
        let member_v4 = c.store().node("ci-1").await.unwrap().unwrap().ipv4.unwrap();
        // The pool goes (and the rules naming it or its group), and a node is added.
        let files = lab_pool_without_pool("[[node]]\nname = \"late-1\"\nnetworks = [\"lan\"]\n");
        c.apply(&files, None).await.unwrap();
        let nodes = c.nodes().await.unwrap();
        let late = nodes.iter().find(|n| n.name == "late-1").unwrap();
        assert_ne!(late.ipv4.as_deref(), Some(member_v4.as_str()));
        let stored = c.store().allocation().await.unwrap();
        assert!(stored.ipv4.contains_key("late-1") && !stored.ipv4.contains_key("ci-1"), "an apply stores declared nodes' addresses only");
        let (_, mesh_now) = c.current_mesh().await.unwrap().unwrap();
        assert!(mesh_now.node("ci-1").is_none(), "a member of an undeclared pool is not compiled");
        let r = c.enrol(member_request(&t.token, 71)).await;
        assert!(matches!(r, Err(Error::Redemption(Redemption::PoolUndeclared { ref pool, .. })) if pool == "ci"), "{r:?}");
        assert_eq!(c.sweep_members().await.unwrap(), vec!["ci-1".to_string()]);
        let audit = c.audit().await.unwrap();
        let removed = audit.iter().find(|r| r.action == AuditAction::NodeRemoved.as_str()).unwrap();
        assert!(removed.detail.contains("which revision 3 no longer declares"), "{}", removed.detail);
    })
    .await;
}

/// The attack of a review: a node once declared as `ci-2` keeps its record after it leaves the
/// declaration; a pool `ci` added later must not choose that name at every attempt (each a CA
/// signature) until the redemption fails, but take the next free number.
#[tokio::test]
async fn a_name_held_by_another_record_is_skipped_not_retried_until_failure() {
    for url in trellis_testing::databases().await {
        let fx = controller(url).await;
        // First without the pool (its rules may not name it yet), with a node named as its
        // second member would be.
        let files = lab_pool(|path, text| match path {
            "mesh.toml" => {
                let (head, tail) = text.split_at(text.find("[[pool]]").unwrap());
                let tests = &tail[tail.find("[[test]]").unwrap()..];
                format!("{head}[[node]]\nname = \"ci-2\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]\n\n{tests}")
            }
            _ => text.replace("\"pool:ci\"", "\"mesh\""),
        });
        fx.c.apply(&files, None).await.unwrap();
        let t = fx.c.create_token(&proto::TokenRequest { node: "ci-2".into(), ttl_secs: 600, ..Default::default() }).await.unwrap();
        assert_eq!(fx.c.enrol(enrol_request(&t.token).0).await.unwrap().node, "ci-2");
        // Then the pool, and ci-2 gone from the declaration: its record stays.
        fx.c.apply(&lab_pool(|_, t| t), None).await.unwrap();
        let t = pool_token(&fx.c, 2).await;
        let first = fx.c.enrol(member_request(&t.token, 40)).await.unwrap().node;
        let second = fx.c.enrol(member_request(&t.token, 41)).await.unwrap().node;
        assert_eq!((first.as_str(), second.as_str()), ("ci-1", "ci-3"));
    }
}

/// The attack of a review: an operator pins a declared node at the address a pool member holds
/// (copied from `trellis nodes`). Both would have the address, and every rule naming the node
/// would admit the member. The apply is refused, saying so, and the member keeps its address.
#[tokio::test]
async fn a_pin_on_a_members_address_is_refused() {
    on_both(|fx| async move {
        let t = pool_token(&fx.c, 1).await;
        assert_eq!(fx.c.enrol(member_request(&t.token, 50)).await.unwrap().node, "ci-1");
        let held = fx.c.nodes().await.unwrap().into_iter().find(|n| n.name == "ci-1").unwrap().ipv4.expect("an IPv4 address");
        let files = lab_pool(|path, text| match path {
            "mesh.toml" => format!("{text}\n[[node]]\nname = \"x-1\"\nnetworks = [\"lan\"]\naddress_ipv4 = \"{held}\"\n"),
            _ => text,
        });
        match fx.c.apply(&files, None).await {
            Err(Error::InvalidDeclaration { diagnostics, .. }) => {
                assert_eq!(diagnostics.len(), 1, "{diagnostics:?}");
                assert!(
                    diagnostics[0].message.contains("nodes `x-1` and `ci-1` hold the same address of `overlay_ipv4`"),
                    "{diagnostics:?}"
                );
            }
            other => panic!("a pin on a member's address must be refused, got {other:?}"),
        }
        let still = fx.c.nodes().await.unwrap().into_iter().find(|n| n.name == "ci-1").unwrap().ipv4;
        assert_eq!(still.as_deref(), Some(held.as_str()));
    })
    .await;
}

/// A member placed while an apply ran can hold the address that apply gave a declared node (its
/// placement read the allocation before). The next apply that changes no name or pin moves the
/// declared node off the member's address: with members, the allocation held is not kept
/// (ADR 0034; an attacker's review of keeping it found this).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_node_on_a_members_address_is_moved_by_the_next_apply() {
    on_both(|fx| async move {
        let t = pool_token(&fx.c, 1).await;
        assert_eq!(fx.c.enrol(member_request(&t.token, 51)).await.unwrap().node, "ci-1");
        let address = |nodes: &[proto::NodeInfo], name: &str| nodes.iter().find(|n| n.name == name).and_then(|n| n.ipv4.clone());
        let web = address(&fx.c.nodes().await.unwrap(), "web-1").expect("web-1 has an address");
        // What the race leaves, made directly: the member holds web-1's address.
        fx.c.store().execute_raw(&format!("UPDATE nodes SET ipv4 = '{web}' WHERE name = 'ci-1'")).await.unwrap();
        // A change that keeps every name and pin.
        let files = lab_pool(|path, text| if path == "mesh.toml" { format!("{text}\n# a comment\n") } else { text });
        assert!(!fx.c.apply(&files, None).await.unwrap().unchanged);
        let nodes = fx.c.nodes().await.unwrap();
        assert_eq!(address(&nodes, "ci-1").as_deref(), Some(web.as_str()));
        let moved = address(&nodes, "web-1").expect("web-1 has an address");
        assert_ne!(moved, web, "web-1 still holds the address of the member ci-1");
    })
    .await;
}

/// The attack of a review: the pool `ci` is replaced by a declared node `ci-1` while the member
/// `ci-1` is live. The member must take nothing of the declared node: the apply removes it in its
/// own transaction (audited there), no bundle is published for it and its peers never get its
/// key; and a member record that holds a declared node's name anyway (enrolled against the old
/// revision while the apply commits) is neither published nor authenticated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_replaced_by_a_declared_node_of_a_members_name_gives_the_member_nothing() {
    on_both(|fx| async move {
        let c = &fx.c;
        let web = c.create_token(&proto::TokenRequest { node: "web-1".into(), ttl_secs: 600, ..Default::default() }).await.unwrap();
        c.enrol(member_request(&web.token, 80)).await.unwrap();
        let t = pool_token(c, 4).await;
        let member = c.enrol(member_request(&t.token, 81)).await.unwrap();
        assert_eq!(member.node, "ci-1");
        c.publish().await.unwrap();
        let member_key = x25519_public(81);
        assert!(bundle_text(c, "web-1").contains(&member_key), "the member peers with web-1 while its pool is declared");

        // The pool goes; a declared node takes the name of its member, with a rule of its own.
        let files = lab_pool_without_pool("[[node]]\nname = \"ci-1\"\nnetworks = [\"lan\"]\nmodules = [\"postgres\"]\n");
        c.apply(&files, None).await.unwrap();
        assert!(c.store().node("ci-1").await.unwrap().is_none(), "the apply removed the member whose name it declares");
        let audit = c.audit().await.unwrap();
        let applied = audit.iter().rev().find(|r| r.action == AuditAction::DeclarationApplied.as_str()).unwrap();
        assert!(applied.detail.contains("removed the pool members it names as declared nodes: ci-1 (pool ci)"), "{}", applied.detail);
        c.publish().await.unwrap();
        assert!(c.bundle("ci-1").is_none(), "the declared ci-1 has not enrolled: nobody holds its bundle");
        assert!(!bundle_text(c, "web-1").contains(&member_key), "web-1 no longer peers with the member's key");
        let der = trellis_pki::pem_to_der(&member.node_cert_pem, "CERTIFICATE").unwrap();
        assert!(matches!(c.authenticate_node(Some(&der)).await, Err(Error::Node(_))), "the member's certificate is refused");

        // The declared ci-1 enrols; then its record is made to say it belongs to pool ci, as a
        // member enrolled against the old revision would be: it is neither published nor let in.
        let declared = c.create_token(&proto::TokenRequest { node: "ci-1".into(), ttl_secs: 600, ..Default::default() }).await.unwrap();
        let enrolled = c.enrol(member_request(&declared.token, 82)).await.unwrap();
        c.publish().await.unwrap();
        let der = trellis_pki::pem_to_der(&enrolled.node_cert_pem, "CERTIFICATE").unwrap();
        c.authenticate_node(Some(&der)).await.unwrap();
        assert!(bundle_text(c, "web-1").contains(&x25519_public(82)), "the declared ci-1 peers with web-1");
        c.store().execute_raw("UPDATE nodes SET pool = 'ci' WHERE name = 'ci-1'").await.unwrap();
        c.publish().await.unwrap();
        assert!(!bundle_text(c, "web-1").contains(&x25519_public(82)), "a pool's record is not taken for the declared node");
        let refused = c.authenticate_node(Some(&der)).await.unwrap_err();
        assert!(matches!(refused, Error::Node(trellis_controller::NodeRefusal::Replaced { .. })), "{refused:?}");
        assert_eq!(refused.code(), "member_replaced");
    })
    .await;
}

//! The controller's decisions in process, with no HTTP: a clock the test moves and randomness
//! the test chooses, on SQLite and PostgreSQL. (The HTTP mapping is tested in `trellis-server`.)

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use trellis_controller::{Error, NodeRefusal, Redemption};
use trellis_proto::etag::BundleTag;
use trellis_proto::{self as proto, AuditAction, EnrolledState, NodeState, TokenState};
use trellis_testing::controller::{Fixture, ADMIN, T0};
use trellis_testing::Database;

mod certs;
mod long_polls;
mod pools;
mod restores;
mod revocations;

/// The fixture with `lab/basic` applied (revision 1).
async fn controller(db: Database) -> Fixture {
    let fx = trellis_testing::controller::controller(db).await;
    let c = &fx.c;
    let files = trellis_testing::controller::lab_files("basic");
    let applied = c.apply(&files, Some(0)).await.unwrap();
    assert_eq!((applied.revision, applied.unchanged), (1, false));
    let again = c.apply(&files, None).await.unwrap();
    assert_eq!((again.revision, again.unchanged), (1, true), "the same files are answered as unchanged");
    fx
}

fn enrol_request(token: &str) -> (proto::EnrolRequest, String) {
    let t = trellis_core::token::EnrolmentToken::decode(token).unwrap();
    trellis_testing::controller::enrol_request(&t, x25519_public(t.id[0]))
}

/// A distinct valid WireGuard public key (any 32 bytes are one).
fn x25519_public(seed: u8) -> String {
    trellis_testing::controller::wireguard_key(seed.wrapping_add(100))
}

/// Enrols `node` with a token of its own (no approval).
async fn enrol(c: &trellis_controller::Controller, node: &str) {
    let created = c
        .create_token(&proto::TokenRequest { node: node.into(), ttl_secs: 600, require_approval: false, ..Default::default() })
        .await
        .unwrap();
    c.enrol(enrol_request(&created.token).0).await.unwrap();
}

/// Enrols `node` with a token of its own (no approval) and publishes.
async fn enrol_and_publish(c: &trellis_controller::Controller, node: &str) {
    enrol(c, node).await;
    c.publish().await.unwrap();
}

async fn on_both<F, Fut>(f: F)
where
    F: Fn(Fixture) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for url in trellis_testing::databases().await {
        // A clone kept here: a test that moves `fx.c` out drops the rest of the fixture at once.
        f(controller(url.clone()).await).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_expire_by_the_injected_clock_and_their_ids_come_from_the_injected_randomness() {
    on_both(|fx| async move {
        let c = &fx.c;
        let created = c
            .create_token(&proto::TokenRequest { node: "db-1".into(), ttl_secs: 60, require_approval: false, ..Default::default() })
            .await
            .unwrap();
        // The fixture's apply drew the first 16 bytes (the serial of the services CA certified
        // for the declared domain); the next 8 are the id, the next 24 the secret.
        assert_eq!(created.id, "1112131415161718");
        assert_eq!(created.expires_at, T0 + 60);
        let token = trellis_core::token::EnrolmentToken::decode(&created.token).unwrap();
        assert_eq!(token.secret[0], 25);
        assert_eq!(c.tokens().await.unwrap()[0].state, TokenState::Valid);

        fx.clock.0.store(T0 + 60, Ordering::SeqCst);
        assert_eq!(c.tokens().await.unwrap()[0].state, TokenState::Expired);
        let (req, _) = enrol_request(&created.token);
        let refused = c.enrol(req).await.unwrap_err();
        assert!(matches!(refused, Error::Redemption(Redemption::Expired)), "{refused:?}");
        assert_eq!(refused.code(), "token_expired");
        let audit = c.audit().await.unwrap();
        let last = audit.last().unwrap();
        assert_eq!((last.action.as_str(), last.subject.as_str(), last.at), (AuditAction::TokenRedemptionRefused.as_str(), "db-1", T0 + 60));
        assert_eq!(trellis_proto::audit::verify(&audit), Ok(audit.len()));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrolment_certificates_and_approval_follow_the_clock_and_the_states() {
    on_both(|fx| async move {
        let c = &fx.c;
        let created = c
            .create_token(&proto::TokenRequest { node: "db-1".into(), ttl_secs: 600, require_approval: true, ..Default::default() })
            .await
            .unwrap();
        fx.clock.0.store(T0 + 100, Ordering::SeqCst);
        let (req, _key) = enrol_request(&created.token);
        let enrolled = c.enrol(req.clone()).await.unwrap();
        assert_eq!(enrolled.state, EnrolledState::Pending);
        let cert = trellis_pki::inspect_pem(&enrolled.node_cert_pem).unwrap();
        assert_eq!(cert.not_after, T0 + 100 + 3600, "the certificate's lifetime runs from the injected clock");
        assert_eq!(cert.not_before, T0 + 100 - 60, "a minute of grace before it");

        // A second redemption of the same token with other keys is refused as used.
        let (other, _) = enrol_request(&created.token);
        let again = c.enrol(proto::EnrolRequest { wireguard_public_key: x25519_public(200), ..other }).await.unwrap_err();
        assert!(matches!(again, Error::Redemption(Redemption::Used)), "{again:?}");

        let der = trellis_pki::pem_to_der(&enrolled.node_cert_pem, "CERTIFICATE").unwrap();
        let who = c.authenticate_node(Some(&der)).await.unwrap();
        assert_eq!((who.name.as_str(), who.state), ("db-1", EnrolledState::Pending));
        let pending = c.require_approved(&who).unwrap_err();
        assert!(matches!(pending, Error::Node(NodeRefusal::PendingApproval(_))), "{pending:?}");
        let node = |name: &str| {
            let name = name.to_string();
            async move { c.nodes().await.unwrap().into_iter().find(|n| n.name == name).unwrap().state }
        };
        assert_eq!(node("db-1").await, NodeState::Pending);
        assert_eq!(node("api-1").await, NodeState::Declared);

        assert_eq!(c.approve("db-1").await.unwrap().state, EnrolledState::Active);
        assert!(matches!(c.approve("db-1").await.unwrap_err(), Error::NotPending(n) if n == "db-1"));
        c.publish().await.unwrap();
        let who = c.authenticate_node(Some(&der)).await.unwrap();
        c.require_approved(&who).unwrap();
        assert!(c.bundle("db-1").is_some(), "an active node has a bundle");

        assert_eq!(c.revoke("db-1").await.unwrap().state, EnrolledState::Revoked);
        let refused = c.authenticate_node(Some(&der)).await.unwrap_err();
        assert!(matches!(refused, Error::Node(NodeRefusal::Revoked(_))), "{refused:?}");
        // A retried revocation succeeds, deciding nothing again (the audit chain holds one).
        let audited = c.audit().await.unwrap().len();
        assert_eq!(c.revoke("db-1").await.unwrap().state, EnrolledState::Revoked);
        assert_eq!(c.audit().await.unwrap().len(), audited, "a retried revocation is not recorded again");
        assert!(matches!(c.revoke("api-1").await.unwrap_err(), Error::NotRevocable(n) if n == "api-1"), "a node never enrolled");
        assert!(c.bundle("db-1").is_some(), "the decision returns before publishing");
        c.settle(std::time::Duration::from_secs(5)).await.unwrap();
        assert!(c.bundle("db-1").is_none(), "a revoked node's bundle is withdrawn");
        assert_eq!(node("db-1").await, NodeState::Revoked);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_typed_and_leave_the_records_as_they_were() {
    on_both(|fx| async move {
        let c = &fx.c;
        assert!(matches!(c.authenticate_admin(None), Err(Error::AdminRequired)));
        assert!(matches!(c.authenticate_admin(Some("wrong")), Err(Error::AdminDenied)));
        c.authenticate_admin(Some(ADMIN)).unwrap();

        let r = c
            .create_token(&proto::TokenRequest { node: "nobody".into(), ttl_secs: 60, require_approval: false, ..Default::default() })
            .await;
        assert!(matches!(r, Err(Error::NodeNotDeclared { ref node, revision: 1 }) if node == "nobody"), "{r:?}");
        let r =
            c.create_token(&proto::TokenRequest { node: "db-1".into(), ttl_secs: 0, require_approval: false, ..Default::default() }).await;
        assert!(matches!(r, Err(Error::BadRequest(_))), "{r:?}");

        let mesh = proto::DeclFile { path: "mesh.toml".into(), text: "[mesh]\nname = \"x\"\nbogus = 1\n".into() };
        match c.apply(&[mesh], None).await {
            Err(Error::InvalidDeclaration { diagnostics, .. }) => {
                assert!(diagnostics.iter().any(|d| d.message.contains("bogus")), "{diagnostics:?}")
            }
            other => panic!("{other:?}"),
        }
        let stale = proto::DeclFile {
            path: "mesh.toml".into(),
            text: "[mesh]\nname = \"x\"\ndomain = \"x.mesh\"\noverlay_ipv4 = \"10.9.0.0/16\"\n".into(),
        };
        let r = c.apply(&[stale], Some(0)).await;
        assert!(matches!(r, Err(Error::RevisionConflict { current: 1, expected: 0 })), "{r:?}");
        assert_eq!(c.store().current_revision_head().await.unwrap().unwrap().0, 1, "a refused apply leaves the revision in force");

        let t = c
            .create_token(&proto::TokenRequest { node: "db-1".into(), ttl_secs: 60, require_approval: false, ..Default::default() })
            .await
            .unwrap();
        let (mut req, _) = enrol_request(&t.token);
        req.node = "api-1".into();
        let r = c.enrol(req).await.unwrap_err();
        assert!(matches!(&r, Error::Redemption(Redemption::OtherNode { token, asked }) if token == "db-1" && asked == "api-1"), "{r:?}");
        assert_eq!(r.to_string(), "token is for node `db-1`, not `api-1`");
        assert_eq!(c.tokens().await.unwrap().iter().find(|x| x.id == t.id).unwrap().state, TokenState::Valid);
        assert_eq!(c.revoke_token(&t.id).await.unwrap().state, TokenState::Revoked);
        let r = c.revoke_token(&t.id).await.unwrap_err();
        assert!(matches!(r, Error::TokenNotRevocable { state: TokenState::Revoked, .. }), "{r:?}");
    })
    .await;
}

/// A lost answer: the node sends the same redemption again (same token, same WireGuard key, a
/// CSR for the same TLS key) and is answered as it was the first time, with nothing recorded
/// twice. Other keys, or a node that has renewed or been revoked since, get "token already used".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_enrolment_is_answered_as_the_first_was_and_only_for_the_same_keys() {
    on_both(|fx| async move {
        let c = &fx.c;
        let created = c
            .create_token(&proto::TokenRequest { node: "db-1".into(), ttl_secs: 600, require_approval: false, ..Default::default() })
            .await
            .unwrap();
        let (req, key) = enrol_request(&created.token);
        let first = c.enrol(req.clone()).await.unwrap();
        let audited = c.audit().await.unwrap().len();
        fx.clock.0.store(T0 + 30, Ordering::SeqCst);

        let retry = c.enrol(req.clone()).await.unwrap();
        assert_eq!(retry.node_cert_pem, first.node_cert_pem, "the same certificate, not a second one");
        assert_eq!((retry.node.as_str(), retry.mesh.as_str(), retry.state), (first.node.as_str(), first.mesh.as_str(), first.state));
        assert_eq!(
            (&retry.ca_pem, &retry.signing_public_key, &retry.controllers),
            (&first.ca_pem, &first.signing_public_key, &first.controllers)
        );
        // A fresh CSR for the same key is the same request.
        let same_key = proto::EnrolRequest { csr_pem: trellis_pki::csr_from_key(&key, "db-1").unwrap(), ..req.clone() };
        assert_eq!(c.enrol(same_key).await.unwrap().node_cert_pem, first.node_cert_pem);
        assert_eq!(c.audit().await.unwrap().len(), audited, "a retry records nothing");

        // Concurrent retries all get the one answer.
        let (a, b) = tokio::join!(c.enrol(req.clone()), c.enrol(req.clone()));
        assert_eq!((a.unwrap().node_cert_pem, b.unwrap().node_cert_pem), (first.node_cert_pem.clone(), first.node_cert_pem.clone()));

        // Other keys are refused: another WireGuard key, another TLS key, a CSR signed by a key
        // other than the one it names.
        let used = |r: Result<proto::EnrolResponse, Error>| matches!(r, Err(Error::Redemption(Redemption::Used)));
        assert!(used(c.enrol(proto::EnrolRequest { wireguard_public_key: x25519_public(9), ..req.clone() }).await));
        let (other, _) = enrol_request(&created.token);
        assert!(used(c.enrol(proto::EnrolRequest { csr_pem: other.csr_pem, ..req.clone() }).await));
        let wrong_secret = proto::EnrolRequest { secret: base64::engine::general_purpose::STANDARD.encode([0u8; 24]), ..req.clone() };
        assert!(matches!(c.enrol(wrong_secret).await, Err(Error::Redemption(Redemption::Wrong))));

        // Once the node renewed, its enrolment answer was not lost: a retry is refused.
        let der = trellis_pki::pem_to_der(&first.node_cert_pem, "CERTIFICATE").unwrap();
        let who = c.authenticate_node(Some(&der)).await.unwrap();
        let renewed = c.renew(&who, &proto::RenewRequest { csr_pem: trellis_pki::csr_from_key(&key, "db-1").unwrap() }).await.unwrap();
        assert!(used(c.enrol(req.clone()).await), "a retry after a renewal");
        // The renewal's answer lost, the node asks again with the certificate it replaced: the
        // same key is given the same certificate, nothing else recorded; another key is refused.
        let audited = c.audit().await.unwrap().len();
        let again = c.renew(&who, &proto::RenewRequest { csr_pem: trellis_pki::csr_from_key(&key, "db-1").unwrap() }).await.unwrap();
        assert_eq!((again.node_cert_pem.as_str(), again.not_after), (renewed.node_cert_pem.as_str(), renewed.not_after));
        assert_eq!(c.audit().await.unwrap().len(), audited, "a retry records nothing");
        let (_, other_csr) = trellis_pki::node_key_and_csr("db-1").unwrap();
        assert!(matches!(
            c.renew(&who, &proto::RenewRequest { csr_pem: other_csr }).await,
            Err(Error::Node(trellis_controller::NodeRefusal::Superseded(_)))
        ));

        // And a revoked node's token stays used.
        let t2 = c
            .create_token(&proto::TokenRequest { node: "api-1".into(), ttl_secs: 600, require_approval: false, ..Default::default() })
            .await
            .unwrap();
        let (req2, _) = enrol_request(&t2.token);
        c.enrol(req2.clone()).await.unwrap();
        c.revoke("api-1").await.unwrap();
        assert!(used(c.enrol(req2).await), "a retry after a revocation");

        // A retry that races the redemption it repeats (sent before the first was decided)
        // waits for it and gets its answer; neither is refused.
        let t3 = c
            .create_token(&proto::TokenRequest { node: "op-1".into(), ttl_secs: 600, require_approval: false, ..Default::default() })
            .await
            .unwrap();
        let (req3, _) = enrol_request(&t3.token);
        let (a, b) = tokio::join!(c.enrol(req3.clone()), c.enrol(req3));
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.node_cert_pem, b.node_cert_pem);
        assert_eq!(c.store().node("op-1").await.unwrap().unwrap().cert_pem.as_deref(), Some(a.node_cert_pem.as_str()));

        let audit = c.audit().await.unwrap();
        assert_eq!(audit.iter().filter(|r| r.action == AuditAction::NodeEnrolled.as_str()).count(), 3);
        assert_eq!(trellis_proto::audit::verify(&audit), Ok(audit.len()));
    })
    .await;
}

/// The audit flood: a caller sends well-formed enrolments with tokens that do not exist, as
/// fast as it can. Before, every one was read from the database and audited (3,000 requests, 3,000
/// records). Now each source gets its first 5 refusals a minute audited, the next 25 counted, and
/// the rest turned away before anything is read; the counted ones become one record when the
/// minute is over. Another source is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_redemptions_are_audited_counted_then_turned_away_per_source() {
    on_both(|fx| async move {
        let c = &fx.c;
        let before = c.audit().await.unwrap().len();
        let attacker: std::net::IpAddr = "192.0.2.66".parse().unwrap();
        let unknown = |i: u32| proto::EnrolRequest {
            token_id: format!("{i:016x}"),
            secret: base64::engine::general_purpose::STANDARD.encode([1u8; 24]),
            node: "db-1".into(),
            csr_pem: "-".into(),
            wireguard_public_key: "-".into(),
        };
        let (mut unknowns, mut turned_away) = (0, 0);
        for i in 0..100 {
            match c.enrol_from(unknown(i), Some(attacker)).await {
                Err(Error::Redemption(Redemption::Unknown)) => unknowns += 1,
                Err(Error::Redemption(Redemption::TooMany { from, wait })) => {
                    assert_eq!((from.as_str(), wait), ("192.0.2.66", 60));
                    turned_away += 1;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!((unknowns, turned_away), (30, 70));
        let audit = c.audit().await.unwrap();
        assert_eq!(audit.len() - before, 5, "five refusals audited one by one");
        assert!(audit.last().unwrap().detail.ends_with("(from 192.0.2.66)"), "{:?}", audit.last());
        // A token holder elsewhere is not turned away, and is audited.
        let neighbour: std::net::IpAddr = "2001:db8::1".parse().unwrap();
        assert!(matches!(c.enrol_from(unknown(7), Some(neighbour)).await, Err(Error::Redemption(Redemption::Unknown))));
        assert_eq!(c.audit().await.unwrap().len() - before, 6);

        // The minute ends: the counted refusals become one record, written once.
        fx.clock.0.store(T0 + 60, Ordering::SeqCst);
        c.write_refusals().await;
        c.write_refusals().await;
        let audit = c.audit().await.unwrap();
        assert_eq!(audit.len() - before, 7, "{:?}", &audit[before..]);
        let summary = audit.last().unwrap();
        assert_eq!((summary.action.as_str(), summary.subject.as_str()), (AuditAction::TokenRedemptionsRefused.as_str(), "192.0.2.66"));
        assert!(
            summary
                .detail
                .starts_with("95 more refused from 192.0.2.66 in the 60 s from 1900000000 (70 of them turned away unread); the last:"),
            "{}",
            summary.detail
        );
        assert_eq!(trellis_proto::audit::verify(&audit), Ok(audit.len()));
        // And the source may try again.
        assert!(matches!(c.enrol_from(unknown(1), Some(attacker)).await, Err(Error::Redemption(Redemption::Unknown))));
    })
    .await;
}

/// A mesh of `n` nodes that all answer ping from the whole mesh: every node peers with every
/// other, so each enrolment changes every enrolled node's bundle.
fn ping_mesh(n: usize) -> Vec<proto::DeclFile> {
    let mut mesh =
        String::from("[mesh]\nname = \"storm\"\ndomain = \"storm.mesh\"\noverlay_ipv4 = \"10.90.0.0/16\"\n\n[networks]\nlan = {}\n");
    for i in 0..n {
        mesh.push_str(&format!(
            "\n[[node]]\nname = \"n-{i:03}\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]\n[[node.endpoint]]\naddress = \"192.0.2.{}:51820\"\nreachable_from = [\"lan\"]\n",
            i + 1
        ));
    }
    let ping = "[module]\nname = \"ping\"\n\n[[allow]]\nproto = \"icmp\"\nfrom = [\"mesh\"]\n";
    vec![proto::DeclFile { path: "mesh.toml".into(), text: mesh }, proto::DeclFile { path: "modules/ping.toml".into(), text: ping.into() }]
}

/// Coalesced publishing: a burst of concurrent enrolments returns without waiting for a publish
/// each, is published in far fewer runs than enrolments, and every node still ends up with a
/// bundle that names every other node as a peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_enrolments_is_published_in_a_few_runs_and_every_node_gets_its_bundle() {
    const N: usize = 48;
    on_both(|fx| async move {
        let c = Arc::new(fx.c);
        c.apply(&ping_mesh(N), None).await.unwrap();
        c.settle(Duration::from_secs(30)).await.unwrap();
        let publishing = tokio::spawn(c.clone().publishing());
        let mut requests = Vec::new();
        for i in 0..N {
            let t = c
                .create_token(&proto::TokenRequest {
                    node: format!("n-{i:03}"),
                    ttl_secs: 600,
                    require_approval: false,
                    ..Default::default()
                })
                .await
                .unwrap();
            requests.push(enrol_request(&t.token).0);
        }
        let before = c.publish_runs();
        let enrolments: Vec<_> = requests
            .into_iter()
            .enumerate()
            .map(|(i, mut req)| {
                // Distinct WireGuard keys (the token ids may share their first byte).
                req.wireguard_public_key = base64::engine::general_purpose::STANDARD.encode([i as u8 + 1; 32]);
                let c = c.clone();
                tokio::spawn(async move { c.enrol(req).await })
            })
            .collect();
        for e in enrolments {
            assert_eq!(e.await.unwrap().unwrap().state, EnrolledState::Active);
        }
        c.settle(Duration::from_secs(60)).await.unwrap();
        let runs = c.publish_runs() - before;
        assert!(runs >= 1 && runs <= N as u64 / 4, "{N} enrolments took {runs} publish runs; they should share runs");
        let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]).verifying_key();
        for i in 0..N {
            let node = format!("n-{i:03}");
            let p = c.bundle(&node).unwrap_or_else(|| panic!("{node} has no bundle"));
            let v = trellis_core::bundle::verify(&p.signed.to_vec(), &key, "storm", &node, None).unwrap();
            let wg = v.bundle.files.iter().find(|f| f.path == trellis_core::compile::WIREGUARD_CONF).unwrap();
            let peers = std::str::from_utf8(&wg.content).unwrap().matches("[Peer]").count();
            assert_eq!(peers, N - 1, "{node}'s bundle names every other node as a peer");
        }
        publishing.abort();
    })
    .await;
}

/// Two replicas on one database: a node revoked through one is refused by the other on its very
/// next request. Before, the other replica authenticated from a table its publish runs refresh
/// (every 500 ms, when it sees the audit head move), and let the revoked node in meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_through_one_replica_is_refused_by_the_other_at_once() {
    on_both(|fx| async move {
        let a = &fx.c;
        let created = a.create_token(&proto::TokenRequest { node: "db-1".into(), ttl_secs: 600, ..Default::default() }).await.unwrap();
        let enrolled = a.enrol(enrol_request(&created.token).0).await.unwrap();
        a.publish().await.unwrap();
        let der = trellis_pki::pem_to_der(&enrolled.node_cert_pem, "CERTIFICATE").unwrap();
        // The other replica, on the same database, with its table built.
        let b = trellis_testing::controller::controller(fx.db.clone()).await.c;
        b.publish().await.unwrap();
        assert!(b.authenticate_node(Some(&der)).await.is_ok(), "db-1 is in through either replica");

        a.revoke("db-1").await.unwrap();
        let Err(refused) = b.authenticate_node(Some(&der)).await else { panic!("db-1 let in by the other replica after its revocation") };
        assert!(matches!(refused, Error::Node(NodeRefusal::Revoked(_))), "{refused:?}");
        // And a renewal through one replica: the other takes the new certificate at once, and the
        // one before it (until it is replaced again).
        let created = a.create_token(&proto::TokenRequest { node: "op-1".into(), ttl_secs: 600, ..Default::default() }).await.unwrap();
        let (req, key) = enrol_request(&created.token);
        let enrolled = a.enrol(req).await.unwrap();
        let old = trellis_pki::pem_to_der(&enrolled.node_cert_pem, "CERTIFICATE").unwrap();
        let who = a.authenticate_node(Some(&old)).await.unwrap();
        b.publish().await.unwrap();
        let renewed = a.renew(&who, &proto::RenewRequest { csr_pem: trellis_pki::csr_from_key(&key, "op-1").unwrap() }).await.unwrap();
        let new = trellis_pki::pem_to_der(&renewed.node_cert_pem, "CERTIFICATE").unwrap();
        assert!(b.authenticate_node(Some(&new)).await.is_ok(), "the renewed certificate, before any run of the other replica");
        assert!(b.authenticate_node(Some(&old)).await.is_ok(), "and the one before it");
    })
    .await;
}

/// Replicas on one database: a run of one replica that read the database before a decision can
/// commit after the other replica's run covering that decision. Its older content then gets the
/// next version, and its next run stores the current content again, one version higher still,
/// with no move of the audit head. A replica that published that content at the lower version
/// must take the stored one, or its nodes show as stale for ever (seen in `lab/ha.toml`: every
/// agent held the current content at a version below the stored one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_takes_the_version_another_replica_stored_for_the_same_content() {
    on_both(|fx| async move {
        let c = &fx.c;
        enrol_and_publish(c, "db-1").await;
        let held = c.bundle("db-1").unwrap().version;
        let stored = c.store().bundle("db-1").await.unwrap().unwrap();
        assert_eq!(held, stored.version);
        // The other replica's late run, then its next one, as they reach the database.
        c.store().publish(&[("db-1".into(), "0".repeat(64))], T0).await.unwrap();
        c.store().publish(&[("db-1".into(), stored.digest.clone())], T0 + 1).await.unwrap();
        assert_eq!(c.store().bundle("db-1").await.unwrap().unwrap().version, held + 2);

        c.publish_if_moved().await.unwrap();
        let p = c.bundle("db-1").unwrap();
        assert_eq!(p.version, held + 2, "the replica serves the stored version");
        let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]).verifying_key();
        let v = trellis_core::bundle::verify(&p.signed.to_vec(), &key, "basic", "db-1", None).unwrap();
        assert_eq!((v.bundle.version, v.bundle.issued_at), ((held + 2) as u64, T0 + 1), "signed as the other replica signed it");
        // Once the versions match, looking again publishes nothing.
        let runs = c.publish_runs();
        c.publish_if_moved().await.unwrap();
        c.publish_if_moved().await.unwrap();
        assert_eq!(c.publish_runs(), runs);
    })
    .await;
}

/// A replica's own runs leave it knowing what the store holds: the next look (`publish_if_moved`,
/// every tick) reads no stored version. Before, every run that stored a version made the next
/// look read all of them (100,000 rows, about a second at 100,000 nodes, under the run's lock,
/// so an apply's run that came then waited for it). Another replica's publish is still seen, and
/// its version taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_s_own_runs_need_no_read_of_every_stored_version() {
    on_both(|fx| async move {
        let c = &fx.c;
        enrol_and_publish(c, "db-1").await;
        // The first look reads them all (nothing was seen yet); then they are known.
        c.publish_if_moved().await.unwrap();
        let reads = c.version_reads();
        for node in ["api-1", "op-1"] {
            enrol_and_publish(c, node).await;
            c.publish_if_moved().await.unwrap();
        }
        assert_eq!(c.version_reads(), reads, "no read of every version after this replica's own runs");

        // Another replica publishes db-1 (other content, then this content again, a version up).
        let held = c.bundle("db-1").unwrap().version;
        let stored = c.store().bundle("db-1").await.unwrap().unwrap();
        c.store().publish(&[("db-1".into(), "0".repeat(64))], T0).await.unwrap();
        c.store().publish(&[("db-1".into(), stored.digest.clone())], T0 + 1).await.unwrap();
        c.publish_if_moved().await.unwrap();
        assert_eq!(c.version_reads(), reads + 1, "another replica's publish is read");
        assert_eq!(c.bundle("db-1").unwrap().version, held + 2, "and its version taken");
        c.publish_if_moved().await.unwrap();
        assert_eq!(c.version_reads(), reads + 1);
    })
    .await;
}

/// A look that starts while a run of this replica is about to store compares what the store
/// holds once that run is done, not before: it reads no stored version. Before, it read the
/// count and sum before taking the run's lock, found them behind what the run had seen, read
/// every version (100,000 rows at 100,000 nodes) and kept the stale sum, so that the next look
/// read them all again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_look_during_a_run_reads_what_the_run_stored() {
    on_both(|fx| async move {
        let c = &fx.c;
        enrol_and_publish(c, "db-1").await;
        c.publish_if_moved().await.unwrap();
        let reads = c.version_reads();
        // api-1 enrols; its run waits behind a held lock, and a look comes in behind the run.
        enrol(c, "api-1").await;
        let runs = c.publish_runs();
        let held = c.while_no_run(tokio::time::sleep(Duration::from_millis(300)));
        let run = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            c.publish().await.unwrap()
        };
        let look = async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            c.publish_if_moved().await.unwrap()
        };
        let ((), published, ()) = tokio::join!(held, run, look);
        assert!(published > 0, "the run published api-1's bundle and its partners'");
        assert_eq!(c.publish_runs(), runs + 1, "one run, the look found nothing to publish");
        assert_eq!(c.version_reads(), reads, "the look read no stored version");
        c.publish_if_moved().await.unwrap();
        assert_eq!(c.version_reads(), reads, "nor did the next");
    })
    .await;
}

/// Replicas on one database apply in turn. An apply writes the address rows by difference from
/// the allocation it holds, only while that is the current revision's: a replica holding an
/// older one reads the table. Here `a` holds revision 1's, `b` adds x-1 (revision 2) and `a`
/// takes it out again: trusting its own revision 1 (no x-1) would leave x-1's row behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_applying_in_turn_store_what_a_full_read_gives() {
    on_both(|fx| async move {
        let a = &fx.c;
        let b = trellis_testing::controller::controller(fx.db.clone()).await.c;
        let basic = trellis_testing::controller::lab_files("basic");
        let mut with_x = basic.clone();
        with_x[0].text.push_str("\n[[node]]\nname = \"x-1\"\nnetworks = [\"lan\"]\n");
        assert_eq!(b.apply(&with_x, Some(1)).await.unwrap().revision, 2);
        assert!(a.store().allocation().await.unwrap().ipv4.contains_key("x-1"));
        let before = a.store().allocation().await.unwrap();
        assert_eq!(a.apply(&basic, Some(2)).await.unwrap().revision, 3);
        let stored = a.store().allocation().await.unwrap();
        let files: Vec<(String, String)> = basic.iter().map(|f| (f.path.clone(), f.text.clone())).collect();
        let decl = trellis_core::load_relative(&files, str::to_string).declaration.unwrap();
        assert_eq!(stored, trellis_core::allocate(&decl, &before).unwrap(), "x-1's row went, the others stayed");
        assert!(!stored.ipv4.contains_key("x-1"));
        // And `b`, which holds revision 2's, adds it back from the table too: x-1 is placed anew.
        assert_eq!(b.apply(&with_x, Some(3)).await.unwrap().revision, 4);
        assert!(b.store().allocation().await.unwrap().ipv4.contains_key("x-1"), "x-1's row written again");
    })
    .await;
}

/// What a node asking for its bundle is answered, as a value: the whole bundle after the run
/// that covers its enrolment, `Current` while it holds the newest, the whole newer one as soon as
/// a decision publishes it, `Current` at once when the controller stops; nothing while pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bundle_request_is_answered_as_a_value() {
    use trellis_controller::{BundleAnswer, BundleRequest};
    on_both(|fx| async move {
        let c = &fx.c;
        let token = |node: &str, require_approval: bool| {
            let req = proto::TokenRequest { node: node.into(), ttl_secs: 600, require_approval, ..Default::default() };
            async move { c.create_token(&req).await.unwrap().token }
        };
        let (req, key) = enrol_request(&token("db-1", false).await);
        let enrolled = c.enrol(req).await.unwrap();
        let der = trellis_pki::pem_to_der(&enrolled.node_cert_pem, "CERTIFICATE").unwrap();
        let who = c.authenticate_node(Some(&der)).await.unwrap();
        let ask = |held: Option<BundleTag>, wait: u64| BundleRequest {
            held,
            takes_delta: true,
            held_files: Vec::new(),
            wait: Duration::from_secs(wait),
        };
        let version_only = |version: i64| BundleTag { version, digest: None };

        // No bundle held yet: the request waits for the run that covers the enrolment.
        let first = match c.bundle_answer(&who, ask(None, 0)).await.unwrap() {
            BundleAnswer::Whole { tag, body, stamp } => {
                let held = c.bundle("db-1").unwrap();
                assert_eq!(tag, BundleTag::new(held.version, &held.digest), "the tag names the version and the content");
                assert_eq!(body.collect::<Vec<_>>().concat(), held.signed.to_vec(), "the bundle as held");
                assert!(!stamp.is_empty());
                tag
            }
            _ => panic!("a node holding nothing is sent its bundle whole"),
        };
        assert!(matches!(c.bundle_answer(&who, ask(Some(first), 0)).await.unwrap(), BundleAnswer::Current { tag, .. } if tag == first));
        // An older agent's tag, the version alone, names the bundle too.
        assert!(matches!(c.bundle_answer(&who, ask(Some(version_only(first.version)), 0)).await.unwrap(), BundleAnswer::Current { .. }));
        let first = first.version;

        // A renewal changes its certificate, so its bundle: a long-poll holding the old one hears
        // of the new one as soon as it is published.
        let csr_pem = trellis_pki::csr_from_key(&key, "db-1").unwrap();
        let (answer, ()) = tokio::join!(c.bundle_answer(&who, ask(Some(version_only(first)), 30)), async {
            c.renew(&who, &proto::RenewRequest { csr_pem }).await.unwrap();
            c.publish().await.unwrap();
        });
        let second = match answer.unwrap() {
            BundleAnswer::Whole { tag, .. } => tag.version,
            _ => panic!("a newer bundle is sent whole (the tag names no content and no files: no delta)"),
        };
        assert!(second > first, "{second} after {first}");

        let (req, _) = enrol_request(&token("api-1", true).await);
        let pending = c.enrol(req).await.unwrap();
        let der = trellis_pki::pem_to_der(&pending.node_cert_pem, "CERTIFICATE").unwrap();
        let waiting = c.authenticate_node(Some(&der)).await.unwrap();
        let refused = c.bundle_answer(&waiting, ask(None, 0)).await.err().unwrap();
        assert!(matches!(refused, Error::Node(NodeRefusal::PendingApproval(_))), "{refused:?}");

        c.stop();
        let started = std::time::Instant::now();
        let stopped = c.bundle_answer(&who, ask(Some(version_only(second)), 60)).await.unwrap();
        assert!(matches!(stopped, BundleAnswer::Current { tag, .. } if tag.version == second));
        assert!(started.elapsed() < Duration::from_secs(10), "a stopping controller answers at once");
    })
    .await;
}

/// A zone's SOA serial is its bundle's version: every change of the zone (here a node more that
/// db-1 may reach, each time) gives it a higher serial, so a secondary that compares serials sees
/// every change; a publish that changes nothing keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serial_of_a_changed_zone_rises() {
    on_both(|fx| async move {
        let c = &fx.c;
        enrol_and_publish(c, "db-1").await;
        let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]).verifying_key();
        let zone = || {
            let p = c.bundle("db-1").unwrap();
            let v = trellis_core::bundle::verify(&p.signed.to_vec(), &key, "basic", "db-1", None).unwrap();
            let f = v.bundle.files.iter().find(|f| f.path == trellis_core::compile::MESH_ZONE).unwrap();
            let text = String::from_utf8(f.content.to_vec()).unwrap();
            (trellis_core::zone::parse(&text).unwrap().serial.unwrap(), text)
        };
        let (mut serial, _) = zone();
        let basic = trellis_testing::controller::lab_files("basic");
        let mut mesh = basic.iter().find(|f| f.path == "mesh.toml").unwrap().text.clone();
        let modules: Vec<proto::DeclFile> = basic.iter().filter(|f| f.path != "mesh.toml").cloned().collect();
        for k in 1..=8 {
            mesh.push_str(&format!("\n[[node]]\nname = \"extra-{k}\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]\n"));
            let mut files = vec![proto::DeclFile { path: "mesh.toml".into(), text: mesh.clone() }];
            files.extend(modules.iter().cloned());
            c.apply(&files, None).await.unwrap();
            c.publish().await.unwrap();
            let (now, text) = zone();
            assert!(text.contains(&format!("\nextra-{k}\tIN\tA\t")), "db-1 may reach extra-{k}:\n{text}");
            assert!(now > serial, "change {k}: the zone changed but its serial went from {serial} to {now}\n{text}");
            serial = now;
        }
        c.publish().await.unwrap();
        assert_eq!(zone().0, serial, "a publish that changes nothing keeps the serial");
    })
    .await;
}

/// The review of 2026-12-02, finding 8: a node renewing in a loop (each renewal with the
/// certificate the last one gave it) added an audit record and a publish run per request. It is
/// renewed four times in a third of its certificate's lifetime; the next is told when.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_renewing_in_a_loop_is_held_to_a_few_renewals_a_window() {
    on_both(|fx| async move {
        let c = &fx.c;
        let created = c.create_token(&proto::TokenRequest { node: "db-1".into(), ttl_secs: 600, ..Default::default() }).await.unwrap();
        let (req, key) = enrol_request(&created.token);
        let mut pem = c.enrol(req).await.unwrap().node_cert_pem;
        let who = |pem: String| async move {
            let der = trellis_pki::pem_to_der(&pem, "CERTIFICATE").unwrap();
            c.authenticate_node(Some(&der)).await.unwrap()
        };
        let ask = || proto::RenewRequest { csr_pem: trellis_pki::csr_from_key(&key, "db-1").unwrap() };
        for i in 0..4 {
            pem = c.renew(&who(pem).await, &ask()).await.unwrap_or_else(|e| panic!("renewal {i}: {e}")).node_cert_pem;
        }
        let audited = c.audit().await.unwrap().len();
        match c.renew(&who(pem.clone()).await, &ask()).await {
            Err(Error::TooOften { node, what, wait }) => {
                assert_eq!((node.as_str(), what.as_str(), wait), ("db-1", "its certificate's renewal", 1200));
            }
            other => panic!("a fifth renewal at once: {other:?}"),
        }
        assert_eq!(c.audit().await.unwrap().len(), audited, "nothing recorded");
        fx.clock.0.store(T0 + 1200, Ordering::SeqCst);
        c.renew(&who(pem).await, &ask()).await.expect("renewed once the window passed");
    })
    .await;
}

/// An attacker's review of the fix for finding 1: every node drops what arrives from outside the
/// overlay with an overlay source, so an overlay prefix that holds the controller's own address
/// would have every node drop the controller's answers, and no bundle could come to fix it. The
/// declaration is refused, naming the prefix and the address; the one in force stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlay_that_holds_the_controllers_address_is_refused() {
    on_both(|fx| async move {
        let c = &fx.c;
        let basic = trellis_testing::controller::lab_files("basic");
        c.apply(&basic, None).await.unwrap();
        let before = c.store().current_revision_head().await.unwrap();
        let files: Vec<proto::DeclFile> = basic
            .into_iter()
            .map(|f| if f.path == "mesh.toml" { proto::DeclFile { text: f.text.replace("10.88.0.0/16", "127.0.0.0/8"), ..f } } else { f })
            .collect();
        match c.apply(&files, None).await.unwrap_err() {
            Error::InvalidDeclaration { message, .. } => assert!(
                message.starts_with("the overlay's prefix 127.0.0.0/8 holds the controller's address 127.0.0.1 (127.0.0.1:8443): "),
                "{message}"
            ),
            e => panic!("{e:?}"),
        }
        assert_eq!(c.store().current_revision_head().await.unwrap(), before, "the declaration in force stays");
    })
    .await;
}

/// A run gives the nodes that hold no bundle theirs before it stores, signs and swaps in the
/// rest: in an enrolment storm at 100,000 nodes nearly every node is due in every run (each
/// gains peers), and a node that had just enrolled waited for some 100,000 bundles to be stored
/// and signed before its first. Here api-1 enrols beside db-1, whose bundle changes in the same
/// run (api-1 reaches its postgres): held after its first stage, the run has put api-1's first
/// bundle in the table and not yet db-1's new one (with one swap of every bundle, the hold is
/// never reached).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_swaps_in_the_first_bundles_before_it_stores_the_rest() {
    on_both(|fx| async move {
        let c = Arc::new(fx.c);
        enrol_and_publish(&c, "db-1").await;
        let before = c.bundle("db-1").expect("db-1 holds a bundle").version;
        enrol(&c, "api-1").await;
        let (there, go) = c.hold_after_first_stage();
        let run = tokio::spawn({
            let c = c.clone();
            async move { c.publish().await.unwrap() }
        });
        tokio::time::timeout(Duration::from_secs(10), there).await.expect("the run reaches its first stage's end").unwrap();
        assert!(c.bundle("api-1").is_some(), "api-1's first bundle is in the table after the first stage");
        assert_eq!(c.bundle("db-1").unwrap().version, before, "db-1's new bundle is not, until the rest is carried out");
        go.send(()).unwrap();
        assert_eq!(run.await.unwrap(), 2, "the run publishes both");
        assert!(c.bundle("db-1").unwrap().version > before, "api-1's enrolment changes db-1's bundle");
    })
    .await;
}

/// Applies `ping_mesh(declared)`, enrols its first `enrolled` nodes and publishes; their names.
async fn enrolled_ping_mesh(c: &trellis_controller::Controller, declared: usize, enrolled: usize) -> Vec<String> {
    c.apply(&ping_mesh(declared), None).await.unwrap();
    let names: Vec<String> = (0..enrolled).map(|i| format!("n-{i:03}")).collect();
    for n in &names {
        enrol(c, n).await;
    }
    c.publish().await.unwrap();
    names
}

/// Once a run has spent its budget on the bundles of nodes that hold one while a decision waits,
/// it puts off the rest, and the next run publishes what it put off, though nothing changed
/// since (ADR 0042). In each round a node enrols into a mesh where every node sees every other,
/// so every node's bundle changes; the rest is carried out one bundle at a time with no budget,
/// and a decision arrives once the new node's first bundle is in (the run held there). In the
/// second round a node enrols to wait for approval between the two runs (its record moves, no
/// bundle does), so the run after walks every active node rather than those named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_puts_off_the_rest_while_decisions_wait_and_the_next_publishes_it() {
    on_both(|fx| async move {
        let c = Arc::new(fx.c);
        let mut old = enrolled_ping_mesh(&c, 13, 10).await;
        let version = |n: &str| c.bundle(n).unwrap_or_else(|| panic!("{n} holds a bundle")).version;
        for (new, record_moves) in [("n-010", false), ("n-011", true)] {
            let before: Vec<i64> = old.iter().map(|n| version(n)).collect();
            enrol(&c, new).await;
            c.set_rest_slices(1, Duration::ZERO);
            // A decision arrives while the run is under way: once its first stage is in.
            let (there, go) = c.hold_after_first_stage();
            let run = tokio::spawn({
                let c = c.clone();
                async move { c.publish().await.unwrap() }
            });
            tokio::time::timeout(Duration::from_secs(10), there).await.expect("the run reaches its first stage's end").unwrap();
            c.ask_publish_now();
            go.send(()).unwrap();
            run.await.unwrap();
            let after: Vec<i64> = old.iter().map(|n| version(n)).collect();
            let put_off = old.iter().zip(before.iter().zip(&after)).filter(|(_, (b, a))| b == a).count();
            assert!(put_off > 0, "{new}: a decision waited and the budget was spent, bundles are put off ({before:?} -> {after:?})");
            assert!(put_off < old.len(), "{new}: the run carried out at least one slice of the rest");
            c.set_rest_slices(4096, Duration::from_secs(1));
            if record_moves {
                let token = proto::TokenRequest { node: "n-012".into(), ttl_secs: 600, require_approval: true, ..Default::default() };
                let pending = c.enrol(enrol_request(&c.create_token(&token).await.unwrap().token).0).await.unwrap();
                assert_eq!(pending.state, EnrolledState::Pending);
            }
            // Nothing that changes a bundle happened since: the next run publishes what was put
            // off, and only that.
            assert_eq!(c.publish().await.unwrap(), put_off, "{new}: the run after publishes every bundle put off");
            for (n, b) in old.iter().zip(&before) {
                assert!(version(n) > *b, "{n} holds the bundle that names {new}");
            }
            assert_eq!(c.publish().await.unwrap(), 0, "{new}: nothing is put off any more");
            old.push(new.to_string());
        }
    })
    .await;
}

/// A run that put bundles off has not covered the decisions it read: `settle`, which an apply
/// waits on, returns only once what was put off is published (by the run the background task
/// starts at once). Here `settle` waits for n-010's enrolment while the run that reads it puts
/// off the updates of the nodes that hold a bundle; when it returns, every one of them holds
/// the bundle that names n-010. Counting the run as covering the enrolment, it returned first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_is_settled_only_once_what_a_run_put_off_is_published() {
    on_both(|fx| async move {
        let c = Arc::new(fx.c);
        let old = enrolled_ping_mesh(&c, 11, 10).await;
        let before: Vec<i64> = old.iter().map(|n| c.bundle(n).unwrap().version).collect();
        let background = tokio::spawn(c.clone().publishing());
        c.set_rest_slices(1, Duration::ZERO);
        let (there, go) = c.hold_after_first_stage();
        // The background task starts a run for it, held once n-010's first bundle is in.
        enrol(&c, "n-010").await;
        tokio::time::timeout(Duration::from_secs(10), there).await.expect("the run reaches its first stage's end").unwrap();
        // Waiting for the enrolment (polled once, so that it counts the decisions made so far),
        // then another decision arrives while the run is under way.
        let settled = c.settle(Duration::from_secs(10));
        tokio::pin!(settled);
        tokio::select! {
            biased;
            _ = &mut settled => panic!("the enrolment is not published while its run is held"),
            _ = std::future::ready(()) => {}
        }
        c.ask_publish_now();
        go.send(()).unwrap();
        settled.await.expect("settled within 10 s");
        for (n, b) in old.iter().zip(&before) {
            assert!(c.bundle(n).unwrap().version > *b, "settled, so {n}'s bundle that names n-010 is published");
        }
        background.abort();
    })
    .await;
}

/// A node that just enrolled is answered its first bundle once that bundle is in the table, not
/// once the run that covers its enrolment ends (ADR 0042). The node asks before the run starts
/// (the run waits for the test), and the run is held after its first stage: the node is
/// answered meanwhile. Waiting for the run to end, it was not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_node_is_answered_its_first_bundle_before_its_run_ends() {
    use trellis_controller::{BundleAnswer, BundleRequest};
    on_both(|fx| async move {
        let c = Arc::new(fx.c);
        enrol_and_publish(&c, "db-1").await;
        let background = tokio::spawn(c.clone().publishing());
        let (there, go) = c.hold_after_first_stage();
        let mut asking = None;
        c.while_no_run(async {
            let req = proto::TokenRequest { node: "api-1".into(), ttl_secs: 600, ..Default::default() };
            let enrolled = c.enrol(enrol_request(&c.create_token(&req).await.unwrap().token).0).await.unwrap();
            let der = trellis_pki::pem_to_der(&enrolled.node_cert_pem, "CERTIFICATE").unwrap();
            let who = c.authenticate_node(Some(&der)).await.unwrap();
            let request = tokio::spawn({
                let c = c.clone();
                async move { c.bundle_answer(&who, BundleRequest::default()).await }
            });
            // The request waits for a bundle before the run covering the enrolment starts.
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(!request.is_finished(), "api-1 has no bundle before a run");
            asking = Some(request);
        })
        .await;
        tokio::time::timeout(Duration::from_secs(10), there).await.expect("the run reaches its first stage's end").unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(5), asking.expect("asked"))
            .await
            .expect("answered while the run is held")
            .unwrap()
            .unwrap();
        assert!(matches!(answer, BundleAnswer::Whole { .. }), "api-1 is sent its first bundle whole");
        go.send(()).unwrap();
        background.abort();
    })
    .await;
}

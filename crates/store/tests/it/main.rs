//! The store against SQLite and PostgreSQL: revisions with conflicts, tokens used once under
//! concurrency, key uniqueness, state changes and the audit chain.

use std::sync::Arc;

use trellis_core::Allocation;
use trellis_proto::{AuditAction, EnrolledState, EvidenceResult};
use trellis_store::{verify_audit, Addresses, Audit, EvidenceRecord, MemberRefusal, NodeRecord, Packed, Store, StoreError, TokenRecord};
use trellis_testing::Database;

fn audit(action: AuditAction) -> Audit<'static> {
    Audit { at: 1_000, actor: "test", action, subject: "s", detail: String::new() }
}

fn token(id: &str, node: &str) -> TokenRecord {
    TokenRecord {
        id: id.into(),
        node: node.into(),
        secret_sha256: "00".into(),
        created_at: 1,
        expires_at: 2_000_000_000,
        used_at: None,
        revoked_at: None,
        require_approval: false,
        pool: None,
        uses: 1,
        used: 0,
    }
}

fn node(name: &str, key: &str) -> NodeRecord {
    NodeRecord {
        name: name.into(),
        state: EnrolledState::Active,
        wg_public_key: Some(key.into()),
        cert_serial: Some("aa".into()),
        prev_cert_serial: None,
        cert_not_after: Some(5),
        enrolled_at: 1_000,
        last_contact: None,
        cert_pem: Some("PEM".into()),
        pool: None,
        ipv4: None,
        ipv6: None,
    }
}

async fn each_backend<F, Fut>(f: F)
where
    F: Fn(Store) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for url in trellis_testing::databases().await {
        let store = Store::open(&url).await.unwrap_or_else(|e| panic!("open {url}: {e}"));
        f(store).await;
    }
}

/// An apply writes only the addresses that changed; what is read back is always the whole
/// allocation of the newest revision: nodes gone, moved, added (more than one batch) and kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apply_writes_the_allocation_it_was_given_whatever_was_there() {
    each_backend(|s| async move {
        let files = vec![("mesh.toml".to_string(), "x".to_string())];
        let mut first = Allocation::default();
        for i in 0..700u32 {
            first.ipv4.insert(format!("n{i}"), std::net::Ipv4Addr::from(0x0a00_0000 + i));
            if i.is_multiple_of(2) {
                first.ipv6.insert(format!("n{i}"), std::net::Ipv6Addr::from(0xfd00_u128 << 112 | i as u128));
            }
        }
        s.apply(Packed::new(&files), "d1", Addresses::read(first.clone()), None, &[], &audit(AuditAction::DeclarationApplied))
            .await
            .unwrap();
        assert_eq!(s.allocation().await.unwrap(), first, "{:?}: 700 new rows, in batches", s.backend);
        let mut second = first.clone();
        second.ipv4.remove("n1");
        second.ipv6.remove("n2");
        second.ipv4.remove("n2");
        second.ipv4.insert("n3".into(), "10.9.9.9".parse().unwrap());
        second.ipv6.insert("n5".into(), "fd00::5:5".parse().unwrap());
        second.ipv4.insert("fresh".into(), "10.8.8.8".parse().unwrap());
        s.apply(Packed::new(&files), "d2", Addresses::read(second.clone()), None, &[], &audit(AuditAction::DeclarationApplied))
            .await
            .unwrap();
        assert_eq!(s.allocation().await.unwrap(), second, "{:?}: removed, moved, given a second family, added", s.backend);
        // Written by difference from what the caller holds as revision 2's, the table unread:
        // the caller says n7 is at its new address already, so its row is not written (a table
        // read would have moved it).
        let mut third = second.clone();
        third.ipv4.insert("n9".into(), "10.7.7.7".parse().unwrap());
        third.ipv4.remove("n11");
        third.ipv4.insert("n7".into(), "10.5.5.5".parse().unwrap());
        let mut said = second.clone();
        said.ipv4.insert("n7".into(), "10.5.5.5".parse().unwrap());
        let held = Addresses { allocation: Arc::new(third.clone()), held: Some((2, Arc::new(said))) };
        s.apply(Packed::new(&files), "d3", held, None, &[], &audit(AuditAction::DeclarationApplied)).await.unwrap();
        let mut expected = third.clone();
        expected.ipv4.insert("n7".into(), second.ipv4["n7"]);
        assert_eq!(s.allocation().await.unwrap(), expected, "{:?}: n9 moved and n11 gone, by difference", s.backend);
        // Held as of a revision that is no longer current: the table is read instead, so the
        // same stale claim writes the right rows.
        let mut fourth = third.clone();
        fourth.ipv4.insert("n13".into(), "10.6.6.6".parse().unwrap());
        let stale = Addresses { allocation: Arc::new(fourth.clone()), held: Some((2, Arc::new(Allocation::default()))) };
        s.apply(Packed::new(&files), "d4", stale, None, &[], &audit(AuditAction::DeclarationApplied)).await.unwrap();
        assert_eq!(s.allocation().await.unwrap(), fourth, "{:?}: a stale held allocation is not trusted", s.backend);
        s.apply(Packed::new(&files), "d5", Addresses::read(Allocation::default()), None, &[], &audit(AuditAction::DeclarationApplied))
            .await
            .unwrap();
        assert_eq!(s.allocation().await.unwrap(), Allocation::default(), "{:?}: every row removed", s.backend);
    })
    .await;
}

/// A revision's files are stored packed: a declaration of many nodes takes a fraction of its
/// text in the database, and reads back the same. A row written before revisions were packed
/// (its JSON `files`, no `packed`) still reads; a packed row that does not unpack, or claims more
/// than a declaration could be, is an error naming the revision, not an empty declaration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revisions_are_stored_packed_and_read_back_whole() {
    each_backend(|s| async move {
        let nodes: String = (0..20_000).map(|i| format!("[nodes.n-{i}]\ngroups = [\"g-{}\"]\n\n", i % 50)).collect();
        let files = vec![("mesh.toml".to_string(), nodes.clone()), ("modules/ssh.toml".to_string(), "name = \"ssh\"\n".to_string())];
        s.apply(Packed::new(&files), "d1", Addresses::read(Allocation::default()), None, &[], &audit(AuditAction::DeclarationApplied))
            .await
            .unwrap();
        assert_eq!(s.current_revision().await.unwrap().unwrap().files, files, "{:?}", s.backend);
        // Packed in under a quarter of the text, and no text kept beside it (rows changed by a
        // no-op update only when they are so).
        let small =
            format!("UPDATE revisions SET digest = digest WHERE number = 1 AND LENGTH(packed) * 4 < {} AND files = ''", nodes.len());
        assert_eq!(s.execute_raw(&small).await.unwrap(), 1, "{:?}: the revision is packed", s.backend);

        // A row from before: its files as JSON text.
        s.execute_raw("INSERT INTO revisions (number, created_at, digest, files) VALUES (2, 2, 'd2', '[[\"mesh.toml\",\"old\"]]')")
            .await
            .unwrap();
        assert_eq!(s.current_revision().await.unwrap().unwrap().files, [("mesh.toml".to_string(), "old".to_string())], "{:?}", s.backend);

        // Packed bytes that do not unpack, and a claim of four gigabytes.
        for (number, hex) in [(3, "0a000000ffffffff"), (4, "ffffffff00")] {
            let literal = match s.backend {
                trellis_store::Backend::Sqlite => format!("X'{hex}'"),
                trellis_store::Backend::Postgres => format!("'\\x{hex}'::bytea"),
            };
            s.execute_raw(&format!(
                "INSERT INTO revisions (number, created_at, digest, files, packed) VALUES ({number}, 3, 'd', '', {literal})"
            ))
            .await
            .unwrap();
            let e = s.current_revision().await.unwrap_err().to_string();
            assert!(e.contains(&format!("revision {number}")) && e.contains("packed"), "{:?}: {e}", s.backend);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revisions_increase_and_expect_revision_detects_a_race() {
    each_backend(|s| async move {
        assert!(s.current_revision().await.unwrap().is_none());
        let files = vec![("mesh.toml".to_string(), "x".to_string())];
        let mut alloc = Allocation::default();
        alloc.ipv4.insert("a".into(), "10.0.0.1".parse().unwrap());
        assert_eq!(
            s.apply(Packed::new(&files), "d1", Addresses::read(alloc.clone()), Some(0), &[], &audit(AuditAction::DeclarationApplied))
                .await
                .unwrap(),
            1
        );
        assert_eq!(
            s.apply(Packed::new(&files), "d2", Addresses::read(alloc.clone()), None, &[], &audit(AuditAction::DeclarationApplied))
                .await
                .unwrap(),
            2
        );
        match s
            .apply(Packed::new(&files), "d3", Addresses::read(alloc.clone()), Some(1), &[], &audit(AuditAction::DeclarationApplied))
            .await
        {
            Err(StoreError::Conflict { current: 2, expected: 1 }) => {}
            other => panic!("{:?}: expected a conflict, got {other:?}", s.backend),
        }
        let cur = s.current_revision().await.unwrap().unwrap();
        assert_eq!((cur.number, cur.digest.as_str(), cur.files.clone()), (2, "d2", files.clone()));
        assert_eq!(s.allocation().await.unwrap(), alloc);

        // Two applies that both expect revision 2: exactly one wins.
        let s = Arc::new(s);
        let tasks: Vec<_> = (0..2)
            .map(|i| {
                let s = s.clone();
                let files = files.clone();
                let alloc = alloc.clone();
                tokio::spawn(async move {
                    s.apply(
                        Packed::new(&files),
                        &format!("r{i}"),
                        Addresses::read(alloc.clone()),
                        Some(2),
                        &[],
                        &audit(AuditAction::DeclarationApplied),
                    )
                    .await
                })
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(3) => ok += 1,
                Err(StoreError::Conflict { current: 3, .. }) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(ok, 1, "{:?}: exactly one concurrent apply wins", s.backend);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_used_once_even_when_redeemed_concurrently() {
    each_backend(|s| async move {
        s.create_token(&token("t1", "db-1"), &audit(AuditAction::TokenIssued)).await.unwrap();
        let s = Arc::new(s);
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let s = s.clone();
                tokio::spawn(async move { s.enrol("t1", &node("db-1", &format!("key{i}")), &audit(AuditAction::NodeEnrolled)).await })
            })
            .collect();
        let mut won = 0;
        for t in tasks {
            match t.await.unwrap() {
                Ok(()) => won += 1,
                Err(StoreError::TokenUsed) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(won, 1, "{:?}: one redemption wins", s.backend);
        let t = s.token("t1").await.unwrap().unwrap();
        assert!(t.used_at.is_some());
        assert!(!s.revoke_token("t1", &audit(AuditAction::TokenRevoked)).await.unwrap(), "a used token cannot be revoked");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_by_another_node_is_refused_and_the_token_stays_unused() {
    each_backend(|s| async move {
        s.create_token(&token("t1", "a"), &audit(AuditAction::TokenIssued)).await.unwrap();
        s.create_token(&token("t2", "b"), &audit(AuditAction::TokenIssued)).await.unwrap();
        s.enrol("t1", &node("a", "K"), &audit(AuditAction::NodeEnrolled)).await.unwrap();
        match s.enrol("t2", &node("b", "K"), &audit(AuditAction::NodeEnrolled)).await {
            Err(StoreError::KeyTaken(holder)) => assert_eq!(holder, "a"),
            other => panic!("{other:?}"),
        }
        assert!(s.token("t2").await.unwrap().unwrap().used_at.is_none(), "a refused enrolment leaves the token unused");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn states_change_and_every_decision_is_in_a_verifiable_audit_chain() {
    each_backend(|s| async move {
        s.create_token(&token("t1", "a"), &audit(AuditAction::TokenIssued)).await.unwrap();
        let mut n = node("a", "K");
        n.state = EnrolledState::Pending;
        s.enrol("t1", &n, &audit(AuditAction::NodeEnrolled)).await.unwrap();
        assert_eq!(
            s.set_state("a", &[EnrolledState::Pending], EnrolledState::Active, &audit(AuditAction::NodeApproved)).await.unwrap(),
            EnrolledState::Pending
        );
        assert!(s.set_state("a", &[EnrolledState::Pending], EnrolledState::Active, &audit(AuditAction::NodeApproved)).await.is_err());
        s.set_state("a", &[EnrolledState::Active, EnrolledState::Pending], EnrolledState::Revoked, &audit(AuditAction::NodeRevoked))
            .await
            .unwrap();
        let rec = s.node("a").await.unwrap().unwrap();
        assert_eq!((rec.state, rec.cert_serial), (EnrolledState::Revoked, None));

        let chain = s.audit().await.unwrap();
        let actions: Vec<&str> = chain.iter().map(|r| r.action.as_str()).collect();
        assert_eq!(actions, ["token issued", "node enrolled", "node approved", "node revoked"]);
        assert_eq!(verify_audit(&chain), Ok(4));
        s.execute_raw("UPDATE audit SET subject = 'b' WHERE seq = 2").await.unwrap();
        assert_eq!(verify_audit(&s.audit().await.unwrap()), Err("audit record 2 was altered: its hash does not match its content".into()));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bundle_versions_rise_only_when_content_changes_even_across_replicas() {
    each_backend(|s| async move {
        let c = |d: &str| vec![("db-1".to_string(), d.to_string())];
        assert_eq!(s.publish(&c("d1"), 10).await.unwrap()[0].1.version, 1);
        // The same content again (a restart, or another replica): same version, same issue time.
        let again = s.publish(&c("d1"), 20).await.unwrap();
        assert_eq!((again[0].1.version, again[0].1.issued_at), (1, 10));
        assert_eq!(s.publish(&c("d2"), 30).await.unwrap()[0].1.version, 2);
    })
    .await;
}

/// The bundles of some nodes, read by name in chunks, are what every bundle's read says of them;
/// a node with none is left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bundles_read_by_name_are_those_of_the_whole_read() {
    each_backend(|s| async move {
        let changes: Vec<(String, String)> = (0..600).map(|i| (format!("n{i:03}"), format!("d{i}"))).collect();
        let published = s.publish(&changes, 5).await.unwrap();
        assert_eq!(published.len(), 600, "every published node's version is returned");
        let all = s.bundles().await.unwrap();
        let asked: Vec<String> = (0..600).step_by(2).map(|i| format!("n{i:03}")).chain(["nobody".to_string()]).collect();
        let names: Vec<&str> = asked.iter().map(String::as_str).collect();
        let some = s.bundles_of(&names).await.unwrap();
        assert_eq!(some.len(), 300);
        for (node, v) in &some {
            assert_eq!(Some(v), all.get(node), "{node}");
        }
        assert!(!some.contains_key("nobody"));
    })
    .await;
}

/// A publish run's read of the records is the whole read without the certificates, and the
/// certificates read by name come with the serial they are under, a renewal's too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_without_certificates_and_certificates_by_name() {
    each_backend(|s| async move {
        for (i, name) in ["a", "b", "c"].iter().enumerate() {
            s.create_token(&token(&format!("t{i}"), name), &audit(AuditAction::TokenIssued)).await.unwrap();
            let mut n = node(name, &format!("K{i}"));
            n.cert_serial = Some(format!("0{i}"));
            n.cert_pem = Some(format!("PEM of {name}"));
            s.enrol(&format!("t{i}"), &n, &audit(AuditAction::NodeEnrolled)).await.unwrap();
        }
        let whole = s.nodes().await.unwrap();
        let light = s.nodes_without_certificates().await.unwrap();
        assert!(light.iter().all(|r| r.cert_pem.is_none()));
        let with: Vec<_> = whole.into_iter().map(|r| NodeRecord { cert_pem: None, ..r }).collect();
        assert_eq!(light, with);
        let certs = s.cert_pems(&["a", "c", "nobody"]).await.unwrap();
        assert_eq!(certs.len(), 2);
        assert_eq!(certs["c"], ("02".to_string(), Some("PEM of c".to_string())));
        s.renew("c", "02", "12", 9, "PEM of c, renewed", &audit(AuditAction::CertificateRenewed)).await.unwrap();
        assert_eq!(s.cert_pems(&["c"]).await.unwrap()["c"], ("12".to_string(), Some("PEM of c, renewed".to_string())));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishers_on_one_database_agree_on_versions() {
    let Some(url) = Database::postgres().await else { return };
    let a = Arc::new(Store::open(&url).await.unwrap());
    let b = Arc::new(Store::open(&url).await.unwrap());
    let changes: Vec<(String, String)> = (0..50).map(|i| (format!("n{i}"), "d1".to_string())).collect();
    a.publish(&changes, 1).await.unwrap();
    let next: Vec<(String, String)> = (0..50).map(|i| (format!("n{i}"), "d2".to_string())).collect();
    let (ra, rb) = tokio::join!(
        {
            let (a, n) = (a.clone(), next.clone());
            async move { a.publish(&n, 2).await }
        },
        {
            let (b, n) = (b.clone(), next.clone());
            async move { b.publish(&n, 3).await }
        }
    );
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    for ((na, va), (nb, vb)) in ra.iter().zip(rb.iter()) {
        assert_eq!(na, nb);
        assert_eq!(va, vb, "both replicas see one version for {na}");
        assert_eq!(va.version, 2, "one bump for one change of {na}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evidence_is_append_only_idempotent_and_shows_gaps() {
    each_backend(|s| async move {
        let rec = |seq: i64, version: i64, result: EvidenceResult, error: Option<&str>| EvidenceRecord {
            seq,
            version,
            result,
            error: error.map(str::to_string),
            files: "[]".into(),
            at: 100 + seq,
            unmanaged: false,
        };
        let batch = vec![
            rec(1, 1, EvidenceResult::Applied, None),
            rec(2, 2, EvidenceResult::Applied, None),
            rec(4, 3, EvidenceResult::Failed, Some("nft refused the ruleset")),
        ];
        assert_eq!(s.add_evidence("db-1", &batch, 200).await.unwrap(), (3, 0));
        // A re-send changes nothing; a record with a used seq cannot rewrite history.
        assert_eq!(s.add_evidence("db-1", &[rec(2, 9, EvidenceResult::Failed, Some("rewrite"))], 201).await.unwrap(), (0, 1));
        let sum = s.evidence_summary().await.unwrap().remove("db-1").unwrap();
        assert_eq!((sum.records, sum.highest_seq, sum.missing()), (3, 4, 1));
        assert_eq!(sum.applied_version, Some(2));
        assert_eq!((sum.last_result, sum.last_error.as_deref()), (Some(EvidenceResult::Failed), Some("nft refused the ruleset")));
        assert_eq!(s.evidence("db-1").await.unwrap()[1].version, 2);
    })
    .await;
}

/// The attack: one node posts evidence without end. Each node keeps its newest
/// `EVIDENCE_KEPT` records; what is pruned is counted, so gaps are still reported, and a re-send
/// of a pruned record is a duplicate, not new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evidence_is_bounded_per_node_and_pruning_keeps_gaps_countable() {
    each_backend(|s| async move {
        let rec = |seq: i64| EvidenceRecord {
            seq,
            version: 1,
            result: EvidenceResult::Applied,
            error: None,
            files: "[]".into(),
            at: seq,
            unmanaged: false,
        };
        let total = trellis_store::EVIDENCE_KEPT + 1500;
        let mut seq = 1;
        while seq <= total {
            // Record 7 never arrives: a gap that must stay visible after pruning.
            let batch: Vec<EvidenceRecord> = (seq..(seq + 1000).min(total + 1)).filter(|&n| n != 7).map(rec).collect();
            s.add_evidence("db-1", &batch, 1).await.unwrap();
            seq += 1000;
        }
        let kept = s.evidence("db-1").await.unwrap();
        assert_eq!(kept.len() as i64, trellis_store::EVIDENCE_KEPT, "bounded");
        assert_eq!(kept.first().unwrap().seq, total - trellis_store::EVIDENCE_KEPT + 1, "the newest are kept");
        let sum = s.evidence_summary().await.unwrap().remove("db-1").unwrap();
        assert_eq!((sum.highest_seq, sum.missing()), (total, 1), "the gap at 7 is still counted");
        assert_eq!(s.add_evidence("db-1", &[rec(3)], 2).await.unwrap(), (0, 1), "a pruned record sent again is a duplicate");
        assert_eq!(s.evidence_summary().await.unwrap()["db-1"].missing(), 1);
    })
    .await;
}

fn pool_token(id: &str, pool: &str, uses: i64) -> TokenRecord {
    TokenRecord { pool: Some(pool.into()), uses, node: pool.into(), ..token(id, pool) }
}

fn member(name: &str, key: &str, ipv4: &str) -> NodeRecord {
    NodeRecord { pool: Some("ci".into()), ipv4: Some(ipv4.into()), ..node(name, key) }
}

/// Twice as many redemptions as the token allows, all at once, each with its own name, key and
/// address: exactly `uses` are recorded, the rest find the token used up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_token_is_redeemed_exactly_uses_times_under_concurrency() {
    each_backend(|s| async move {
        let uses = 6;
        s.create_token(&pool_token("p1", "ci", uses), &audit(AuditAction::TokenIssued)).await.unwrap();
        let s = Arc::new(s);
        let tasks: Vec<_> = (1..=2 * uses)
            .map(|i| {
                let s = s.clone();
                tokio::spawn(async move {
                    s.enrol_member(
                        "p1",
                        100,
                        &member(&format!("ci-{i}"), &format!("key{i}"), &format!("10.0.0.{i}")),
                        &audit(AuditAction::NodeEnrolled),
                    )
                    .await
                })
            })
            .collect();
        let (mut won, mut used_up) = (0, 0);
        for t in tasks {
            match t.await.unwrap() {
                Ok(Ok(())) => won += 1,
                Ok(Err(MemberRefusal::TokenUsedUp)) => used_up += 1,
                other => panic!("{:?}: unexpected {other:?}", s.backend),
            }
        }
        assert_eq!((won, used_up), (uses, uses), "{:?}", s.backend);
        let t = s.token("p1").await.unwrap().unwrap();
        assert_eq!((t.used, t.uses), (uses, uses));
        assert_eq!(s.members().await.unwrap().len(), uses as usize);
        assert!(!s.revoke_token("p1", &audit(AuditAction::TokenRevoked)).await.unwrap(), "a used-up token cannot be revoked");
        let audited = s.audit().await.unwrap().iter().filter(|r| r.action == AuditAction::NodeEnrolled.as_str()).count();
        assert_eq!(audited, uses as usize, "{:?}: one audit record per member, none for a refusal", s.backend);
    })
    .await;
}

/// Two tokens for one pool of size 3, redeemed at once: no more than three members, and the
/// size check is not fooled by redemptions running side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_never_holds_more_than_its_size() {
    each_backend(|s| async move {
        s.create_token(&pool_token("a", "ci", 10), &audit(AuditAction::TokenIssued)).await.unwrap();
        s.create_token(&pool_token("b", "ci", 10), &audit(AuditAction::TokenIssued)).await.unwrap();
        let s = Arc::new(s);
        let tasks: Vec<_> = (1..=10)
            .map(|i| {
                let s = s.clone();
                let token = if i % 2 == 0 { "a" } else { "b" };
                tokio::spawn(async move {
                    s.enrol_member(
                        token,
                        3,
                        &member(&format!("ci-{i}"), &format!("key{i}"), &format!("10.0.0.{i}")),
                        &audit(AuditAction::NodeEnrolled),
                    )
                    .await
                })
            })
            .collect();
        let (mut won, mut full) = (0, 0);
        for t in tasks {
            match t.await.unwrap() {
                Ok(Ok(())) => won += 1,
                Ok(Err(MemberRefusal::PoolFull)) => full += 1,
                other => panic!("{:?}: unexpected {other:?}", s.backend),
            }
        }
        assert_eq!((won, full), (3, 7), "{:?}", s.backend);
        let used = s.token("a").await.unwrap().unwrap().used + s.token("b").await.unwrap().unwrap().used;
        assert_eq!(used, 3, "{:?}: a refused redemption uses nothing", s.backend);
    })
    .await;
}

/// A member's name, key and addresses are its own: a redemption that would share one is told
/// to choose again (or that the key is taken), and uses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_takes_no_name_key_or_address_another_node_holds() {
    each_backend(|s| async move {
        s.create_token(&pool_token("p", "ci", 10), &audit(AuditAction::TokenIssued)).await.unwrap();
        s.create_token(&pool_token("other", "cd", 10), &audit(AuditAction::TokenIssued)).await.unwrap();
        s.create_token(&TokenRecord { expires_at: 1_000, ..pool_token("old", "ci", 10) }, &audit(AuditAction::TokenIssued)).await.unwrap();
        let enrol = |t: &'static str, m: NodeRecord| {
            let s = &s;
            async move { s.enrol_member(t, 10, &m, &audit(AuditAction::NodeEnrolled)).await.unwrap() }
        };
        assert_eq!(enrol("p", member("ci-1", "k1", "10.0.0.1")).await, Ok(()));
        assert_eq!(enrol("p", member("ci-1", "k2", "10.0.0.2")).await, Err(MemberRefusal::Taken), "name");
        assert_eq!(enrol("p", member("ci-2", "k2", "10.0.0.1")).await, Err(MemberRefusal::Taken), "address");
        assert_eq!(enrol("other", member("ci-2", "k2", "10.0.0.2")).await, Err(MemberRefusal::TokenUsedUp), "another pool's token");
        assert_eq!(enrol("old", member("ci-2", "k2", "10.0.0.2")).await, Err(MemberRefusal::TokenUsedUp), "expired");
        let taken = s.enrol_member("p", 10, &member("ci-2", "k1", "10.0.0.2"), &audit(AuditAction::NodeEnrolled)).await;
        assert!(matches!(taken, Err(StoreError::KeyTaken(ref h)) if h == "ci-1"), "{taken:?}");
        assert_eq!(s.token("p").await.unwrap().unwrap().used, 1, "{:?}: refusals use nothing", s.backend);
        // A node's token does not enrol a member, nor a pool token a declared node.
        s.create_token(&token("n", "db-1"), &audit(AuditAction::TokenIssued)).await.unwrap();
        assert_eq!(enrol("n", member("ci-2", "k2", "10.0.0.2")).await, Err(MemberRefusal::TokenUsedUp));
        assert!(matches!(s.enrol("p", &node("db-1", "k3"), &audit(AuditAction::NodeEnrolled)).await, Err(StoreError::TokenUsed)));
    })
    .await;
}

/// `kept` brought up to date by `changes`, read from change number `seq`, which moves to theirs.
fn caught_up(read: &mut trellis_store::RecordsRead, changes: trellis_store::NodeChanges, kept: Vec<NodeRecord>) -> Vec<NodeRecord> {
    *read = changes.read.clone();
    changes.onto(kept)
}

/// Every record kept from a read and brought up to date with the changes since is the whole read
/// (ADR 0036): through enrolments, a member joining, an approval, a renewal, a revocation and a
/// member removed; a contact alone is no change, and a database whose number went back (restored
/// under a running controller) is read whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_brought_up_to_date_by_their_changes_are_the_whole_read() {
    each_backend(|s| async move {
        let light = |s: &Store| {
            let s = s.clone();
            async move {
                let mut all = s.nodes_without_certificates().await.unwrap();
                all.sort_by(|a, b| a.name.cmp(&b.name));
                all
            }
        };
        // A read of a database with no decision yet is whole again next time: it holds no head
        // of the chain to be known by.
        assert!(s.node_changes(Some(&s.node_changes(None).await.unwrap().read)).await.unwrap().whole);
        s.create_token(&token("t1", "db-1"), &audit(AuditAction::TokenIssued)).await.unwrap();
        s.create_token(&TokenRecord { require_approval: true, ..token("t2", "api-1") }, &audit(AuditAction::TokenIssued)).await.unwrap();
        let first = s.node_changes(None).await.unwrap();
        assert!(first.whole && first.records.is_empty());
        let (mut read, mut kept) = (first.read.clone(), first.clone().onto(Vec::new()));
        s.enrol("t1", &node("db-1", "k1"), &audit(AuditAction::NodeEnrolled)).await.unwrap();
        s.enrol("t2", &NodeRecord { state: EnrolledState::Pending, ..node("api-1", "k2") }, &audit(AuditAction::NodeEnrolled))
            .await
            .unwrap();
        s.create_token(&pool_token("p", "ci", 10), &audit(AuditAction::TokenIssued)).await.unwrap();
        s.enrol_member("p", 10, &member("ci-1", "k3", "10.0.0.3"), &audit(AuditAction::NodeEnrolled)).await.unwrap().unwrap();
        let changes = s.node_changes(Some(&read)).await.unwrap();
        assert_eq!((changes.whole, changes.records.len()), (false, 3));
        kept = caught_up(&mut read, changes, kept);
        assert_eq!(kept, light(&s).await);
        // A contact is no change.
        s.touch_all(&[("db-1".to_string(), 5_000)]).await.unwrap();
        let changes = s.node_changes(Some(&read)).await.unwrap();
        assert!(changes.records.is_empty() && changes.gone.is_empty(), "{changes:?}");
        kept = caught_up(&mut read, changes, kept);
        s.set_state("api-1", &[EnrolledState::Pending], EnrolledState::Active, &audit(AuditAction::NodeApproved)).await.unwrap();
        s.renew("db-1", "aa", "bb", 9, "PEM 2", &audit(AuditAction::CertificateRenewed)).await.unwrap();
        let changes = s.node_changes(Some(&read)).await.unwrap();
        assert_eq!(changes.records.iter().map(|r| r.name.as_str()).collect::<std::collections::BTreeSet<_>>(), ["api-1", "db-1"].into());
        kept = caught_up(&mut read, changes, kept);
        assert_eq!(kept, light(&s).await);
        s.set_state("db-1", &[EnrolledState::Active], EnrolledState::Revoked, &audit(AuditAction::NodeRevoked)).await.unwrap();
        assert!(s.remove_member("ci-1", i64::MAX, &audit(AuditAction::NodeRemoved)).await.unwrap());
        let changes = s.node_changes(Some(&read)).await.unwrap();
        assert_eq!(changes.gone, ["ci-1"]);
        kept = caught_up(&mut read, changes, kept);
        assert_eq!(kept, light(&s).await);
        assert_eq!(
            kept.iter().map(|r| (r.name.as_str(), r.state)).collect::<Vec<_>>(),
            [("api-1", EnrolledState::Active), ("db-1", EnrolledState::Revoked)]
        );
        // The attack of a restore under a running controller: the database goes back to before
        // its newest decision (here the chain's head and the counter's last step are lost), and
        // a new decision (api-1 revoked) takes the counter back to the number the records were
        // read at. The chain no longer holds the head they were read with: every record is read
        // again, api-1 revoked. Before, the number alone said nothing had changed.
        let (at, _) = read.head.clone().expect("decisions were made");
        s.execute_raw(&format!("DELETE FROM audit WHERE seq = {at}")).await.unwrap();
        s.execute_raw("UPDATE node_changes SET seq = seq - 1").await.unwrap();
        s.set_state("api-1", &[EnrolledState::Active], EnrolledState::Revoked, &audit(AuditAction::NodeRevoked)).await.unwrap();
        let back = s.node_changes(Some(&read)).await.unwrap();
        assert_eq!(back.read.seq, read.seq, "the counter is back where the records were read");
        assert!(back.whole, "another history: read whole");
        kept = caught_up(&mut read, back, kept);
        assert_eq!(kept, light(&s).await);
        assert!(kept.iter().all(|r| r.state == EnrolledState::Revoked));
    })
    .await;
}

/// A member out of contact since before the cutoff is removed, with its evidence, once; one in
/// contact since, or a declared node, is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_out_of_contact_is_removed_once() {
    each_backend(|s| async move {
        s.create_token(&pool_token("p", "ci", 10), &audit(AuditAction::TokenIssued)).await.unwrap();
        s.create_token(&token("n", "db-1"), &audit(AuditAction::TokenIssued)).await.unwrap();
        s.enrol("n", &node("db-1", "k0"), &audit(AuditAction::NodeEnrolled)).await.unwrap();
        for i in 1..=2 {
            s.enrol_member(
                "p",
                10,
                &member(&format!("ci-{i}"), &format!("k{i}"), &format!("10.0.0.{i}")),
                &audit(AuditAction::NodeEnrolled),
            )
            .await
            .unwrap()
            .unwrap();
        }
        let ev = EvidenceRecord {
            seq: 1,
            version: 1,
            result: EvidenceResult::Applied,
            error: None,
            files: "[]".into(),
            at: 1_000,
            unmanaged: false,
        };
        s.add_evidence("ci-1", std::slice::from_ref(&ev), 1_000).await.unwrap();
        s.touch_all(&[("ci-2".to_string(), 1_500)]).await.unwrap();
        // enrolled_at is 1000: a cutoff at 1000 removes nobody; at 1200, ci-1 (no contact since).
        assert!(!s.remove_member("ci-1", 1_000, &audit(AuditAction::NodeRemoved)).await.unwrap());
        assert!(s.remove_member("ci-1", 1_200, &audit(AuditAction::NodeRemoved)).await.unwrap());
        assert!(!s.remove_member("ci-1", 1_200, &audit(AuditAction::NodeRemoved)).await.unwrap(), "{:?}: removed once", s.backend);
        assert!(!s.remove_member("ci-2", 1_200, &audit(AuditAction::NodeRemoved)).await.unwrap(), "in contact at 1500");
        assert!(!s.remove_member("db-1", 9_999, &audit(AuditAction::NodeRemoved)).await.unwrap(), "a declared node is never swept");
        let names: Vec<String> = s.members().await.unwrap().into_iter().map(|m| m.name).collect();
        assert_eq!(names, vec!["ci-2"]);
        assert!(s.node("db-1").await.unwrap().is_some());
        // A new ci-1 starts its evidence afresh.
        s.enrol_member("p", 10, &member("ci-1", "k9", "10.0.0.9"), &audit(AuditAction::NodeEnrolled)).await.unwrap().unwrap();
        let added = s.add_evidence("ci-1", &[ev], 2_000).await.unwrap();
        assert_eq!(added.0, 1, "{:?}: the first record of the new ci-1 is not a re-send", s.backend);
        let removed = s.audit().await.unwrap().iter().filter(|r| r.action == AuditAction::NodeRemoved.as_str()).count();
        assert_eq!(removed, 1, "{:?}: only the removal that happened is audited", s.backend);
    })
    .await;
}

/// A service certificate issued, then a renewal refused: the certificate stays recorded beside
/// the refusal; the next issuance clears it. Each is in the audit chain.
#[tokio::test]
async fn a_refused_renewal_keeps_the_certificate_before_it_on_record() {
    each_backend(|s| async move {
        let names = vec!["postgres.t.mesh".to_string(), "db-1.t.mesh".to_string(), "10.0.0.1".to_string()];
        let issued = |serial, issued_at, not_after| trellis_store::IssuedServiceCert {
            node: "db-1",
            module: "postgres",
            serial,
            names: &names,
            issued_at,
            not_after,
        };
        s.issue_service_cert(&issued("01ab", 100, 200), &audit(AuditAction::ServiceCertificateIssued)).await.unwrap();
        s.refuse_service_cert(
            "db-1",
            "postgres",
            150,
            "node `db-1` no longer runs module `postgres`",
            &audit(AuditAction::ServiceCertificateRefused),
        )
        .await
        .unwrap();
        // A refusal for a module never issued is recorded too.
        s.refuse_service_cert("api-1", "postgres", 160, "not served", &audit(AuditAction::ServiceCertificateRefused)).await.unwrap();
        let all = s.service_certs().await.unwrap();
        assert_eq!(all.len(), 2, "{all:?}");
        assert_eq!((all[0].node.as_str(), all[0].serial.as_deref(), all[0].refusal.as_deref()), ("api-1", None, Some("not served")));
        let pg = &all[1];
        assert_eq!(pg.serial.as_deref(), Some("01ab"));
        assert_eq!(pg.names, names);
        assert_eq!((pg.issued_at, pg.not_after, pg.refused_at), (Some(100), Some(200), Some(150)));
        s.issue_service_cert(&issued("02cd", 170, 270), &audit(AuditAction::ServiceCertificateIssued)).await.unwrap();
        let pg = s.service_certs().await.unwrap().into_iter().find(|r| r.node == "db-1").unwrap();
        assert_eq!((pg.serial.as_deref(), pg.not_after, pg.refused_at, pg.refusal), (Some("02cd"), Some(270), None, None));
        let chain = s.audit().await.unwrap();
        let actions: Vec<&str> = chain.iter().map(|r| r.action.as_str()).collect();
        assert_eq!(
            actions,
            ["service certificate issued", "service certificate refused", "service certificate refused", "service certificate issued"]
        );
        verify_audit(&chain).unwrap();
    })
    .await;
}

/// The attack: a client goes away while its request's transaction begins, and the connection goes
/// back to the pool inside it. Before, on SQLite it kept the write lock: every later write waited
/// out the busy timeout and failed ("database is locked"), or, on that connection, could not begin
/// ("cannot start a transaction within a transaction"). Now such a connection is closed.
#[tokio::test]
async fn a_connection_left_inside_a_transaction_is_not_reused() {
    each_backend(|s| async move {
        s.leave_a_transaction_open().await.unwrap();
        // More writes than the pool has connections, one after the other: each gets a connection
        // the pool holds, the one returned inside its transaction among them.
        for i in 0..10 {
            let started = std::time::Instant::now();
            s.create_token(&token(&format!("t{i}"), "db-1"), &audit(AuditAction::TokenIssued))
                .await
                .unwrap_or_else(|e| panic!("write {i}: {e}"));
            assert!(started.elapsed() < std::time::Duration::from_secs(5), "write {i} waited {:?} for a lock", started.elapsed());
        }
        assert_eq!(s.tokens().await.unwrap().len(), 10);
    })
    .await;
}

/// Rotations of the signing key (ADR 0027): starts racing on one database have one winner, the
/// others are told which key is being rotated to; the rotation completes once, whichever replica
/// asks first; each node's first version announcing the key is recorded once. And the
/// controller list is replaced whole, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_rotations_have_one_winner_and_complete_once() {
    each_backend(|s| async move {
        let s = Arc::new(s);
        let tasks: Vec<_> = (0..8)
            .map(|i| {
                let s = s.clone();
                tokio::spawn(async move {
                    let r = trellis_store::RotationRecord {
                        next_key: format!("key{i}"),
                        kind: "signing-key".into(),
                        started_at: 100,
                        overlap_secs: 60,
                        completed_at: None,
                        completed_by: None,
                    };
                    s.start_rotation(&r, &audit(AuditAction::SigningKeyRotationStarted)).await.map(|()| r.next_key)
                })
            })
            .collect();
        let (mut won, mut told) = (Vec::new(), 0);
        for t in tasks {
            match t.await.unwrap() {
                Ok(key) => won.push(key),
                Err(StoreError::RotationInProgress(_)) => told += 1,
                other => panic!("{:?}: unexpected {other:?}", s.backend),
            }
        }
        assert_eq!((won.len(), told), (1, 7), "{:?}: one start wins", s.backend);
        let key = won.pop().unwrap();
        assert_eq!(s.rotations().await.unwrap().len(), 1);
        s.record_announced(&key, &[("db-1".into(), 4), ("api-1".into(), 7)]).await.unwrap();
        s.record_announced(&key, &[("db-1".into(), 5)]).await.unwrap();
        let announced = s.announced(&key).await.unwrap();
        assert_eq!((announced["db-1"], announced["api-1"]), (4, 7), "the first version announcing it is kept");
        let done = audit(AuditAction::SigningKeyRotationCompleted);
        assert!(s.complete_rotation(&key, 130, "evidence", &done).await.unwrap());
        assert!(!s.complete_rotation(&key, 131, "overlap", &done).await.unwrap(), "completed once");
        let r = &s.rotations().await.unwrap()[0];
        assert_eq!((r.completed_at, r.completed_by.as_deref()), (Some(130), Some("evidence")));
        // Completed, the next one may start.
        let next = trellis_store::RotationRecord { next_key: "key-next".into(), ..r.clone() };
        let next = trellis_store::RotationRecord { completed_at: None, completed_by: None, ..next };
        s.start_rotation(&next, &audit(AuditAction::SigningKeyRotationStarted)).await.unwrap();

        assert!(s.controllers().await.unwrap().is_empty());
        let list = vec!["c1:8443".to_string(), "c2:8443".into(), "c0:8443".into()];
        s.set_controllers(&list, 200, &audit(AuditAction::ControllerAdded)).await.unwrap();
        assert_eq!(s.controllers().await.unwrap(), list, "in the order given");
        s.set_controllers(&list[1..], 201, &audit(AuditAction::ControllerRemoved)).await.unwrap();
        assert_eq!(s.controllers().await.unwrap(), list[1..]);
        let records = s.audit().await.unwrap();
        assert_eq!(verify_audit(&records), Ok(records.len()), "every decision is in the chain");
    })
    .await;
}

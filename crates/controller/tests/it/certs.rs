//! Service certificates (ADR 0023), on SQLite and PostgreSQL: a node gets a certificate for
//! exactly the names the declaration gives it for a module it runs, under the services CA; each
//! refusal is performed and found in the audit chain; a service certificate is no node's
//! identity; a node that stops running the module is refused its renewal, the certificate before
//! it kept on record beside the refusal.

use std::sync::atomic::Ordering;

use trellis_controller::{Controller, Error, NodeIdentity, NodeRefusal, ServiceCertRefusal};
use trellis_pki::services::{inspect_service, service_csr, service_key_and_csr};
use trellis_pki::CsrRefusal;
use trellis_proto::{self as proto, AuditAction};

use super::{enrol_request, on_both, T0};

/// Enrols `node` (pending when `approval`), publishes, and returns its identity.
async fn enrol(c: &Controller, node: &str, approval: bool) -> (NodeIdentity, Vec<u8>) {
    let created = c
        .create_token(&proto::TokenRequest { node: node.into(), ttl_secs: 600, require_approval: approval, ..Default::default() })
        .await
        .unwrap();
    let enrolled = c.enrol(enrol_request(&created.token).0).await.unwrap();
    c.publish().await.unwrap();
    let der = trellis_pki::pem_to_der(&enrolled.node_cert_pem, "CERTIFICATE").unwrap();
    (c.authenticate_node(Some(&der)).await.unwrap(), der)
}

fn request(module: &str, csr_pem: String) -> proto::ServiceCertRequest {
    proto::ServiceCertRequest { module: module.into(), csr_pem }
}

/// The last audit record's action, subject and detail.
async fn last_audit(c: &Controller) -> (String, String, String) {
    let a = c.audit().await.unwrap();
    trellis_proto::audit::verify(&a).unwrap();
    let r = a.last().unwrap();
    (r.action.clone(), r.subject.clone(), r.detail.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_certified_for_exactly_its_names_and_every_refusal_is_audited() {
    on_both(|fx| async move {
        let c = &fx.c;
        let (db, _) = enrol(c, "db-1", false).await;
        let (api, _) = enrol(c, "api-1", false).await;

        // What db-1 is to hold: postgres and ssh, for their names; api-1 runs no module that asks.
        let list = c.service_cert_specs(&db).await.unwrap();
        let modules: Vec<&str> = list.certificates.iter().map(|s| s.module.as_str()).collect();
        assert_eq!(modules, ["postgres", "ssh"], "in the order of db-1's modules: {list:?}");
        let spec = &list.certificates[0];
        assert_eq!(spec.module, "postgres");
        assert_eq!(spec.dns, ["postgres.basic.mesh", "db-1.basic.mesh"]);
        assert_eq!(spec.ips.len(), 2, "its overlay IPv4 and IPv6 addresses: {spec:?}");
        assert_eq!(spec.uri, "spiffe://basic.mesh/module/postgres");
        assert_eq!((spec.group.as_deref(), spec.reload.as_deref()), (Some("postgres"), Some("postgresql.service")));
        assert_eq!(spec.lifetime_secs, 86_400);
        assert!(c.service_cert_specs(&api).await.unwrap().certificates.is_empty());
        let nodes = c.nodes().await.unwrap();
        let db_info = nodes.iter().find(|n| n.name == "db-1").unwrap();
        let declared_ips: Vec<String> = [db_info.ipv4.clone(), db_info.ipv6.clone()].into_iter().flatten().collect();
        assert_eq!(spec.ips, declared_ips, "the addresses the roster gives db-1");

        // Issued: exactly the declared names, whatever the CSR asked for.
        let (key, csr) = service_key_and_csr(&["postgres.basic.mesh".into()]).unwrap();
        let issued = c.sign_service_cert(&db, &request("postgres", csr)).await.unwrap();
        let info = inspect_service(&issued.cert_pem).unwrap();
        assert_eq!(info.dns, spec.dns);
        assert_eq!(info.ips.iter().map(|i| i.to_string()).collect::<Vec<_>>(), spec.ips);
        assert_eq!(info.uris, std::slice::from_ref(&spec.uri));
        assert_eq!((info.serial.as_str(), info.not_after), (issued.serial.as_str(), T0 + 86_400));
        assert_eq!(trellis_pki::cert_public_key(&issued.cert_pem).unwrap(), trellis_pki::services::public_key_of(&key).unwrap());
        let (action, subject, detail) = last_audit(c).await;
        assert_eq!((action.as_str(), subject.as_str()), (AuditAction::ServiceCertificateIssued.as_str(), "db-1/postgres"));
        assert!(detail.contains(&issued.serial) && detail.contains("postgres.basic.mesh"), "{detail}");

        // Refused, each audited: a name db-1 does not serve ...
        let refused = |e: Error| match e {
            Error::ServiceCert(r) => r,
            other => panic!("not a service certificate refusal: {other:?}"),
        };
        let csr = service_csr(&key, &["postgres.basic.mesh".into(), "api.basic.mesh".into()]).unwrap();
        let r = refused(c.sign_service_cert(&db, &request("postgres", csr)).await.unwrap_err());
        assert!(matches!(&r, ServiceCertRefusal::Csr(CsrRefusal::NameNotServed(n)) if n == "the name api.basic.mesh"), "{r:?}");
        assert_eq!(last_audit(c).await.0, AuditAction::ServiceCertificateRefused.as_str());
        // ... another node's module ...
        let (_, csr) = service_key_and_csr(&["postgres.basic.mesh".into()]).unwrap();
        let r = refused(c.sign_service_cert(&api, &request("postgres", csr)).await.unwrap_err());
        assert!(matches!(&r, ServiceCertRefusal::NotServed { node, module } if node == "api-1" && module == "postgres"), "{r:?}");
        let (action, subject, detail) = last_audit(c).await;
        assert_eq!((action.as_str(), subject.as_str()), (AuditAction::ServiceCertificateRefused.as_str(), "api-1/postgres"));
        assert_eq!(detail, r.to_string());
        // ... a module it runs that asks for none ...
        let (_, csr) = service_key_and_csr(&[]).unwrap();
        let r = refused(c.sign_service_cert(&db, &request("ping", csr)).await.unwrap_err());
        assert!(matches!(r, ServiceCertRefusal::NotServed { .. }), "ping asks for no certificate: {r:?}");
        // ... a CSR asking to be a CA ...
        let mut params = rcgen::CertificateParams::new(vec!["postgres.basic.mesh".to_string()]).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let csr = params.serialize_request(&rcgen::KeyPair::from_pem(&key).unwrap()).unwrap().pem().unwrap();
        let r = refused(c.sign_service_cert(&db, &request("postgres", csr)).await.unwrap_err());
        assert!(matches!(r, ServiceCertRefusal::Csr(CsrRefusal::CaRequested)), "{r:?}");
        assert_eq!(r.code(), "certificate_ca_requested");
        // ... from a node pending approval.
        let (op, _) = enrol(c, "op-1", true).await;
        let (_, csr) = service_key_and_csr(&[]).unwrap();
        let r = refused(c.sign_service_cert(&op, &request("postgres", csr)).await.unwrap_err());
        assert!(matches!(r, ServiceCertRefusal::Pending(ref n) if n == "op-1"), "{r:?}");
        assert!(matches!(c.service_cert_specs(&op).await.unwrap_err(), Error::Node(NodeRefusal::PendingApproval(_))));

        // A malformed module name is refused before anything is written.
        let before = c.audit().await.unwrap().len();
        let r = refused(c.sign_service_cert(&db, &request("../../etc", String::new())).await.unwrap_err());
        assert!(matches!(r, ServiceCertRefusal::Malformed));
        assert_eq!(c.audit().await.unwrap().len(), before, "nothing of a malformed request is audited");

        // Listed for operators, with the last refusal beside the certificate.
        let certs = c.service_certs().await.unwrap();
        let pg = certs.iter().find(|i| i.node == "db-1" && i.module == "postgres").unwrap();
        assert_eq!((pg.declared, pg.serial.as_deref(), pg.not_after), (true, Some(issued.serial.as_str()), Some(issued.not_after)));
        assert_eq!(pg.refusal.as_deref(), Some("the certificate signing request asks to be a CA; a service certificate never is"));
        assert!(pg.names.contains(&"spiffe://basic.mesh/module/postgres".to_string()), "{pg:?}");

        // Metrics: issued, refused by reason (a fixed set), the earliest expiry per node.
        let text = c.scrape().await;
        for line in [
            "trellis_service_certificates_issued_total 1".to_string(),
            "trellis_service_certificate_refusals_total{reason=\"name_not_served\"} 1".to_string(),
            "trellis_service_certificate_refusals_total{reason=\"not_served\"} 2".to_string(),
            "trellis_service_certificate_refusals_total{reason=\"ca_requested\"} 1".to_string(),
            "trellis_service_certificate_refusals_total{reason=\"pending\"} 1".to_string(),
            "trellis_service_certificate_refusals_total{reason=\"malformed\"} 1".to_string(),
            "trellis_service_certificate_refusals_total{reason=\"revoked\"} 0".to_string(),
            format!("trellis_service_certificate_earliest_expiry_timestamp_seconds{{node=\"db-1\"}} {}", issued.not_after),
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }

        // The live page marks db-1 once its certificate is within a quarter of its lifetime.
        let marked = |g: proto::MeshGraph| g.nodes.into_iter().find(|n| n.name == "db-1").unwrap().certificates_expiring;
        fx.clock.0.store(T0 + 86_400 * 3 / 4 - 1, Ordering::SeqCst);
        assert!(marked(c.graph().await.unwrap()).is_empty());
        fx.clock.0.store(T0 + 86_400 * 3 / 4, Ordering::SeqCst);
        assert_eq!(marked(c.graph().await.unwrap()), ["postgres"]);
        assert!(c.graph().await.unwrap().nodes.iter().filter(|n| n.name != "db-1").all(|n| n.certificates_expiring.is_empty()));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_certificate_is_no_node_identity_and_a_revoked_node_gets_none() {
    on_both(|fx| async move {
        let c = &fx.c;
        let (db, _) = enrol(c, "db-1", false).await;
        let (_, csr) = service_key_and_csr(&[]).unwrap();
        let issued = c.sign_service_cert(&db, &request("postgres", csr)).await.unwrap();
        // Presented where a node certificate is asked for: its chain ends at the mesh CA too, but
        // the services CA issued it.
        let der = trellis_pki::pem_to_der(&issued.cert_pem, "CERTIFICATE").unwrap();
        let refused = c.authenticate_node(Some(&der)).await.unwrap_err();
        assert!(matches!(&refused, Error::Node(NodeRefusal::ServiceCertificate(cn)) if cn == "postgres.basic.mesh"), "{refused:?}");
        assert_eq!(refused.code(), "service_certificate");

        // Revoked: refused at authentication, and a decision with the identity from before the
        // revocation is refused too, and audited.
        let node_der = {
            let (_, der) = enrol(c, "api-1", false).await;
            der
        };
        c.revoke("db-1").await.unwrap();
        c.revoke("api-1").await.unwrap();
        let r = c.authenticate_node(Some(&node_der)).await.unwrap_err();
        assert!(matches!(r, Error::Node(NodeRefusal::Revoked(_))), "a revoked node's requests stop at authentication: {r:?}");
        let (_, csr) = service_key_and_csr(&[]).unwrap();
        match c.sign_service_cert(&db, &request("postgres", csr)).await.unwrap_err() {
            Error::ServiceCert(ServiceCertRefusal::Revoked(n)) => assert_eq!(n, "db-1"),
            other => panic!("{other:?}"),
        }
        let (action, subject, _) = last_audit(c).await;
        assert_eq!((action.as_str(), subject.as_str()), (AuditAction::ServiceCertificateRefused.as_str(), "db-1/postgres"));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_stops_running_the_module_is_refused_its_renewal() {
    on_both(|fx| async move {
        let c = &fx.c;
        let (db, _) = enrol(c, "db-1", false).await;
        let (_, csr) = service_key_and_csr(&[]).unwrap();
        let first = c.sign_service_cert(&db, &request("postgres", csr)).await.unwrap();
        let files: Vec<proto::DeclFile> = trellis_testing::controller::lab_files("basic")
            .into_iter()
            .map(|mut f| {
                if f.path == "mesh.toml" {
                    // PostgreSQL moves from db-1 to op-1.
                    f.text = f.text.replace("modules = [\"postgres\", \"ssh\", \"ping\"]", "modules = [\"ssh\", \"ping\"]");
                    f.text = f.text.replace(
                        "name = \"op-1\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]",
                        "name = \"op-1\"\nnetworks = [\"lan\"]\nmodules = [\"postgres\", \"ping\"]",
                    );
                }
                f
            })
            .collect();
        assert_eq!(c.apply(&files, Some(1)).await.unwrap().revision, 2);
        let left: Vec<String> = c.service_cert_specs(&db).await.unwrap().certificates.into_iter().map(|s| s.module).collect();
        assert_eq!(left, ["ssh"], "postgres is no more to hold: the agent removes its files");
        let (_, csr) = service_key_and_csr(&[]).unwrap();
        let r = c.sign_service_cert(&db, &request("postgres", csr)).await.unwrap_err();
        assert!(matches!(r, Error::ServiceCert(ServiceCertRefusal::NotServed { .. })), "{r:?}");
        let pg = c.service_certs().await.unwrap().into_iter().find(|i| i.node == "db-1").unwrap();
        assert!(!pg.declared);
        assert_eq!(pg.serial.as_deref(), Some(first.serial.as_str()), "the last certificate stays on record");
        assert!(pg.refusal.as_deref().unwrap().contains("does not run module `postgres`"), "{pg:?}");
        // No expiry series for a certificate no longer declared.
        assert!(!c.scrape().await.contains("earliest_expiry_timestamp_seconds{node=\"db-1\"}"));
    })
    .await;
}

/// What a node reports holding is recorded beside the certificate, for the modules the
/// declaration gives it only: the serial on its disk, its expiry and why its last attempt failed
/// there (what the controller cannot see: a group missing on the host, a unit that would not
/// reload). Another node's module, an undeclared one, a module named twice and an oversized
/// report are not recorded; a report replaces the one before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_node_reports_holding_is_recorded_for_its_own_modules_only() {
    on_both(|fx| async move {
        let c = &fx.c;
        let (db, _) = enrol(c, "db-1", false).await;
        let (api, _) = enrol(c, "api-1", false).await;
        let (_, csr) = service_key_and_csr(&["postgres.basic.mesh".into()]).unwrap();
        let issued = c.sign_service_cert(&db, &request("postgres", csr)).await.unwrap();
        let held = |module: &str, serial: Option<&str>, error: Option<&str>| proto::HeldServiceCert {
            module: module.into(),
            serial: serial.map(str::to_string),
            not_after: Some(T0 + 600),
            error: error.map(str::to_string),
        };
        let failing = "certificate for postgres: group postgres does not exist on this host; the key of postgres is not written";
        let report = proto::HeldServiceCerts {
            certificates: vec![held("postgres", Some("0aa1"), Some(failing)), held("web", None, Some("not mine"))],
        };
        assert_eq!(c.report_held_certs(&db, &report).await.unwrap(), 1, "web is no module of db-1's");
        let entry =
            |list: Vec<proto::ServiceCertInfo>, node: &str, module: &str| list.into_iter().find(|i| i.node == node && i.module == module);
        let pg = entry(c.service_certs().await.unwrap(), "db-1", "postgres").unwrap();
        assert_eq!(pg.serial.as_deref(), Some(issued.serial.as_str()), "what the controller issued stays");
        assert_eq!((pg.held_serial.as_deref(), pg.held_not_after), (Some("0aa1"), Some(T0 + 600)));
        assert_eq!(pg.node_error.as_deref(), Some(failing));
        assert_eq!(pg.reported_at, Some(T0));
        assert!(entry(c.service_certs().await.unwrap(), "db-1", "web").is_none(), "nothing recorded for web");

        // api-1 cannot write about db-1's postgres, nor about a module it does not run.
        let other = proto::HeldServiceCerts { certificates: vec![held("postgres", None, Some("forged"))] };
        assert_eq!(c.report_held_certs(&api, &other).await.unwrap(), 0);
        assert!(entry(c.service_certs().await.unwrap(), "api-1", "postgres").is_none());
        assert_eq!(entry(c.service_certs().await.unwrap(), "db-1", "postgres").unwrap().node_error.as_deref(), Some(failing));

        // Refused whole: a module named twice, more than the bound, a serial that is no hex.
        let twice = proto::HeldServiceCerts { certificates: vec![held("postgres", None, None), held("postgres", None, Some("x"))] };
        let many = proto::HeldServiceCerts { certificates: (0..65).map(|i| held(&format!("m{i}"), None, None)).collect() };
        let serial = proto::HeldServiceCerts { certificates: vec![held("postgres", Some("<script>"), None)] };
        for bad in [twice, many, serial] {
            match c.report_held_certs(&db, &bad).await {
                Err(Error::ServiceCert(ServiceCertRefusal::Malformed)) => {}
                other => panic!("{bad:?} not refused as malformed: {other:?}"),
            }
        }
        // A long error is cut, its control characters shown escaped.
        let long = format!("\u{1b}[31m{}", "é".repeat(600));
        let report = proto::HeldServiceCerts { certificates: vec![held("postgres", Some(&issued.serial), Some(&long))] };
        c.report_held_certs(&db, &report).await.unwrap();
        let said = entry(c.service_certs().await.unwrap(), "db-1", "postgres").unwrap().node_error.unwrap();
        assert!(said.len() <= proto::certs::MAX_HELD_ERROR && !said.contains('\u{1b}'), "{said}");

        // Healed: the next report clears the error.
        let healed = proto::HeldServiceCerts { certificates: vec![held("postgres", Some(&issued.serial), None)] };
        c.report_held_certs(&db, &healed).await.unwrap();
        let pg = entry(c.service_certs().await.unwrap(), "db-1", "postgres").unwrap();
        assert_eq!((pg.held_serial.as_deref(), pg.node_error), (Some(issued.serial.as_str()), None));
    })
    .await;
}

/// What an ingress node reports of its Traefik (ADR 0026) shows in its status and the metrics:
/// recorded for a node the declaration makes an ingress node only, bounded, texts cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingress_nodes_report_shows_in_its_status_and_the_metrics() {
    on_both(|fx| async move {
        let c = &fx.c;
        let (db, _) = enrol(c, "db-1", false).await;
        let (api, _) = enrol(c, "api-1", false).await;
        // lab/basic with an exposure of api through db-1.
        let mut files = trellis_testing::controller::lab_files("basic");
        let mesh = files.iter_mut().find(|f| f.path == "mesh.toml").unwrap();
        mesh.text.push_str("\n[[expose]]\nname = \"shop\"\nhostnames = [\"shop.example.com\"]\nmodule = \"api\"\nport = 8000\nvia = [\"db-1\"]\ntls = \"none\"\nlisten = 80\n");
        let api_module = files.iter_mut().find(|f| f.path == "modules/api.toml").unwrap();
        api_module.text.push_str("\n[[allow]]\nproto = \"tcp\"\nports = [\"8000\"]\nfrom = [\"expose:shop\"]\n");
        c.apply(&files, None).await.unwrap_or_else(|e| panic!("{e}"));
        c.publish().await.unwrap();
        let report = proto::IngressReport {
            traefik: "running".into(),
            error: None,
            routers: vec![
                proto::IngressRouter { name: "shop-0".into(), status: "enabled".into(), errors: vec![] },
                proto::IngressRouter { name: "shop-1".into(), status: "disabled".into(), errors: vec![format!("\u{1b}[31m{}", "x".repeat(900))] },
            ],
            certificates: vec![proto::IngressCertificate { hostname: "shop.example.com".into(), not_after: T0 + 7200 }],
        };
        assert!(c.report_ingress(&db, &report).await.unwrap(), "db-1 is the exposure's ingress");
        assert!(!c.report_ingress(&api, &report).await.unwrap(), "api-1 is no ingress: nothing recorded");
        let too_many = proto::IngressReport { routers: vec![report.routers[0].clone(); 257], ..report.clone() };
        assert!(matches!(c.report_ingress(&db, &too_many).await, Err(Error::BadRequest(_))));

        let status = c.status().await.unwrap();
        let ingress = |n: &str| status.iter().find(|s| s.name == n).unwrap().ingress.clone();
        assert!(ingress("api-1").is_none());
        let i = ingress("db-1").expect("db-1's report in its status");
        assert_eq!((i.reported_at, i.report.routers.len()), (T0, 2));
        let error = &i.report.routers[1].errors[0];
        assert!(error.len() <= proto::ingress::MAX_INGRESS_TEXT && !error.contains('\u{1b}'), "{error}");
        let said = i.summary(T0 + 3600);
        assert!(said.starts_with("db-1: ingress: Traefik running, 1 of 2 router(s) enabled; shop-1 disabled: "), "{said}");
        assert!(said.ends_with(", certificates: shop.example.com (expires in 60 min)"), "{said}");
        let scraped = c.scrape().await;
        assert!(scraped.lines().any(|l| l == "trellis_ingress_routers{node=\"db-1\",status=\"enabled\"} 1"), "{scraped}");
        assert!(scraped.lines().any(|l| l == "trellis_ingress_routers{node=\"db-1\",status=\"disabled\"} 1"), "{scraped}");
        assert!(scraped.lines().any(|l| l.starts_with("trellis_ingress_certificate_expiry_seconds{node=\"db-1\"} ")), "{scraped}");
        // As a Prometheus server reads it: `promtool check metrics` on the classic format.
        if trellis_testing::can_run(trellis_testing::Need::Program("promtool")) {
            use std::io::Write;
            let mut p = std::process::Command::new("promtool")
                .args(["check", "metrics"])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            p.stdin.take().unwrap().write_all(trellis_proto::exposition::classic(&scraped).as_bytes()).unwrap();
            let out = p.wait_with_output().unwrap();
            assert!(out.status.success(), "promtool refused:\n{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        }
    })
    .await;
}

/// The review of 2026-12-02, finding 8: 500 refused service certificate requests from one node
/// grew the audit chain by 500 records in 10 s, and every issuance was audited however often a
/// node asked. Now a node's refusals are audited one by one up to five in ten minutes, then
/// counted (written as one record when the window closes), and past thirty it is turned away
/// unread; and a node gets four certificates for one module in a third of their lifetime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_cannot_grow_the_audit_chain_by_asking_for_certificates() {
    on_both(|fx| async move {
        let c = &fx.c;
        let (db, _) = enrol(c, "db-1", false).await;
        let (api, _) = enrol(c, "api-1", false).await;
        let before = c.audit().await.unwrap().len();
        let mut too_often = 0;
        for _ in 0..100 {
            match c.sign_service_cert(&db, &request("ping", "-".into())).await.unwrap_err() {
                Error::TooOften { node, wait, .. } => {
                    assert_eq!(node, "db-1");
                    assert!((1..=600).contains(&wait), "{wait}");
                    too_often += 1;
                }
                Error::ServiceCert(ServiceCertRefusal::NotServed { .. }) => {}
                e => panic!("{e:?}"),
            }
        }
        assert_eq!(c.audit().await.unwrap().len() - before, 5, "five refusals audited one by one");
        assert_eq!(too_often, 70, "past thirty refused, turned away unread");
        let scraped = c.scrape().await;
        assert!(scraped.lines().any(|l| l == "trellis_service_certificate_refusals_total{reason=\"too_often\"} 70"), "{scraped}");
        // Another node is not held back by db-1's refusals.
        assert!(matches!(c.sign_service_cert(&api, &request("ping", "-".into())).await.unwrap_err(), Error::ServiceCert(_)));
        // The window closes: what was counted is one record.
        fx.clock.0.store(T0 + 601, Ordering::SeqCst);
        c.write_refusals().await;
        let (action, subject, detail) = last_audit(c).await;
        assert_eq!((action.as_str(), subject.as_str()), (AuditAction::ServiceCertificateRefused.as_str(), "db-1"));
        assert!(
            detail.starts_with("95 more refused for node db-1 in the 600 s from ") && detail.contains("(70 of them turned away unread)"),
            "{detail}"
        );
        c.write_refusals().await;
        assert_eq!(last_audit(c).await.2, detail, "written once");

        // Four certificates for postgres in a third of a day, then the next is told when.
        for i in 0..4 {
            let (_, csr) = service_key_and_csr(&["postgres.basic.mesh".into()]).unwrap();
            c.sign_service_cert(&db, &request("postgres", csr)).await.unwrap_or_else(|e| panic!("issuance {i}: {e}"));
        }
        let (_, csr) = service_key_and_csr(&["postgres.basic.mesh".into()]).unwrap();
        match c.sign_service_cert(&db, &request("postgres", csr)).await.unwrap_err() {
            Error::TooOften { what, wait, .. } => assert_eq!((what.as_str(), wait), ("certificates for postgres", 28_800)),
            e => panic!("{e:?}"),
        }
        let issued = c.audit().await.unwrap().iter().filter(|r| r.action == AuditAction::ServiceCertificateIssued.as_str()).count();
        assert_eq!(issued, 4);
    })
    .await;
}

//! Service certificates as a TLS client sees them: the chain passes `openssl verify
//! -x509_strict` (Authority and Subject Key Identifiers everywhere), the leaf names exactly what
//! it was signed for, and the CSRs the CA must refuse are refused.

use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use trellis_pki::services::{inspect_service, service_csr, service_key_and_csr};
use trellis_pki::{create_ca, Ca, CsrRefusal, ServiceNames, ServicesCa};
use trellis_testing::cmd::{ok, run, sh};
use trellis_testing::{can_run, Need, TempDir};

fn names() -> ServiceNames {
    ServiceNames {
        dns: vec!["postgres.acme.mesh".into(), "db-1.acme.mesh".into()],
        ips: vec!["10.88.0.7".parse().unwrap(), "fd88::7".parse().unwrap()],
        uri: "spiffe://acme.mesh/module/postgres".into(),
    }
}

fn cas(now: SystemTime) -> (Ca, String, ServicesCa) {
    let pair = create_ca("acme", now, [1; 16]).unwrap();
    let ca = Ca::load(&pair.cert_pem, &pair.key_pem).unwrap();
    assert!(ca.allows_intermediate());
    let services = ca.services_ca("acme", now, [3; 16]).unwrap();
    let services = ServicesCa::load(&services.cert_pem, &services.key_pem).unwrap();
    (ca, pair.cert_pem, services)
}

#[test]
fn a_service_certificate_verifies_strictly_against_the_mesh_ca_through_the_services_ca() {
    let now = SystemTime::now();
    let (_, ca_pem, services) = cas(now);
    let (_key, csr) = service_key_and_csr(&["postgres.acme.mesh".into()]).unwrap();
    let issued = services.sign(&csr, &names(), now, Duration::from_secs(86400), [9; 16]).unwrap().unwrap();
    let info = inspect_service(&issued.cert_pem).unwrap();
    assert_eq!(info.dns, names().dns, "exactly the names allowed, though the CSR asked for one");
    assert_eq!(info.ips, names().ips);
    assert_eq!(info.uris, [names().uri]);
    assert_eq!(info.serial, issued.serial);
    assert!((info.not_after - issued.not_after).abs() <= 1);

    if !can_run(Need::Program("openssl")) {
        return;
    }
    let dir = TempDir::new("pki-services");
    std::fs::write(dir.join("ca.pem"), &ca_pem).unwrap();
    std::fs::write(dir.join("chain.pem"), services.cert_pem()).unwrap();
    std::fs::write(dir.join("cert.pem"), &issued.cert_pem).unwrap();
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let verify = |extra: &[&str]| {
        let mut args = vec!["verify", "-x509_strict", "-CAfile"];
        let (ca, chain, cert) = (p("ca.pem"), p("chain.pem"), p("cert.pem"));
        args.push(&ca);
        args.extend_from_slice(extra);
        args.extend_from_slice(&["-untrusted", &chain, &cert]);
        ok(sh("openssl", &args))
    };
    assert!(verify(&[]).contains(": OK"));
    assert!(verify(&["-verify_hostname", "postgres.acme.mesh", "-purpose", "sslserver"]).contains(": OK"));
    assert!(verify(&["-verify_ip", "10.88.0.7", "-purpose", "sslclient"]).contains(": OK"));
    // A name it does not carry does not verify.
    let (out, d) = run(sh(
        "openssl",
        &[
            "verify",
            "-x509_strict",
            "-CAfile",
            &p("ca.pem"),
            "-verify_hostname",
            "api.acme.mesh",
            "-untrusted",
            &p("chain.pem"),
            &p("cert.pem"),
        ],
    ));
    assert!(!out.status.success(), "a name the certificate does not carry verified\n{d}");
    // Without the intermediate the leaf does not chain to the mesh CA.
    let (out, d) = run(sh("openssl", &["verify", "-x509_strict", "-CAfile", &p("ca.pem"), &p("cert.pem")]));
    assert!(!out.status.success(), "the leaf verified without the services CA\n{d}");
    // Key identifiers are present on both the leaf and the intermediate.
    for f in ["cert.pem", "chain.pem"] {
        let text = ok(sh("openssl", &["x509", "-noout", "-text", "-in", &p(f)]));
        assert!(text.contains("X509v3 Authority Key Identifier"), "{f}:\n{text}");
        assert!(text.contains("X509v3 Subject Key Identifier"), "{f}:\n{text}");
    }
}

#[test]
fn a_csr_for_a_name_not_allowed_or_asking_to_be_a_ca_is_refused() {
    let now = SystemTime::now();
    let (_, _, services) = cas(now);
    let sign = |csr: &str| services.sign(csr, &names(), now, Duration::from_secs(60), [9; 16]).unwrap();
    let (key, csr) = service_key_and_csr(&["api.acme.mesh".into()]).unwrap();
    assert_eq!(sign(&csr).unwrap_err(), CsrRefusal::NameNotServed("the name api.acme.mesh".into()));
    // An allowed name with one that is not.
    let csr = service_csr(&key, &["postgres.acme.mesh".into(), "db-2.acme.mesh".into()]).unwrap();
    assert_eq!(sign(&csr).unwrap_err(), CsrRefusal::NameNotServed("the name db-2.acme.mesh".into()));
    // An address not the node's.
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.subject_alt_names.push(rcgen::SanType::IpAddress("10.88.0.8".parse::<IpAddr>().unwrap()));
    let k = rcgen::KeyPair::from_pem(&key).unwrap();
    let csr = params.serialize_request(&k).unwrap().pem().unwrap();
    assert_eq!(sign(&csr).unwrap_err(), CsrRefusal::NameNotServed("the address 10.88.0.8".into()));
    // CA:true requested.
    let mut params = rcgen::CertificateParams::new(vec!["postgres.acme.mesh".to_string()]).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let csr = params.serialize_request(&k).unwrap().pem().unwrap();
    assert_eq!(sign(&csr).unwrap_err(), CsrRefusal::CaRequested);
    // Garbage.
    assert!(matches!(sign("not a csr").unwrap_err(), CsrRefusal::Invalid(_)));
}

#[test]
fn a_service_certificate_is_told_apart_from_a_node_certificate_by_its_issuer() {
    let now = SystemTime::now();
    let (ca, _, services) = cas(now);
    let (_k, csr) = service_key_and_csr(&[]).unwrap();
    let service = services.sign(&csr, &names(), now, Duration::from_secs(60), [9; 16]).unwrap().unwrap();
    let (_k, csr) = trellis_pki::node_key_and_csr("db-1").unwrap();
    let node = ca.sign_node(&csr, "db-1", "acme", now, Duration::from_secs(60), [8; 16]).unwrap();
    let der = |pem: &str| trellis_pki::pem_to_der(pem, "CERTIFICATE").unwrap();
    assert!(trellis_pki::services::issued_by(&der(&node.cert_pem), &ca.subject_der()));
    assert!(!trellis_pki::services::issued_by(&der(&service.cert_pem), &ca.subject_der()));
}

#[test]
fn a_mesh_ca_made_with_path_length_zero_allows_no_services_ca() {
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    let cert = params.self_signed(&key).unwrap();
    let ca = Ca::load(&cert.pem(), &key.serialize_pem()).unwrap();
    assert!(!ca.allows_intermediate());
}

/// The review of 2026-12-02, finding 12: the services CA had no name constraints, so its key
/// could mint a certificate for any name (the controller's, a bank's) that every client trusting
/// the mesh CA took. Certified again for the mesh's scope, what it signed in the scope verifies
/// strictly (its earlier leaves too: same key, same subject), and a leaf its key signs for a
/// name, an address or a SPIFFE trust domain outside the scope does not.
#[test]
fn a_scoped_services_ca_certifies_nothing_outside_the_mesh() {
    if !can_run(Need::Program("openssl")) {
        return;
    }
    use trellis_pki::services::{name_constraints_of, ServiceScope};
    let now = SystemTime::now();
    let (ca, ca_pem, services) = cas(now);
    let scope =
        ServiceScope { domain: "acme.mesh".into(), prefixes: vec![("10.88.0.0".parse().unwrap(), 16), ("fd88::".parse().unwrap(), 64)] };
    let (_key, csr) = service_key_and_csr(&["postgres.acme.mesh".into()]).unwrap();
    let before = services.sign(&csr, &names(), now, Duration::from_secs(86400), [9; 16]).unwrap().unwrap();
    assert_eq!(name_constraints_of(services.cert_pem()), None, "made at init, before any domain is declared");
    let (scoped_pem, scoped) = services.scoped(&ca, "acme", &scope, now, [4; 16]).unwrap();
    assert_eq!(scoped.cert_pem(), scoped_pem);
    assert_eq!(name_constraints_of(&scoped_pem), Some(scope.name_constraints()));
    let dir = TempDir::new("pki-scoped");
    std::fs::write(dir.join("ca.pem"), &ca_pem).unwrap();
    std::fs::write(dir.join("chain.pem"), &scoped_pem).unwrap();
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let verifies = |cert: &str, extra: &[&str]| {
        std::fs::write(dir.join("cert.pem"), cert).unwrap();
        let (ca, chain, leaf) = (p("ca.pem"), p("chain.pem"), p("cert.pem"));
        let mut args = vec!["verify", "-x509_strict", "-CAfile", &ca];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["-untrusted", &chain, &leaf]);
        let (out, d) = run(sh("openssl", &args));
        (out.status.success(), d)
    };
    let (good, d) = verifies(&before.cert_pem, &["-verify_hostname", "postgres.acme.mesh"]);
    assert!(good, "a leaf signed before the scope still verifies\n{d}");
    let text = ok(sh("openssl", &["x509", "-noout", "-text", "-in", &p("chain.pem")]));
    assert!(text.contains("X509v3 Name Constraints: critical") && text.contains("DNS:acme.mesh") && !text.contains("URI:"), "{text}");
    // What a leaked key would sign: each outside the scope, each refused by the client.
    let outside = [
        ServiceNames { dns: vec!["controller.example.com".into()], ips: vec![], uri: "spiffe://acme.mesh/module/x".into() },
        ServiceNames {
            dns: vec!["x.acme.mesh".into()],
            ips: vec!["192.0.2.1".parse().unwrap()],
            uri: "spiffe://acme.mesh/module/x".into(),
        },
        ServiceNames { dns: vec!["acme.mesh.evil.example".into()], ips: vec![], uri: "spiffe://acme.mesh/module/x".into() },
    ];
    for n in outside {
        let (_k, csr) = service_key_and_csr(&n.dns).unwrap();
        let leaf = services.sign(&csr, &n, now, Duration::from_secs(86400), [5; 16]).unwrap().unwrap();
        let (good, d) = verifies(&leaf.cert_pem, &[]);
        assert!(!good, "{n:?} verified under the scoped services CA\n{d}");
        assert!(d.contains("violation") || d.contains("name constraint"), "{n:?}: {d}");
    }
}

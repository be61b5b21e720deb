//! Node and server certificates under strict verification (issue 21, item 6). Before, they carried
//! no Authority Key Identifier, which RFC 5280 requires of a certificate that is not self-signed,
//! and `openssl verify -x509_strict` refused them; and the CA claimed CRL Sign with no CRL
//! published.

use std::time::{Duration, SystemTime};

use trellis_pki::{create_ca, node_key_and_csr, Ca};
use trellis_testing::cmd::{ok, sh};
use trellis_testing::{can_run, Need, TempDir};

#[test]
fn node_and_server_certificates_pass_strict_verification_and_the_ca_claims_no_crl_sign() {
    if !can_run(Need::Program("openssl")) {
        return;
    }
    let now = SystemTime::now();
    let pair = create_ca("acme", now, [1; 16]).unwrap();
    let ca = Ca::load(&pair.cert_pem, &pair.key_pem).unwrap();
    let (_key, csr) = node_key_and_csr("db-1").unwrap();
    let node = ca.sign_node(&csr, "db-1", "acme", now, Duration::from_secs(86400), [2; 16]).unwrap();
    let server = ca
        .server_cert(
            &["127.0.0.1".into(), "controller.acme.example".into()],
            now,
            std::time::Duration::from_secs(trellis_pki::SERVER_CERT_SECS),
            [3; 16],
        )
        .unwrap();

    let dir = TempDir::new("pki-strict");
    std::fs::write(dir.join("ca.pem"), &pair.cert_pem).unwrap();
    std::fs::write(dir.join("node.pem"), &node.cert_pem).unwrap();
    std::fs::write(dir.join("server.pem"), &server.cert_pem).unwrap();
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let verify = |cert: &str, extra: &[&str]| {
        let ca = p("ca.pem");
        let mut args = vec!["verify", "-x509_strict", "-CAfile", &ca];
        args.extend_from_slice(extra);
        let cert = p(cert);
        args.push(&cert);
        ok(sh("openssl", &args))
    };
    assert!(verify("node.pem", &["-purpose", "sslclient"]).contains(": OK"));
    assert!(verify("server.pem", &["-purpose", "sslserver", "-verify_ip", "127.0.0.1"]).contains(": OK"));
    assert!(verify("server.pem", &["-purpose", "sslserver", "-verify_hostname", "controller.acme.example"]).contains(": OK"));
    for f in ["node.pem", "server.pem"] {
        let text = ok(sh("openssl", &["x509", "-noout", "-text", "-in", &p(f)]));
        assert!(text.contains("X509v3 Authority Key Identifier") && text.contains("X509v3 Subject Key Identifier"), "{f}:\n{text}");
    }
    let text = ok(sh("openssl", &["x509", "-noout", "-text", "-in", &p("ca.pem")]));
    assert!(text.contains("X509v3 Subject Key Identifier"), "{text}");
    assert!(text.contains("Certificate Sign") && !text.contains("CRL Sign"), "the CA publishes no CRL:\n{text}");
}

/// Clock skew (issue 21, item 3): what an agent checks on its own clock, the controller's server
/// certificate under the mesh CA, is valid for a clock up to five minutes behind the one that made
/// them (a node enrolling right after `trellis init` with its clock that far behind), and not for
/// one further behind. Node and service certificates keep a minute of grace: only the controller
/// checks a node certificate, and a longer grace would move a short-lived certificate's renewal
/// (two thirds of its validity from its start) before its issue.
#[test]
fn the_server_certificate_and_the_ca_are_valid_for_a_clock_five_minutes_behind() {
    if !can_run(Need::Program("openssl")) {
        return;
    }
    let now = SystemTime::now();
    let pair = create_ca("acme", now, [1; 16]).unwrap();
    let ca = Ca::load(&pair.cert_pem, &pair.key_pem).unwrap();
    let server =
        ca.server_cert(&["127.0.0.1".into()], now, std::time::Duration::from_secs(trellis_pki::SERVER_CERT_SECS), [3; 16]).unwrap();
    let dir = TempDir::new("pki-skew");
    std::fs::write(dir.join("ca.pem"), &pair.cert_pem).unwrap();
    std::fs::write(dir.join("server.pem"), &server.cert_pem).unwrap();
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let unix = now.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs() as i64;
    let verify_at = |behind: i64| {
        let at = (unix - behind).to_string();
        let (ca, cert) = (p("ca.pem"), p("server.pem"));
        sh("openssl", &["verify", "-x509_strict", "-purpose", "sslserver", "-attime", &at, "-CAfile", &ca, &cert])
    };
    assert!(ok(verify_at(295)).contains(": OK"), "4 min 55 s behind");
    let late = verify_at(330).output().unwrap();
    let said = String::from_utf8_lossy(&late.stdout).into_owned() + &String::from_utf8_lossy(&late.stderr);
    assert!(!late.status.success() && said.contains("not yet valid"), "5 min 30 s behind: {said}");
}

/// A CA rotation's certificates (ADR 0029): the server certificate issued by the next CA is
/// verified by a client that trusts only the current CA, through the cross-certificate, and by
/// one that trusts only the next CA, without it; by openssl strictly, and by rustls (what agents
/// and the admin CLI use). Without the cross-certificate a client of the current CA refuses it.
/// The services CA made under the next CA (a new key) certifies services that verify under the
/// next CA.
#[test]
fn a_certificate_of_the_next_ca_is_verified_through_the_cross_certificate_by_a_client_of_the_current_one() {
    use rustls::client::danger::ServerCertVerifier;
    use rustls::pki_types::{ServerName, UnixTime};
    let now = SystemTime::now();
    let old_pair = create_ca("trellis", now, [1; 16]).unwrap();
    let old = Ca::load(&old_pair.cert_pem, &old_pair.key_pem).unwrap();
    let new_pair = trellis_pki::create_next_ca("trellis", now, [9; 16]).unwrap();
    let new = Ca::load(&new_pair.cert_pem, &new_pair.key_pem).unwrap();
    assert_ne!(old.subject_der(), new.subject_der(), "two CAs of one mesh are told apart by their subject");
    let cross = old.cross_certify(&new, [4; 16]).unwrap();
    let server = new.server_cert(&["127.0.0.1".into()], now, Duration::from_secs(3600), [3; 16]).unwrap();
    let verifier = |roots_pem: &str| {
        let mut roots = rustls::RootCertStore::empty();
        for c in trellis_pki::tls::certificates(roots_pem).unwrap() {
            roots.add(c).unwrap();
        }
        rustls::client::WebPkiServerVerifier::builder_with_provider(std::sync::Arc::new(roots), trellis_pki::tls::provider())
            .build()
            .unwrap()
    };
    let leaf = trellis_pki::tls::certificates(&server.cert_pem).unwrap().remove(0);
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let at = UnixTime::now();
    let presented = trellis_pki::tls::certificates(&format!("{cross}{}{}", new_pair.cert_pem, old_pair.cert_pem)).unwrap();
    for (who, roots) in [("a client of the current CA", &old_pair.cert_pem), ("a client of the next CA", &new_pair.cert_pem)] {
        verifier(roots).verify_server_cert(&leaf, &presented, &name, &[], at).unwrap_or_else(|e| panic!("{who}: {e}"));
    }
    let without_cross = trellis_pki::tls::certificates(&new_pair.cert_pem).unwrap();
    assert!(verifier(&old_pair.cert_pem).verify_server_cert(&leaf, &without_cross, &name, &[], at).is_err());
    // What trellis's clients of the controller use takes the same paths...
    for roots in [&old_pair.cert_pem, &new_pair.cert_pem] {
        trellis_pki::tls::ControllerVerifier::new(roots).unwrap().verify_server_cert(&leaf, &presented, &name, &[], at).unwrap();
    }
    // ...and not a service certificate naming the controller's address, chained through the
    // services CA: the attack of a node holding one, performed. A plain verifier takes it.
    let services_pair = old.services_ca("trellis", now, [5; 16]).unwrap();
    let services = trellis_pki::ServicesCa::load(&services_pair.cert_pem, &services_pair.key_pem).unwrap();
    let (_, csr) = trellis_pki::services::service_key_and_csr(&["db-1.svc.example".into()]).unwrap();
    let as_controller = trellis_pki::ServiceNames {
        dns: vec!["db-1.svc.example".into()],
        ips: vec!["127.0.0.1".parse().unwrap()],
        uri: "spiffe://basic.mesh/module/postgres".into(),
    };
    let impostor = services.sign(&csr, &as_controller, now, Duration::from_secs(3600), [8; 16]).unwrap().unwrap();
    let impostor = trellis_pki::tls::certificates(&impostor.cert_pem).unwrap().remove(0);
    let its_chain = trellis_pki::tls::certificates(&services_pair.cert_pem).unwrap();
    verifier(&old_pair.cert_pem).verify_server_cert(&impostor, &its_chain, &name, &[], at).expect("a plain verifier takes it");
    let refused =
        trellis_pki::tls::ControllerVerifier::new(&old_pair.cert_pem).unwrap().verify_server_cert(&impostor, &its_chain, &name, &[], at);
    assert!(refused.is_err(), "a service certificate passed as the controller");

    if !can_run(Need::Program("openssl")) {
        return;
    }
    let dir = TempDir::new("pki-rotation");
    for (f, pem) in
        [("old.pem", &old_pair.cert_pem), ("new.pem", &new_pair.cert_pem), ("cross.pem", &cross), ("server.pem", &server.cert_pem)]
    {
        std::fs::write(dir.join(f), pem).unwrap();
    }
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let (old_ca, new_ca, cross_ca, leaf_file) = (p("old.pem"), p("new.pem"), p("cross.pem"), p("server.pem"));
    let strict = ["verify", "-x509_strict", "-purpose", "sslserver", "-verify_ip", "127.0.0.1"];
    let with = |extra: &[&str]| {
        let mut args = strict.to_vec();
        args.extend_from_slice(extra);
        args.push(&leaf_file);
        sh("openssl", &args)
    };
    assert!(ok(with(&["-CAfile", &old_ca, "-untrusted", &cross_ca])).contains(": OK"));
    assert!(ok(with(&["-CAfile", &new_ca])).contains(": OK"));
    assert!(!with(&["-CAfile", &old_ca]).output().unwrap().status.success(), "no path from the current CA without the cross-certificate");
    let text = ok(sh("openssl", &["x509", "-noout", "-text", "-in", &cross_ca]));
    assert!(text.contains("X509v3 Authority Key Identifier") && text.contains("CA:TRUE"), "{text}");

    // The services CA of the rotation, a new key under the next CA: a service certificate it
    // signs verifies strictly against the next CA through it.
    let services_pair = new.services_ca("trellis", now, [5; 16]).unwrap();
    let services = trellis_pki::ServicesCa::load(&services_pair.cert_pem, &services_pair.key_pem).unwrap();
    let (_, csr) = trellis_pki::services::service_key_and_csr(&["db-1.svc.example".into()]).unwrap();
    let names =
        trellis_pki::ServiceNames { dns: vec!["db-1.svc.example".into()], ips: vec![], uri: "spiffe://basic.mesh/module/postgres".into() };
    let leaf = services.sign(&csr, &names, now, Duration::from_secs(3600), [6; 16]).unwrap().unwrap();
    std::fs::write(dir.join("services.pem"), &services_pair.cert_pem).unwrap();
    std::fs::write(dir.join("overlap-chain.pem"), format!("{}{cross}", services_pair.cert_pem)).unwrap();
    std::fs::write(dir.join("service.pem"), &leaf.cert_pem).unwrap();
    let (svc_ca, overlap, svc) = (p("services.pem"), p("overlap-chain.pem"), p("service.pem"));
    assert!(ok(sh("openssl", &["verify", "-x509_strict", "-CAfile", &new_ca, "-untrusted", &svc_ca, &svc])).contains(": OK"));
    // A client of the current CA alone cannot: the current CA allows one CA below it, and the
    // path would pass through two (the services CA and the cross-certificate). That is why nodes
    // are given both CAs in `ca.pem` with the bundle that announces the rotation.
    let out = sh("openssl", &["verify", "-x509_strict", "-CAfile", &old_ca, "-untrusted", &overlap, &svc]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("path length constraint exceeded"), "{out:?}");
    // A services CA whose key is not its certificate's is refused.
    assert!(trellis_pki::ServicesCa::load(&services_pair.cert_pem, &new_pair.key_pem).is_err());
}

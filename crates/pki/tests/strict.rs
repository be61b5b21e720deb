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
    let server = ca.server_cert(&["127.0.0.1".into(), "controller.acme.example".into()], now, [3; 16]).unwrap();

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

/// Clock skew (issue 21, item 3): a node or service certificate is taken by a clock up to five
/// minutes behind the controller's that issued it, and not by one further behind. Before, a
/// node certificate started a minute before its issue, so a peer whose clock ran two minutes
/// behind refused it as not yet valid.
#[test]
fn certificates_are_valid_for_a_clock_five_minutes_behind_the_issuer() {
    if !can_run(Need::Program("openssl")) {
        return;
    }
    let now = SystemTime::now();
    let pair = create_ca("acme", now, [1; 16]).unwrap();
    let ca = Ca::load(&pair.cert_pem, &pair.key_pem).unwrap();
    let (_key, csr) = node_key_and_csr("db-1").unwrap();
    let node = ca.sign_node(&csr, "db-1", "acme", now, Duration::from_secs(86400), [2; 16]).unwrap();
    let services = ca.services_ca("acme", now, [4; 16]).unwrap();
    let services = trellis_pki::ServicesCa::load(&services.cert_pem, &services.key_pem).unwrap();
    let (_skey, scsr) = node_key_and_csr("db-1").unwrap();
    let names =
        trellis_pki::ServiceNames { dns: vec!["postgres.acme.mesh".into()], ips: vec![], uri: "spiffe://acme.mesh/module/postgres".into() };
    let service = services.sign(&scsr, &names, now, Duration::from_secs(3600), [5; 16]).unwrap().unwrap();

    let dir = TempDir::new("pki-skew");
    std::fs::write(dir.join("ca.pem"), &pair.cert_pem).unwrap();
    std::fs::write(dir.join("services-ca.pem"), services.cert_pem()).unwrap();
    std::fs::write(dir.join("node.pem"), &node.cert_pem).unwrap();
    std::fs::write(dir.join("service.pem"), &service.cert_pem).unwrap();
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let unix = now.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs() as i64;
    let verify_at = |cert: &str, behind: i64| {
        let at = (unix - behind).to_string();
        let (ca, untrusted, cert) = (p("ca.pem"), p("services-ca.pem"), p(cert));
        sh("openssl", &["verify", "-x509_strict", "-attime", &at, "-CAfile", &ca, "-untrusted", &untrusted, &cert])
    };
    for cert in ["node.pem", "service.pem"] {
        assert!(ok(verify_at(cert, 295)).contains(": OK"), "{cert} 4 min 55 s behind");
        let late = verify_at(cert, 330).output().unwrap();
        let said = String::from_utf8_lossy(&late.stdout).into_owned() + &String::from_utf8_lossy(&late.stderr);
        assert!(!late.status.success() && said.contains("not yet valid"), "{cert} 5 min 30 s behind: {said}");
    }
}

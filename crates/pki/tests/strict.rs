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
    let server = ca.server_cert(&["127.0.0.1".into(), "controller.acme.example".into()], now, std::time::Duration::from_secs(trellis_pki::SERVER_CERT_SECS), [3; 16]).unwrap();

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
    let server = ca.server_cert(&["127.0.0.1".into()], now, std::time::Duration::from_secs(trellis_pki::SERVER_CERT_SECS), [3; 16]).unwrap();
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

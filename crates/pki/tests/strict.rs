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

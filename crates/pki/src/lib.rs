//! The mesh CA: creating it, certificates for the controller and for nodes (from CSRs whose
//! names the CA decides), the node's own key and CSR, fingerprints and inspection. No IO, no
//! clock and no randomness of its own but rcgen's key generation: `now` and each certificate's
//! serial are arguments.

pub mod services;
pub mod tls;

pub use services::{CsrRefusal, ServiceNames, ServicesCa};

use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose, PublicKeyData, SanType, SerialNumber,
};
use sha2::{Digest, Sha256};
use time::OffsetDateTime;

#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("certificate signing request is not valid: {0}")]
    BadCsr(String),
    #[error("cannot parse certificate: {0}")]
    BadCert(String),
    #[error("cannot parse private key: {0}")]
    BadKey(String),
    #[error("cannot create certificate: {0}")]
    Sign(#[from] rcgen::Error),
}

/// A certificate and its private key, both PEM.
#[derive(Clone)]
pub struct Pair {
    pub cert_pem: String,
    pub key_pem: String,
}

fn odt(t: SystemTime) -> OffsetDateTime {
    OffsetDateTime::from(t)
}

/// How long the controller's server certificate lives unless configured otherwise: five years.
pub const SERVER_CERT_SECS: u64 = 5 * 365 * 86400;
/// How far before its making a server certificate starts: clocks this far behind still take it.
pub const SERVER_BACKDATE_SECS: u64 = 300;

/// Whether the controller's server certificate, valid from `not_before` (backdated by
/// [`SERVER_BACKDATE_SECS`]) to `not_after`, is due for renewal at `now`: two thirds of its
/// lifetime, counted from when it was made, have passed; or `now` is before its start (it was
/// made while the clock was ahead, and every agent would refuse it until then).
pub fn server_renewal_due(not_before: i64, not_after: i64, now: i64) -> bool {
    let made = not_before + SERVER_BACKDATE_SECS as i64;
    now < not_before || now >= made + (not_after - made) * 2 / 3
}

/// A certificate's serial number from 16 random bytes (the caller's randomness).
fn serial(mut b: [u8; 16]) -> SerialNumber {
    // Positive, and with no leading zero byte, so that its DER encoding (which x509 parsers
    // report) is these exact 16 bytes.
    b[0] = (b[0] & 0x7f) | 0x40;
    SerialNumber::from_slice(&b)
}

/// Creates the mesh CA: ECDSA P-256, valid for ten years from `now`, its serial number made from
/// 16 random bytes. Its path length allows one intermediate below it: the services CA. It signs
/// certificates only: no CRL is published, so it claims no CRL Sign (RFC 5280, 4.2.1.3).
pub fn create_ca(mesh: &str, now: SystemTime, random: [u8; 16]) -> Result<Pair, PkiError> {
    create_ca_named(&format!("trellis mesh CA {mesh}"), now, random)
}

/// The mesh CA that replaces the current one (`trellis rotate ca`, ADR 0029): as
/// [`create_ca`], its common name told apart from every earlier one by the start of its serial
/// (a certificate names its issuer by subject, so two CAs of one mesh must not share one).
pub fn create_next_ca(mesh: &str, now: SystemTime, random: [u8; 16]) -> Result<Pair, PkiError> {
    let mut shown = random;
    shown[0] = (shown[0] & 0x7f) | 0x40;
    create_ca_named(&format!("trellis mesh CA {mesh} {}", hex::encode(&shown[..4])), now, random)
}

fn create_ca_named(common_name: &str, now: SystemTime, random: [u8; 16]) -> Result<Pair, PkiError> {
    let key = KeyPair::generate()?;
    let params = ca_params(common_name, 1, now, 10 * 365, random);
    let cert = params.self_signed(&key)?;
    Ok(Pair { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
}

/// A CA's certificate parameters: `common_name` of organisation trellis, at most `path_len` CAs
/// below it, certificate signing only (no CRL is published), from five minutes before `now` for
/// `days`, its serial made from 16 random bytes.
pub(crate) fn ca_params(common_name: &str, path_len: u8, now: SystemTime, days: u64, random: [u8; 16]) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn.push(DnType::OrganizationName, "trellis");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(path_len));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
    params.not_before = odt(now - Duration::from_secs(300));
    params.not_after = odt(now + Duration::from_secs(days * 86400));
    params.serial_number = Some(serial(random));
    params
}

/// The mesh CA, loaded for signing.
pub struct Ca {
    cert_pem: String,
    cert_der: Vec<u8>,
    issuer: Issuer<'static, KeyPair>,
}

impl Ca {
    /// The CA of this certificate and key; refused when the key is not the certificate's (two
    /// files of a CA pair replaced one at a time would otherwise sign under a name they do not
    /// hold).
    pub fn load(cert_pem: &str, key_pem: &str) -> Result<Ca, PkiError> {
        let key = KeyPair::from_pem(key_pem).map_err(|e| PkiError::BadKey(e.to_string()))?;
        let cert_der = pem_to_der(cert_pem, "CERTIFICATE")?;
        if cert_public_key(cert_pem)? != key.der_bytes() {
            return Err(PkiError::BadKey("the key is not the one the CA certificate certifies".into()));
        }
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)?;
        // Written again from its DER: what is delivered to nodes (and put in `trust.toml`) is
        // one certificate in one form, whatever the file held around it.
        Ok(Ca { cert_pem: der_to_pem(&cert_der, "CERTIFICATE"), cert_der, issuer })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// SHA-256 of the CA certificate (DER): what enrolment tokens carry.
    pub fn fingerprint(&self) -> [u8; 32] {
        fingerprint(&self.cert_der)
    }

    /// The DER of the CA's own certificate.
    pub fn cert_der(&self) -> &[u8] {
        &self.cert_der
    }

    /// The next CA's certificate certified by this one (a cross-certificate, ADR 0029): the
    /// same subject, key and extensions as `next`'s own, issued by this CA. A client that trusts
    /// only this CA follows it to a certificate `next` issued; one that trusts `next` needs none.
    /// Valid as long as `next` is, and no longer than this CA.
    pub fn cross_certify(&self, next: &Ca, random: [u8; 16]) -> Result<String, PkiError> {
        // The subject is made as `create_ca_named` made it, so its DER is the same.
        let theirs = next.inspect()?;
        let mut params = ca_params(&theirs.common_name, 1, SystemTime::UNIX_EPOCH, 0, random);
        let at = |t: i64| OffsetDateTime::from_unix_timestamp(t).map_err(|e| PkiError::BadCert(e.to_string()));
        params.not_before = at(theirs.not_before)?;
        params.not_after = at(theirs.not_after.min(self.inspect()?.not_after))?;
        params.use_authority_key_identifier_extension = true;
        Ok(params.signed_by(next.issuer.key(), &self.issuer)?.pem())
    }

    /// What this CA's certificate says.
    pub fn inspect(&self) -> Result<CertInfo, PkiError> {
        inspect_der(&self.cert_der)
    }

    /// The controller's TLS certificate, naming every advertised host (IP address or DNS name),
    /// valid from five minutes before `now` for `lifetime`, its serial number made from 16
    /// random bytes.
    pub fn server_cert(&self, hosts: &[String], now: SystemTime, lifetime: Duration, random: [u8; 16]) -> Result<Pair, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        for h in hosts {
            params.subject_alt_names.push(match h.parse::<std::net::IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(h.clone().try_into()?),
            });
        }
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "trellis controller");
        params.distinguished_name = dn;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        // Authority and Subject Key Identifiers: RFC 5280 says a certificate not self-signed
        // MUST carry the first, and `openssl verify -x509_strict` refuses one without it; rcgen
        // writes the second (and `CA:FALSE`) for a certificate explicitly no CA.
        params.use_authority_key_identifier_extension = true;
        params.is_ca = IsCa::ExplicitNoCa;
        params.not_before = odt(now - Duration::from_secs(SERVER_BACKDATE_SECS));
        params.not_after = odt(now + lifetime);
        params.serial_number = Some(serial(random));
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Pair { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
    }

    /// Signs a node's CSR. The signature on the CSR proves possession of the key; every name
    /// in it is ignored: the certificate names the node the controller says it is. Its serial
    /// number is made from 16 random bytes.
    pub fn sign_node(
        &self,
        csr_pem: &str,
        node: &str,
        mesh: &str,
        now: SystemTime,
        lifetime: Duration,
        random: [u8; 16],
    ) -> Result<IssuedCert, PkiError> {
        let csr = CertificateSigningRequestParams::from_pem(csr_pem).map_err(|e| PkiError::BadCsr(e.to_string()))?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, node);
        dn.push(DnType::OrganizationalUnitName, format!("mesh {mesh}"));
        params.distinguished_name = dn;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        params.is_ca = IsCa::ExplicitNoCa;
        // A minute of grace for clocks that run slightly behind the controller's. Only the
        // controller checks a node certificate, on its own clock; a longer grace would move the
        // renewal (two thirds of the validity from its start) before the issue for short lifetimes.
        params.not_before = odt(now - Duration::from_secs(60));
        let not_after = now + lifetime;
        params.not_after = odt(not_after);
        let serial = serial(random);
        params.serial_number = Some(serial.clone());
        let signed = CertificateSigningRequestParams { params, public_key: csr.public_key }.signed_by(&self.issuer)?;
        Ok(IssuedCert {
            cert_pem: signed.pem(),
            serial: hex::encode(serial.to_bytes()),
            not_after: not_after.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64),
        })
    }
}

#[derive(Clone, Debug)]
pub struct IssuedCert {
    pub cert_pem: String,
    /// Lower-case hex of the serial number.
    pub serial: String,
    /// Unix seconds.
    pub not_after: i64,
}

/// A node's TLS key (PEM), made on the node.
pub fn node_key() -> Result<String, PkiError> {
    Ok(KeyPair::generate()?.serialize_pem())
}

/// A node's TLS key and a CSR for it, made on the node.
pub fn node_key_and_csr(node: &str) -> Result<(String, String), PkiError> {
    let key = KeyPair::generate()?;
    let csr = csr_for(&key, node)?;
    Ok((key.serialize_pem(), csr))
}

/// A CSR for an existing key (renewal keeps the key the node holds).
pub fn csr_from_key(key_pem: &str, node: &str) -> Result<String, PkiError> {
    let key = KeyPair::from_pem(key_pem).map_err(|e| PkiError::BadKey(e.to_string()))?;
    csr_for(&key, node)
}

fn csr_for(key: &KeyPair, node: &str) -> Result<String, PkiError> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, node);
    params.distinguished_name = dn;
    Ok(params.serialize_request(key)?.pem()?)
}

/// The public key a CSR asks to have certified (the bits of its subject public key), once the
/// CSR's signature has shown that its sender holds the private key.
pub fn csr_public_key(csr_pem: &str) -> Result<Vec<u8>, PkiError> {
    let csr = CertificateSigningRequestParams::from_pem(csr_pem).map_err(|e| PkiError::BadCsr(e.to_string()))?;
    Ok(csr.public_key.der_bytes().to_vec())
}

/// The public key a certificate certifies, in the same form as [`csr_public_key`].
pub fn cert_public_key(cert_pem: &str) -> Result<Vec<u8>, PkiError> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let der = pem_to_der(cert_pem, "CERTIFICATE")?;
    let (_, cert) = X509Certificate::from_der(&der).map_err(|e| PkiError::BadCert(e.to_string()))?;
    Ok(cert.public_key().subject_public_key.data.to_vec())
}

/// Whether `key_pem` is the private key of the public key `cert_pem` certifies.
pub fn key_matches_cert(key_pem: &str, cert_pem: &str) -> bool {
    let Ok(key) = KeyPair::from_pem(key_pem) else { return false };
    cert_public_key(cert_pem).is_ok_and(|public| public == key.der_bytes())
}

/// Whether the certificate `cert_pem` names the subject of the CA certificate `ca_pem` as its
/// issuer (which of two mesh CAs issued a node's certificate, during a rotation).
pub fn issued_by_ca(cert_pem: &str, ca_pem: &str) -> Result<bool, PkiError> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let ca_der = pem_to_der(ca_pem, "CERTIFICATE")?;
    let (_, ca) = X509Certificate::from_der(&ca_der).map_err(|e| PkiError::BadCert(e.to_string()))?;
    Ok(services::issued_by(&pem_to_der(cert_pem, "CERTIFICATE")?, ca.subject().as_raw()))
}

pub fn fingerprint(der: &[u8]) -> [u8; 32] {
    Sha256::digest(der).into()
}

/// The DER of the first PEM block with this label.
pub fn pem_to_der(pem_text: &str, label: &str) -> Result<Vec<u8>, PkiError> {
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let start = pem_text.find(&begin).ok_or_else(|| PkiError::BadCert(format!("no {label} block")))? + begin.len();
    let stop = pem_text[start..].find(&end).ok_or_else(|| PkiError::BadCert(format!("unterminated {label} block")))? + start;
    let b64: String = pem_text[start..stop].chars().filter(|c| !c.is_whitespace()).collect();
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(b64).map_err(|_| PkiError::BadCert(format!("{label} block is not base64")))
}

/// A PEM block of `label` for `der`: base64 in lines of 64, each ending in a newline.
pub fn der_to_pem(der: &[u8], label: &str) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

/// What a certificate says, for display and checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertInfo {
    pub common_name: String,
    pub serial: String,
    pub not_before: i64,
    pub not_after: i64,
    pub fingerprint: [u8; 32],
}

pub fn inspect_der(der: &[u8]) -> Result<CertInfo, PkiError> {
    use x509_parser::prelude::*;
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| PkiError::BadCert(e.to_string()))?;
    let common_name = cert.subject().iter_common_name().next().and_then(|cn| cn.as_str().ok()).unwrap_or_default().to_string();
    Ok(CertInfo {
        common_name,
        serial: hex::encode(cert.raw_serial()),
        not_before: cert.validity().not_before.timestamp(),
        not_after: cert.validity().not_after.timestamp(),
        fingerprint: fingerprint(der),
    })
}

pub fn inspect_pem(pem_text: &str) -> Result<CertInfo, PkiError> {
    inspect_der(&pem_to_der(pem_text, "CERTIFICATE")?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The review of 2026-12-02, finding 5: a server certificate made while the controller's
    /// clock was ahead starts in the future, and was kept until two thirds of its lifetime had
    /// passed from that start, every agent refusing it meanwhile.
    #[test]
    fn a_server_certificate_that_has_not_started_is_due() {
        let made = 1_000_000;
        let (not_before, not_after) = (made - SERVER_BACKDATE_SECS as i64, made + 90 * 86_400);
        assert!(!server_renewal_due(not_before, not_after, made));
        assert!(!server_renewal_due(not_before, not_after, not_before));
        assert!(server_renewal_due(not_before, not_after, made + 60 * 86_400));
        // The clock went back a day after it was made.
        assert!(server_renewal_due(not_before, not_after, made - 86_400));
        assert!(server_renewal_due(not_before, not_after, not_before - 1));
    }

    #[test]
    fn a_node_certificate_names_the_node_the_ca_says() {
        let now = SystemTime::now();
        let ca_pair = create_ca("acme", now, [1; 16]).unwrap();
        let ca = Ca::load(&ca_pair.cert_pem, &ca_pair.key_pem).unwrap();
        // The node asks for another name; the CA ignores it.
        let (_key, csr) = node_key_and_csr("db-1-but-call-me-admin").unwrap();
        let issued = ca.sign_node(&csr, "db-1", "acme", now, Duration::from_secs(86400), [2; 16]).unwrap();
        let info = inspect_pem(&issued.cert_pem).unwrap();
        assert_eq!(info.common_name, "db-1");
        assert_eq!(info.serial, issued.serial);
        assert!((info.not_after - issued.not_after).abs() <= 1);
        assert_eq!(ca.fingerprint(), inspect_pem(&ca_pair.cert_pem).unwrap().fingerprint);
    }

    #[test]
    fn a_certificate_certifies_the_key_of_its_csr_and_of_no_other() {
        let now = SystemTime::now();
        let ca_pair = create_ca("acme", now, [1; 16]).unwrap();
        let ca = Ca::load(&ca_pair.cert_pem, &ca_pair.key_pem).unwrap();
        let (key, csr) = node_key_and_csr("db-1").unwrap();
        let issued = ca.sign_node(&csr, "db-1", "acme", now, Duration::from_secs(60), [2; 16]).unwrap();
        let certified = cert_public_key(&issued.cert_pem).unwrap();
        assert_eq!(csr_public_key(&csr).unwrap(), certified);
        // Another CSR for the same key (a retry) names the same key; a new key does not.
        assert_eq!(csr_public_key(&csr_from_key(&key, "db-1").unwrap()).unwrap(), certified);
        let (_, other) = node_key_and_csr("db-1").unwrap();
        assert_ne!(csr_public_key(&other).unwrap(), certified);
    }

    #[test]
    fn the_recorded_serial_is_the_one_in_the_certificate_every_time() {
        // A serial whose DER form loses a leading zero byte, or gains one, would lock its node
        // out: every first byte, followed by zeros and by ones.
        let now = SystemTime::now();
        let ca_pair = create_ca("acme", now, [0; 16]).unwrap();
        let ca = Ca::load(&ca_pair.cert_pem, &ca_pair.key_pem).unwrap();
        let (_key, csr) = node_key_and_csr("n").unwrap();
        for first in 0..=255u8 {
            for rest in [0x00, 0xff] {
                let mut random = [rest; 16];
                random[0] = first;
                let issued = ca.sign_node(&csr, "n", "acme", now, Duration::from_secs(60), random).unwrap();
                assert_eq!(inspect_pem(&issued.cert_pem).unwrap().serial, issued.serial);
                assert_eq!(issued.serial.len(), 32, "16 bytes");
            }
        }
    }

    #[test]
    fn a_tampered_csr_is_refused() {
        let ca_pair = create_ca("acme", SystemTime::now(), [1; 16]).unwrap();
        let ca = Ca::load(&ca_pair.cert_pem, &ca_pair.key_pem).unwrap();
        let (_key, csr) = node_key_and_csr("db-1").unwrap();
        let der = pem_to_der(&csr, "CERTIFICATE REQUEST").unwrap();
        // Flip one bit inside the subject: the signature no longer matches.
        let mut bad = der.clone();
        let at = bad.len() / 3;
        bad[at] ^= 1;
        let pem = format!("-----BEGIN CERTIFICATE REQUEST-----\n{}\n-----END CERTIFICATE REQUEST-----\n", {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD.encode(&bad)
        });
        assert!(ca.sign_node(&pem, "db-1", "acme", SystemTime::now(), Duration::from_secs(60), [2; 16]).is_err());
    }
}

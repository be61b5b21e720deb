//! Service certificates (ADR 0023): the services intermediate CA, made by the mesh CA and
//! apart from the key that certifies nodes to the controller, and the short-lived leaves it
//! signs for the modules a node runs. A CSR proves possession of its key; the names it asks for
//! must all be among those the caller allows, and it may not ask to be a CA. The leaf always
//! names exactly the names allowed. As the rest of this crate: no IO, no clock, no randomness of
//! its own but rcgen's key generation.

use std::net::IpAddr;
use std::time::{Duration, SystemTime};

/// How far before its issuance a service certificate begins, for clocks behind the
/// controller's: its lifetime is counted from `not_before` plus this, and renewals (at two
/// thirds of it) must count the same way.
pub const SERVICE_BACKDATE_SECS: i64 = 60;

use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

use crate::{odt, pem_to_der, serial, Ca, IssuedCert, Pair, PkiError};

/// The names one service certificate carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceNames {
    /// DNS names; the first is the certificate's common name.
    pub dns: Vec<String>,
    pub ips: Vec<IpAddr>,
    /// The URI SAN naming the module (`spiffe://DOMAIN/module/MODULE`).
    pub uri: String,
}

/// Why a service CSR is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CsrRefusal {
    #[error("the certificate signing request is not valid: {0}")]
    Invalid(String),
    #[error("the certificate signing request asks to be a CA; a service certificate never is")]
    CaRequested,
    #[error("the certificate signing request asks for {0}, which this certificate may not name")]
    NameNotServed(String),
}

impl Ca {
    /// Makes the services intermediate CA (ECDSA P-256, its own key, path length 0, valid five
    /// years from `now`), certified by the mesh CA with Authority and Subject Key Identifiers.
    pub fn services_ca(&self, mesh: &str, now: SystemTime, random: [u8; 16]) -> Result<Pair, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = crate::ca_params(&format!("trellis services CA {mesh}"), 0, now, 5 * 365, random);
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Pair { cert_pem: cert.pem(), key_pem: key.serialize_pem() })
    }

    /// Whether this CA may certify an intermediate CA: its path length allows one below it. A
    /// mesh CA made before service certificates existed allowed none.
    pub fn allows_intermediate(&self) -> bool {
        use x509_parser::prelude::{FromDer, X509Certificate};
        let Ok((_, cert)) = X509Certificate::from_der(&self.cert_der) else { return false };
        match cert.basic_constraints() {
            Ok(Some(bc)) => bc.value.ca && bc.value.path_len_constraint.is_none_or(|n| n >= 1),
            _ => false,
        }
    }

    /// The raw DER of the CA's subject: what a certificate it issued names as its issuer.
    pub fn subject_der(&self) -> Vec<u8> {
        use x509_parser::prelude::{FromDer, X509Certificate};
        X509Certificate::from_der(&self.cert_der).map(|(_, c)| c.subject().as_raw().to_vec()).unwrap_or_default()
    }
}

/// Whether the certificate `cert_der` was issued by the CA whose subject is `issuer_subject`
/// (compared as raw DER): how the controller tells a node certificate (issued by the mesh CA)
/// from a service certificate (issued by the services CA) presented in its place.
pub fn issued_by(cert_der: &[u8], issuer_subject: &[u8]) -> bool {
    use x509_parser::prelude::{FromDer, X509Certificate};
    X509Certificate::from_der(cert_der).is_ok_and(|(_, c)| c.issuer().as_raw() == issuer_subject)
}

/// What the services CA may certify (the review of 2026-12-02, finding 12): DNS names in the
/// mesh's domain and addresses in the overlay's prefixes, as each `(address, prefix length)`. A client that trusts the mesh CA then
/// takes nothing else from it, whoever holds its key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceScope {
    pub domain: String,
    pub prefixes: Vec<(IpAddr, u8)>,
}

const NAME_CONSTRAINTS: [u64; 4] = [2, 5, 29, 30];

/// A DER length.
fn der_len(n: usize, out: &mut Vec<u8>) {
    if n < 0x80 {
        out.push(n as u8);
    } else {
        let bytes: Vec<u8> = n.to_be_bytes().into_iter().skip_while(|b| *b == 0).collect();
        out.push(0x80 | bytes.len() as u8);
        out.extend(bytes);
    }
}

fn der(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    der_len(content.len(), &mut out);
    out.extend_from_slice(content);
    out
}

impl ServiceScope {
    /// The value of the NameConstraints extension (RFC 5280 4.2.1.10) that permits exactly this
    /// scope: dNSName the domain, iPAddress each prefix. No uniformResourceIdentifier subtree:
    /// webpki (every rustls client) refuses a chain whose constraints name a type it does not
    /// check, so a URI constraint would make the mesh's certificates unusable to them; the SPIFFE
    /// URI is left unconstrained.
    pub fn name_constraints(&self) -> Vec<u8> {
        let mut subtrees = Vec::new();
        // GeneralSubtree ::= SEQUENCE { base GeneralName }; dNSName [2], URI [6], iPAddress [7].
        subtrees.extend(der(0x30, &der(0x82, self.domain.as_bytes())));
        for (addr, len) in &self.prefixes {
            let (mut bytes, bits) = match addr {
                IpAddr::V4(a) => (a.octets().to_vec(), 32),
                IpAddr::V6(a) => (a.octets().to_vec(), 128),
            };
            let len = (*len as usize).min(bits);
            let mut mask = vec![0u8; bits / 8];
            for (i, m) in mask.iter_mut().enumerate() {
                let on = len.saturating_sub(i * 8).min(8);
                *m = if on == 0 { 0 } else { 0xffu8 << (8 - on) };
            }
            for (b, m) in bytes.iter_mut().zip(&mask) {
                *b &= m;
            }
            bytes.extend(mask);
            subtrees.extend(der(0x30, &der(0x87, &bytes)));
        }
        der(0x30, &der(0xa0, &subtrees))
    }
}

/// The value of a certificate's NameConstraints extension, if it has one.
pub fn name_constraints_of(cert_pem: &str) -> Option<Vec<u8>> {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let der = pem_to_der(cert_pem, "CERTIFICATE").ok()?;
    let (_, cert) = X509Certificate::from_der(&der).ok()?;
    let oid = x509_parser::oid_registry::OID_X509_EXT_NAME_CONSTRAINTS;
    cert.extensions().iter().find(|e| e.oid == oid).map(|e| e.value.to_vec())
}

/// The services intermediate CA, loaded for signing.
pub struct ServicesCa {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl ServicesCa {
    /// The services CA of this certificate and key; refused when the key is not the
    /// certificate's.
    pub fn load(cert_pem: &str, key_pem: &str) -> Result<ServicesCa, PkiError> {
        let key = KeyPair::from_pem(key_pem).map_err(|e| PkiError::BadKey(e.to_string()))?;
        pem_to_der(cert_pem, "CERTIFICATE")?;
        if !crate::key_matches_cert(key_pem, cert_pem) {
            return Err(PkiError::BadKey("the key is not the one the services CA certificate certifies".into()));
        }
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)?;
        Ok(ServicesCa { cert_pem: cert_pem.to_string(), issuer })
    }

    /// This services CA's key certified again by `ca` for `scope` alone (name constraints,
    /// critical), valid five years from `now`, named as [`Ca::services_ca`] names it for `mesh`:
    /// the certificates it signed before still chain to it (same key, same subject), and nothing
    /// outside the scope does. Returns the new certificate, and the services CA that signs with
    /// it.
    pub fn scoped(
        &self,
        ca: &Ca,
        mesh: &str,
        scope: &ServiceScope,
        now: SystemTime,
        random: [u8; 16],
    ) -> Result<(String, ServicesCa), PkiError> {
        let mut params = crate::ca_params(&format!("trellis services CA {mesh}"), 0, now, 5 * 365, random);
        params.use_authority_key_identifier_extension = true;
        let mut constraints = rcgen::CustomExtension::from_oid_content(&NAME_CONSTRAINTS, scope.name_constraints());
        constraints.set_criticality(true);
        params.custom_extensions.push(constraints);
        let pem = params.signed_by(self.issuer.key(), &ca.issuer)?.pem();
        let again = ServicesCa::load(&pem, &self.issuer.key().serialize_pem())?;
        Ok((pem, again))
    }

    /// The intermediate's certificate: the chain a service presents after its own.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Signs a service CSR for exactly `names`: refused when the CSR asks to be a CA or for a
    /// name (DNS, IP or URI) not among them. The leaf's common name is the first DNS name; it
    /// serves and authenticates (server and client authentication), carries Authority and
    /// Subject Key Identifiers and `CA:FALSE`, and is valid from a minute before `now` for
    /// `lifetime`, its serial made from 16 random bytes.
    pub fn sign(
        &self,
        csr_pem: &str,
        names: &ServiceNames,
        now: SystemTime,
        lifetime: Duration,
        random: [u8; 16],
    ) -> Result<Result<IssuedCert, CsrRefusal>, PkiError> {
        let csr = match CertificateSigningRequestParams::from_pem(csr_pem) {
            Ok(c) => c,
            Err(e) => return Ok(Err(CsrRefusal::Invalid(e.to_string()))),
        };
        if matches!(csr.params.is_ca, IsCa::Ca(_)) {
            return Ok(Err(CsrRefusal::CaRequested));
        }
        let allowed = sans(names)?;
        for asked in &csr.params.subject_alt_names {
            if !allowed.contains(asked) {
                return Ok(Err(CsrRefusal::NameNotServed(describe(asked))));
            }
        }
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, names.dns.first().cloned().unwrap_or_default());
        dn.push(DnType::OrganizationName, "trellis");
        params.distinguished_name = dn;
        params.subject_alt_names = allowed;
        params.is_ca = IsCa::ExplicitNoCa;
        params.use_authority_key_identifier_extension = true;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.not_before = odt(now - Duration::from_secs(SERVICE_BACKDATE_SECS as u64));
        let not_after = now + lifetime;
        params.not_after = odt(not_after);
        let serial = serial(random);
        params.serial_number = Some(serial.clone());
        let signed = CertificateSigningRequestParams { params, public_key: csr.public_key }.signed_by(&self.issuer)?;
        Ok(Ok(IssuedCert {
            cert_pem: signed.pem(),
            serial: hex::encode(serial.to_bytes()),
            not_after: not_after.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64),
        }))
    }
}

fn sans(names: &ServiceNames) -> Result<Vec<SanType>, PkiError> {
    let mut out = Vec::new();
    for d in &names.dns {
        out.push(SanType::DnsName(d.clone().try_into()?));
    }
    out.extend(names.ips.iter().map(|ip| SanType::IpAddress(*ip)));
    out.push(SanType::URI(names.uri.clone().try_into()?));
    Ok(out)
}

fn describe(san: &SanType) -> String {
    match san {
        SanType::DnsName(d) => format!("the name {}", d.as_str()),
        SanType::IpAddress(ip) => format!("the address {ip}"),
        SanType::URI(u) => format!("the URI {}", u.as_str()),
        SanType::Rfc822Name(m) => format!("the mail address {}", m.as_str()),
        other => format!("{other:?}"),
    }
}

/// A service's key (PEM), made on the node, and a CSR for it asking for `names` (an empty list
/// asks for whatever the controller allows).
pub fn service_key_and_csr(dns: &[String]) -> Result<(String, String), PkiError> {
    let key = KeyPair::generate()?;
    let csr = service_csr(&key.serialize_pem(), dns)?;
    Ok((key.serialize_pem(), csr))
}

/// A CSR for an existing service key, asking for these DNS names.
pub fn service_csr(key_pem: &str, dns: &[String]) -> Result<String, PkiError> {
    let key = KeyPair::from_pem(key_pem).map_err(|e| PkiError::BadKey(e.to_string()))?;
    let mut params = CertificateParams::new(dns.to_vec())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, dns.first().cloned().unwrap_or_default());
    params.distinguished_name = dn;
    Ok(params.serialize_request(&key)?.pem()?)
}

/// The public key of a key (PEM), in the form [`crate::cert_public_key`] gives a certificate's.
pub fn public_key_of(key_pem: &str) -> Result<Vec<u8>, PkiError> {
    let key = KeyPair::from_pem(key_pem).map_err(|e| PkiError::BadKey(e.to_string()))?;
    Ok(key.public_key_raw().to_vec())
}

/// What a service certificate names, read back (for `trellis certs`, the agent's status and
/// tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceCertInfo {
    pub serial: String,
    pub not_before: i64,
    pub not_after: i64,
    pub dns: Vec<String>,
    pub ips: Vec<IpAddr>,
    pub uris: Vec<String>,
}

pub fn inspect_service(cert_pem: &str) -> Result<ServiceCertInfo, PkiError> {
    use x509_parser::prelude::*;
    let der = crate::pem_to_der(cert_pem, "CERTIFICATE")?;
    let (_, cert) = X509Certificate::from_der(&der).map_err(|e| PkiError::BadCert(e.to_string()))?;
    let mut info = ServiceCertInfo {
        serial: hex::encode(cert.raw_serial()),
        not_before: cert.validity().not_before.timestamp(),
        not_after: cert.validity().not_after.timestamp(),
        dns: Vec::new(),
        ips: Vec::new(),
        uris: Vec::new(),
    };
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            match n {
                GeneralName::DNSName(d) => info.dns.push(d.to_string()),
                GeneralName::URI(u) => info.uris.push(u.to_string()),
                GeneralName::IPAddress(b) => match b.len() {
                    4 => info.ips.push(IpAddr::from(<[u8; 4]>::try_from(*b).expect("4 bytes"))),
                    16 => info.ips.push(IpAddr::from(<[u8; 16]>::try_from(*b).expect("16 bytes"))),
                    _ => {}
                },
                _ => {}
            }
        }
    }
    Ok(info)
}

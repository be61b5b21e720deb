//! rustls configurations for trellis: the controller's server side (mutual TLS optional, so
//! enrolment works without a client certificate), clients that trust the mesh CA, and the
//! first contact of a new node, which trusts only a CA whose fingerprint the token carries.

use std::sync::{Arc, Mutex};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

use crate::{fingerprint, pem_to_der, PkiError};

pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn key_der(key_pem: &str) -> Result<PrivateKeyDer<'static>, PkiError> {
    let der = pem_to_der(key_pem, "PRIVATE KEY")?;
    Ok(PrivateKeyDer::Pkcs8(der.into()))
}

/// Every certificate in a PEM text, in order (a CA file may hold several: the current mesh CA
/// and, during a rotation, the next one).
pub fn certificates(pem_text: &str) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    let mut out = Vec::new();
    let mut rest = pem_text;
    while let Some(at) = rest.find("-----BEGIN CERTIFICATE-----") {
        let der = pem_to_der(&rest[at..], "CERTIFICATE")?;
        out.push(CertificateDer::from(der));
        let end = rest[at..].find("-----END CERTIFICATE-----").map_or(rest.len(), |e| at + e + "-----END CERTIFICATE-----".len());
        rest = &rest[end..];
    }
    if out.is_empty() {
        return Err(PkiError::BadCert("no CERTIFICATE block".into()));
    }
    Ok(out)
}

fn roots(ca_pem: &str) -> Result<RootCertStore, PkiError> {
    let mut roots = RootCertStore::empty();
    for der in certificates(ca_pem)? {
        roots.add(der).map_err(|e| PkiError::BadCert(e.to_string()))?;
    }
    Ok(roots)
}

/// The controller: presents its certificate followed by `chain_pem` (the mesh CA; during a CA
/// rotation also the cross-certificate and both CAs, ADR 0029), and asks for (but does not
/// require) a client certificate issued by a CA of `client_roots_pem`. Handlers decide which
/// endpoints need one.
pub fn server_config(server_pem: &str, server_key_pem: &str, chain_pem: &str, client_roots_pem: &str) -> Result<ServerConfig, PkiError> {
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots(client_roots_pem)?), provider())
        .allow_unauthenticated()
        .build()
        .map_err(|e| PkiError::BadCert(e.to_string()))?;
    let mut chain = vec![CertificateDer::from(pem_to_der(server_pem, "CERTIFICATE")?)];
    chain.extend(certificates(chain_pem)?);
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| PkiError::BadCert(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key_der(server_key_pem)?)
        .map_err(|e| PkiError::BadKey(e.to_string()))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// Whether a certificate is a CA at the mesh CA's level: a CA that may certify a CA below it
/// (a mesh CA, or its cross-certificate during a rotation), not the services CA (path length 0),
/// which certifies services only.
fn mesh_level_ca(der: &CertificateDer<'_>) -> bool {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let Ok((_, cert)) = X509Certificate::from_der(der) else { return false };
    matches!(cert.basic_constraints(), Ok(Some(bc)) if bc.value.ca && bc.value.path_len_constraint.is_none_or(|n| n >= 1))
}

/// Whether `pem` holds exactly one certificate, a mesh-level CA's (what a next mesh CA
/// announced to a node must be).
pub fn one_mesh_ca(pem: &str) -> bool {
    matches!(certificates(pem).as_deref(), Ok([one]) if mesh_level_ca(one))
}

/// The certificates presented after a controller's own that its path may pass through: the
/// mesh-level CAs among them (ADR 0029). A service certificate's chain (through the services CA)
/// never makes a controller, whatever names it carries.
fn mesh_intermediates(intermediates: &[CertificateDer<'_>]) -> Vec<CertificateDer<'static>> {
    intermediates.iter().filter(|c| mesh_level_ca(c)).map(|c| c.clone().into_owned()).collect()
}

/// Verifies the controller's certificate against the mesh CAs of `ca_pem`, through presented
/// certificates that are mesh-level CAs only.
#[derive(Debug)]
pub struct ControllerVerifier {
    inner: Arc<WebPkiServerVerifier>,
}

impl ControllerVerifier {
    pub fn new(ca_pem: &str) -> Result<Arc<ControllerVerifier>, PkiError> {
        let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots(ca_pem)?), provider())
            .build()
            .map_err(|e| PkiError::BadCert(e.to_string()))?;
        Ok(Arc::new(ControllerVerifier { inner }))
    }
}

impl ServerCertVerifier for ControllerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner.verify_server_cert(end_entity, &mesh_intermediates(intermediates), server_name, ocsp, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A client of the controller that trusts the mesh CAs of `ca_pem` (see [`ControllerVerifier`]),
/// optionally presenting a node certificate.
pub fn client_config(ca_pem: &str, client: Option<(&str, &str)>) -> Result<ClientConfig, PkiError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| PkiError::BadCert(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(ControllerVerifier::new(ca_pem)?);
    let cfg = match client {
        None => builder.with_no_client_auth(),
        Some((cert_pem, key_pem)) => builder
            .with_client_auth_cert(vec![CertificateDer::from(pem_to_der(cert_pem, "CERTIFICATE")?)], key_der(key_pem)?)
            .map_err(|e| PkiError::BadKey(e.to_string()))?,
    };
    Ok(cfg)
}

/// What the pinned first contact saw, for a clear message when it refuses.
#[derive(Clone, Debug, Default)]
pub struct PinReport {
    pub mismatch: Option<String>,
}

/// A client for the first contact of a new node: the server must present, in its chain, a CA
/// certificate whose SHA-256 is `fingerprint`, and its certificate must be issued by that CA for
/// the address dialled. Anything else fails the handshake, before any request is sent.
pub fn pinned_client_config(fingerprint: [u8; 32]) -> (ClientConfig, Arc<Mutex<PinReport>>) {
    let report = Arc::new(Mutex::new(PinReport::default()));
    let verifier = Arc::new(PinnedCa { fingerprint, provider: provider(), report: report.clone() });
    let cfg = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default versions")
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    (cfg, report)
}

#[derive(Debug)]
struct PinnedCa {
    fingerprint: [u8; 32],
    provider: Arc<CryptoProvider>,
    report: Arc<Mutex<PinReport>>,
}

impl ServerCertVerifier for PinnedCa {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(ca) = intermediates.iter().find(|c| fingerprint(c) == self.fingerprint) else {
            let seen: Vec<String> = intermediates.iter().map(|c| hex::encode(fingerprint(c))).collect();
            let msg = format!(
                "the controller's CA does not match the token: expected SHA-256 {}, the controller presented {}; refusing to send the token's secret",
                hex::encode(self.fingerprint),
                if seen.is_empty() { "no CA certificate".to_string() } else { seen.join(", ") }
            );
            self.report.lock().expect("pin report").mismatch = Some(msg.clone());
            return Err(rustls::Error::General(msg));
        };
        let mut roots = RootCertStore::empty();
        roots.add(ca.clone().into_owned())?;
        let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        // The path may pass through the mesh-level CAs presented: during a CA rotation the
        // server's certificate is the next CA's, reached from the current one by its
        // cross-certificate (ADR 0029); never through the services CA.
        inner.verify_server_cert(end_entity, &mesh_intermediates(intermediates), server_name, ocsp, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

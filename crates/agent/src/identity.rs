//! Enrolment, renewal and `status`: the node's WireGuard and TLS keys made here (mode 0600 from
//! the first byte), its certificate and the mesh CA asked of the controllers, and the identity
//! they answer with (`state::Identity`) saved; the client that presents the certificate.

use std::path::Path;

use anyhow::{bail, Context, Result};
use base64::Engine;
use serde::{Deserialize, Serialize};
use trellis_client::NodeClient;
use trellis_core::token::EnrolmentToken;
use trellis_files::replace as write_file;
use trellis_proto::text::{date, printable};

use crate::state::{Identity, Manifest};
use crate::statedir::{CA_CERT, CA_NEXT_CERT, ENROL_PENDING, IDENTITY, NODE_CERT, NODE_KEY, WIREGUARD_KEY};
use crate::status::AgentStatus;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

/// The node's WireGuard public key, from the private key in the state directory (made there,
/// mode 0600, when there is none yet).
pub fn wireguard_key(dir: &Path) -> Result<String> {
    let path = dir.join(WIREGUARD_KEY);
    let secret = if path.exists() {
        let bytes = B64.decode(read(&path)?.trim()).ok().and_then(|b| <[u8; 32]>::try_from(b).ok());
        x25519_dalek::StaticSecret::from(bytes.with_context(|| format!("{} does not hold a WireGuard private key", path.display()))?)
    } else {
        let s = x25519_dalek::StaticSecret::random_from_rng(rand::rngs::OsRng);
        write_file(&path, format!("{}\n", B64.encode(s.to_bytes())).as_bytes(), 0o600)?;
        s
    };
    Ok(B64.encode(x25519_dalek::PublicKey::from(&secret).as_bytes()))
}

/// A client error as the agent reports it: a refusal is the controller's sentence.
pub fn controller_error(e: trellis_client::Error) -> anyhow::Error {
    match e {
        trellis_client::Error::Refused(r) => anyhow::anyhow!("the controller refused: {r}"),
        e => e.into(),
    }
}

/// Where the token comes from: the command line, or a file (`-`: standard input), so that it
/// need not appear in the process list or the shell's history.
pub enum TokenSource {
    Argument(String),
    File(std::path::PathBuf),
}

impl TokenSource {
    fn read(self) -> Result<String> {
        match self {
            TokenSource::Argument(t) => Ok(t),
            TokenSource::File(p) if p.as_os_str() == "-" => {
                let mut t = String::new();
                std::io::Read::read_to_string(&mut std::io::Read::take(std::io::stdin(), 64 * 1024), &mut t)
                    .context("cannot read the token from standard input")?;
                Ok(t)
            }
            TokenSource::File(p) => read(&p),
        }
    }
}

/// An enrolment sent and not (yet) answered: the token it was for and the TLS key its CSR
/// named. Kept (mode 0600) until an answer comes, so that every retry, in this run or a later
/// one, presents the same keys and a redemption the controller recorded is answered again.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Pending {
    token_id: String,
    node: String,
    key_pem: String,
    /// What the first attempt made, to remove after a refusal.
    made_wireguard_key: bool,
    made_dir: bool,
}

fn pending(dir: &Path, token: &EnrolmentToken) -> Option<Pending> {
    let p: Pending = toml::from_str(&std::fs::read_to_string(dir.join(ENROL_PENDING)).ok()?).ok()?;
    (p.token_id == trellis_core::token::hex(&token.id) && p.node == token.node).then_some(p)
}

pub async fn enrol(source: TokenSource, dir: &Path, force: bool, retry_for: std::time::Duration) -> Result<()> {
    // A damaged token fails here, before any key is made or any packet is sent.
    let token = EnrolmentToken::decode(source.read()?.trim()).map_err(|e| anyhow::anyhow!("{e}"))?;
    if dir.join(IDENTITY).exists() && !force {
        bail!("{} already holds the identity of a node; pass --force to enrol again", dir.display());
    }
    // Made private, or refused if it exists open to others; never chmod'ed.
    let made_dir = trellis_files::private_dir(dir)?;
    let pending = match pending(dir, &token) {
        // An earlier run sent this token and got no answer: the same keys again.
        Some(p) => p,
        None => {
            let made_wireguard_key = !dir.join(WIREGUARD_KEY).exists();
            let key_pem = trellis_pki::node_key()?;
            let p =
                Pending { token_id: trellis_core::token::hex(&token.id), node: token.node.clone(), key_pem, made_wireguard_key, made_dir };
            // Written before the request leaves, so that no answer can be lost with the key.
            write_file(&dir.join(ENROL_PENDING), toml::to_string(&p)?.as_bytes(), 0o600)?;
            p
        }
    };
    let wg_public = wireguard_key(dir)?;
    let csr = trellis_pki::csr_from_key(&pending.key_pem, &token.node)?;
    let req = trellis_client::enrol_request(&token, csr, wg_public.clone());
    let started = std::time::Instant::now();
    let mut failures = 0;
    // Worth asking again: no answer, or a controller that is busy or turning this address away
    // for a while (429).
    let again = |e: &trellis_client::Error| e.outcome_unknown() || e.refused().is_some_and(|r| r.status == 429);
    let resp = loop {
        // The agent's backoff: 1, 2, 4, 8, 15 s, each somewhat less, so that nodes cut off
        // together do not come back together.
        let wait = crate::backoff::delay(failures, 15, rand::random::<f64>());
        match trellis_client::enrol(&token.controllers, token.ca_fingerprint, &req).await {
            Ok(r) => break r,
            Err(e) if again(&e) && started.elapsed() + wait <= retry_for => {
                eprintln!("trellis-agent: {:#}; asking again in {:.1} s with the same keys", controller_error(e), wait.as_secs_f64());
                tokio::time::sleep(wait).await;
                failures += 1;
            }
            Err(e) if e.outcome_unknown() => {
                return Err(controller_error(e).context(format!(
                    "no answer to the enrolment; it may have reached the controller, so this node's keys are kept in {}: \
                     run the same command again to complete it",
                    dir.display()
                )));
            }
            Err(e) => {
                // A refused enrolment leaves nothing behind that it made.
                let _ = std::fs::remove_file(dir.join(ENROL_PENDING));
                if pending.made_wireguard_key {
                    let _ = std::fs::remove_file(dir.join(WIREGUARD_KEY));
                }
                if pending.made_dir {
                    let _ = std::fs::remove_dir(dir);
                }
                return Err(controller_error(e));
            }
        }
    };
    write_file(&dir.join(NODE_KEY), pending.key_pem.as_bytes(), 0o600)?;
    write_file(&dir.join(NODE_CERT), resp.node_cert_pem.as_bytes(), 0o644)?;
    write_file(&dir.join(CA_CERT), resp.ca_pem.as_bytes(), 0o644)?;
    let id = Identity {
        node: resp.node.clone(),
        mesh: resp.mesh.clone(),
        controllers: resp.controllers,
        signing_public_key: resp.signing_public_key,
        next_signing_public_key: None,
        state: resp.state,
        revocations: 0,
    };
    id.save(dir)?;
    std::fs::remove_file(dir.join(ENROL_PENDING)).with_context(|| format!("cannot remove {}", dir.join(ENROL_PENDING).display()))?;
    let info = trellis_pki::inspect_pem(&resp.node_cert_pem)?;
    println!(
        "enrolled node {} in mesh {} ({}); certificate valid until {}; WireGuard public key {wg_public}",
        printable(&resp.node),
        printable(&resp.mesh),
        resp.state,
        date(info.not_after)
    );
    Ok(())
}

/// A client for the node's controllers, presenting its certificate and trusting only the mesh CA
/// (and, during a CA rotation, the next one).
pub fn node_client(dir: &Path, id: &Identity) -> Result<NodeClient> {
    let (mut ca, cert, key) = (read(&dir.join(CA_CERT))?, read(&dir.join(NODE_CERT))?, read(&dir.join(NODE_KEY))?);
    if let Ok(next) = std::fs::read_to_string(dir.join(CA_NEXT_CERT)) {
        ca.push_str(&next);
    }
    Ok(NodeClient::new(id.controllers.clone(), &ca, &cert, &key)?)
}

/// SHA-256 of the (first) certificate in a PEM file.
fn fingerprint_of(path: &Path) -> Option<[u8; 32]> {
    let pem = std::fs::read_to_string(path).ok()?;
    Some(trellis_pki::fingerprint(&trellis_pki::pem_to_der(&pem, "CERTIFICATE").ok()?))
}

/// What a bundle's `trust.toml` says of the mesh CA, taken into the state directory (ADR 0029):
/// a next CA announced is kept as `ca.next.pem` and trusted beside `ca.pem`; once the bundle
/// names it as the mesh CA it replaces `ca.pem`, and the old CA is no longer trusted. Returns
/// whether what the node trusts changed (its client must be made again); a CA the node cannot
/// follow is an error, and nothing changes.
pub fn adopt_ca(dir: &Path, ca: Option<[u8; 32]>, next_ca: Option<&str>) -> Result<CaChange> {
    let (current_path, next_path) = (dir.join(CA_CERT), dir.join(CA_NEXT_CERT));
    let current = fingerprint_of(&current_path);
    let held_next = fingerprint_of(&next_path);
    if let Some(pem) = next_ca {
        if !trellis_pki::tls::one_mesh_ca(pem) {
            bail!("the bundle announces a next mesh CA that is not one CA certificate; nothing changes");
        }
        let fp = trellis_pki::fingerprint(&trellis_pki::pem_to_der(pem, "CERTIFICATE")?);
        if Some(fp) == current || Some(fp) == held_next {
            return Ok(CaChange::None);
        }
        write_file(&next_path, pem.as_bytes(), 0o644)?;
        return Ok(CaChange::Announced(hex::encode(fp)));
    }
    let Some(ca) = ca else { return Ok(CaChange::None) };
    if Some(ca) == held_next {
        let pem = read(&next_path)?;
        write_file(&current_path, pem.as_bytes(), 0o644)?;
        std::fs::remove_file(&next_path).with_context(|| format!("cannot remove {}", next_path.display()))?;
        return Ok(CaChange::Completed(hex::encode(ca)));
    }
    if Some(ca) == current {
        if held_next.is_some() {
            std::fs::remove_file(&next_path).with_context(|| format!("cannot remove {}", next_path.display()))?;
            return Ok(CaChange::Completed(hex::encode(ca)));
        }
        return Ok(CaChange::None);
    }
    bail!(
        "the bundle names the mesh CA {}, and this node trusts {}: it cannot follow (it was away through a whole CA rotation); enrol it again with a new token",
        hex::encode(ca),
        current.map_or("none".into(), hex::encode)
    )
}

/// What [`adopt_ca`] changed.
#[derive(Debug, PartialEq, Eq)]
pub enum CaChange {
    None,
    /// A next CA (its fingerprint) is trusted beside the current one.
    Announced(String),
    /// The CA (its fingerprint) is the only one trusted.
    Completed(String),
}

/// Whether the node's certificate must be renewed under the next CA: one is announced and did
/// not issue it.
pub fn needs_next_ca_certificate(dir: &Path) -> bool {
    let Ok(next) = std::fs::read_to_string(dir.join(CA_NEXT_CERT)) else { return false };
    let Ok(cert) = std::fs::read_to_string(dir.join(NODE_CERT)) else { return false };
    !trellis_pki::issued_by_ca(&cert, &next).unwrap_or(true)
}

/// Whether a certificate is due for renewal: two thirds of its lifetime have passed.
pub fn renewal_due(not_before: i64, not_after: i64, now: i64) -> bool {
    now >= not_before + (not_after - not_before) * 2 / 3
}

pub async fn renew(dir: &Path, force: bool) -> Result<()> {
    let id = Identity::load(dir)?;
    match renew_inner(dir, force, &node_client(dir, &id)?).await? {
        Some(not_after) => println!("renewed the certificate of node {}; valid until {}", printable(&id.node), date(not_after)),
        None => {
            let info = trellis_pki::inspect_pem(&read(&dir.join(NODE_CERT))?)?;
            println!(
                "certificate of node {} is not due for renewal until two thirds of its lifetime; it expires at {}",
                printable(&id.node),
                date(info.not_after)
            );
        }
    }
    Ok(())
}

/// Renews when two thirds of the certificate's lifetime have passed (the run loop's check), or
/// at once when `force` (a CA rotation: the certificate is renewed under the next CA).
/// Returns whether a new certificate was written.
pub async fn renew_if_due(dir: &Path, client: &NodeClient, force: bool) -> Result<bool> {
    renew_inner(dir, force, client).await.map(|renewed| renewed.is_some())
}

async fn renew_inner(dir: &Path, force: bool, client: &NodeClient) -> Result<Option<i64>> {
    let id = Identity::load(dir)?;
    let cert = read(&dir.join(NODE_CERT))?;
    let info = trellis_pki::inspect_pem(&cert)?;
    let now = crate::unix_now();
    if now >= info.not_after {
        bail!("the certificate of node {} expired at {}: it cannot renew; enrol again with a new token", id.node, date(info.not_after));
    }
    if !force && !renewal_due(info.not_before, info.not_after, now) {
        return Ok(None);
    }
    let csr = trellis_pki::csr_from_key(&read(&dir.join(NODE_KEY))?, &id.node)?;
    let resp = client.renew(&csr).await.map_err(controller_error)?;
    write_file(&dir.join(NODE_CERT), resp.node_cert_pem.as_bytes(), 0o644)?;
    Ok(Some(resp.not_after))
}

pub fn status(dir: &Path, json: bool) -> Result<()> {
    let id = Identity::load(dir)?;
    let info = trellis_pki::inspect_pem(&read(&dir.join(NODE_CERT))?)?;
    let run = AgentStatus::load(dir);
    let manifest = Manifest::load(dir);
    let now = crate::unix_now();
    let staleness = run.fresh_at.map(|f| now - f);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "node": id.node, "mesh": id.mesh, "controllers": id.controllers, "state_at_enrolment": id.state,
                "certificate": {"serial": info.serial, "not_before": info.not_before, "not_after": info.not_after,
                                "renewal_due": renewal_due(info.not_before, info.not_after, now)},
                "bundle_version": manifest.version,
                "last_contact": run.last_contact,
                "staleness_seconds": staleness,
                "interface": run.interface,
                "peers": run.peers,
                "ruleset_loaded": run.ruleset_loaded,
                "dns_serving": run.dns_serving,
                "last_apply_ms": run.last_apply_ms,
                "buffered_evidence": run.buffered_evidence,
                "dropped_evidence": run.dropped_evidence,
                "service_certificates": run.certificates,
                "last_error": run.last_error,
                "updated_at": run.updated_at,
            }))?
        );
    } else {
        // Everything below was read from the state directory (and came from the controller or
        // the host): shown through `printable`, so no stored string can rewrite the terminal.
        let list = |items: &[String]| items.iter().map(|i| printable(i).into_owned()).collect::<Vec<_>>().join(", ");
        println!("node {} in mesh {} (at enrolment: {})", printable(&id.node), printable(&id.mesh), id.state);
        println!("controllers: {}", list(&id.controllers));
        println!("certificate: serial {}, valid until {}", info.serial, date(info.not_after));
        println!("bundle version: {}", manifest.version);
        println!("last contact: {}", run.last_contact.map_or("never".into(), |t| format!("{}s ago", now - t)));
        println!(
            "staleness: {}",
            staleness.map_or("unknown (no signed word from the controller yet)".into(), |s| format!(
                "the controller's newest signed word is {s}s old"
            ))
        );
        println!("interface: {}", printable(run.interface.as_deref().unwrap_or("-")));
        for p in &run.peers {
            println!(
                "  peer {} endpoint {} last handshake {}",
                printable(&p.public_key),
                printable(p.endpoint.as_deref().unwrap_or("-")),
                p.last_handshake.map_or("never".into(), |t| format!("{}s ago", now - t as i64))
            );
        }
        println!("ruleset loaded: {}", if run.ruleset_loaded { "yes" } else { "no" });
        println!("DNS serving: {}", if run.dns_serving.is_empty() { "no".to_string() } else { list(&run.dns_serving) });
        println!(
            "buffered evidence: {} record(s){}",
            run.buffered_evidence,
            if run.dropped_evidence > 0 { format!(", {} dropped", run.dropped_evidence) } else { String::new() }
        );
        for c in &run.certificates {
            let until = c.not_after.map_or("none yet".to_string(), |t| format!("valid until {}", date(t)));
            println!("service certificate for {}: {until}", printable(&c.module));
            if let Some(e) = &c.error {
                println!("  {}", printable(e));
            }
        }
        if let Some(e) = &run.last_error {
            println!("last error: {}", printable(e));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{adopt_ca, CaChange};

    /// A CA announced is kept beside the current one, once; named as the CA it replaces the
    /// current one; a CA the node cannot follow changes nothing and says so.
    #[test]
    fn a_next_ca_is_trusted_beside_the_current_one_then_in_its_place() {
        let dir = trellis_testing::TempDir::new("adopt-ca");
        let now = std::time::SystemTime::now();
        let (old, new) = (trellis_pki::create_ca("t", now, [1; 16]).unwrap(), trellis_pki::create_next_ca("t", now, [2; 16]).unwrap());
        let fp = |pem: &str| trellis_pki::inspect_pem(pem).unwrap().fingerprint;
        std::fs::write(dir.join("ca.pem"), &old.cert_pem).unwrap();
        assert_eq!(adopt_ca(&dir, Some(fp(&old.cert_pem)), None).unwrap(), CaChange::None);
        assert_eq!(
            adopt_ca(&dir, Some(fp(&old.cert_pem)), Some(&new.cert_pem)).unwrap(),
            CaChange::Announced(hex::encode(fp(&new.cert_pem)))
        );
        assert_eq!(adopt_ca(&dir, Some(fp(&old.cert_pem)), Some(&new.cert_pem)).unwrap(), CaChange::None, "once");
        assert_eq!(std::fs::read_to_string(dir.join("ca.next.pem")).unwrap(), new.cert_pem);
        // Not one CA certificate: two, or a node's.
        let two = format!("{}{}", new.cert_pem, old.cert_pem);
        let (_, csr) = trellis_pki::node_key_and_csr("n").unwrap();
        let ca = trellis_pki::Ca::load(&old.cert_pem, &old.key_pem).unwrap();
        let leaf = ca.sign_node(&csr, "n", "t", now, std::time::Duration::from_secs(60), [4; 16]).unwrap().cert_pem;
        for bad in [two.as_str(), leaf.as_str()] {
            let err = adopt_ca(&dir, Some(fp(&old.cert_pem)), Some(bad)).unwrap_err().to_string();
            assert!(err.contains("not one CA certificate"), "{err}");
        }
        let stranger = trellis_pki::create_next_ca("t", now, [3; 16]).unwrap();
        let err = adopt_ca(&dir, Some(fp(&stranger.cert_pem)), None).unwrap_err().to_string();
        assert!(err.contains("it cannot follow") && err.contains("enrol it again"), "{err}");
        assert!(dir.join("ca.next.pem").exists(), "nothing changed");
        assert_eq!(adopt_ca(&dir, Some(fp(&new.cert_pem)), None).unwrap(), CaChange::Completed(hex::encode(fp(&new.cert_pem))));
        assert_eq!(std::fs::read_to_string(dir.join("ca.pem")).unwrap(), new.cert_pem);
        assert!(!dir.join("ca.next.pem").exists());
        assert_eq!(adopt_ca(&dir, Some(fp(&new.cert_pem)), None).unwrap(), CaChange::None);
    }

    #[test]
    fn renewal_is_due_at_two_thirds() {
        assert!(!super::renewal_due(0, 90, 59));
        assert!(super::renewal_due(0, 90, 60));
    }
}

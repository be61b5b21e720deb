//! `etc/trellis/trust.toml`, what a node trusts beyond the CA, delivered in its signed bundle so
//! that it changes without enrolling again: the controllers it asks, in order, with the names
//! their server certificate carries (ADR 0028), and the bundle-signing key announced to come
//! next, signed by the current one (ADR 0027). One type, written by the controller and read back
//! by the agent. Pure.

use std::fmt::{self, Write};

use base64::Engine;
use toml::de::DeTable;

/// The most controllers a list holds (a bound on what a node is told to dial).
pub const MAX_CONTROLLERS: usize = 32;

/// What `trust.toml` holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustFile {
    /// `HOST:PORT` of every controller, in the order a node tries them.
    pub controllers: Vec<String>,
    /// The names (DNS names and IP addresses) the controllers' server certificate carries.
    pub server_names: Vec<String>,
    /// The bundle-signing public key announced to replace the current one: bundles and
    /// freshness stamps signed with it are taken, and once one is, the current key is not.
    pub next_signing_key: Option<[u8; 32]>,
    /// SHA-256 of the mesh CA the controller holds as current, once the mesh has rotated (or is
    /// rotating) its CA (ADR 0029): a node that holds the announced next CA under this
    /// fingerprint makes it its only CA.
    pub ca: Option<[u8; 32]>,
    /// The next mesh CA's certificate (PEM), announced in bundles signed by the current key
    /// while a CA rotation is open: the node trusts it beside the current one, and renews its
    /// certificate under it.
    pub next_ca: Option<String>,
    /// How many nodes the mesh has revoked, ever (ADR 0024): it only rises. A node refuses a
    /// bundle that counts fewer than one it applied: that controller was restored from before
    /// some revocation, and its bundles may put a revoked key back among the node's peers.
    pub revocations: u64,
}

/// The most bytes `next_ca` holds (one PEM certificate).
pub const MAX_CA_PEM: usize = 8 * 1024;

impl TrustFile {
    /// The file's text, keys in a fixed order.
    pub fn write(&self) -> String {
        let list = |items: &[String]| items.iter().map(|i| format!("\"{}\"", i.escape_default())).collect::<Vec<_>>().join(", ");
        let mut s = String::from("# trellis: what this node trusts, delivered in its signed bundle. Generated; do not edit.\n");
        s.push_str("# The controllers this node asks, in order (`trellis controllers add|remove`).\n");
        let _ = writeln!(s, "controllers = [{}]", list(&self.controllers));
        let _ = writeln!(s, "server_names = [{}]", list(&self.server_names));
        if let Some(key) = &self.next_signing_key {
            s.push_str("# The bundle-signing key that comes next (`trellis rotate signing-key`).\n");
            let _ = writeln!(s, "next_signing_key = \"{}\"", base64::engine::general_purpose::STANDARD.encode(key));
        }
        if let Some(fp) = &self.ca {
            s.push_str("# The mesh CA (SHA-256 of its certificate) and the one that comes next (`trellis rotate ca`).\n");
            let _ = writeln!(s, "ca = \"{}\"", crate::token::hex(fp));
        }
        if let Some(pem) = &self.next_ca {
            let _ = writeln!(s, "next_ca = \"{}\"", pem.replace('\n', "\\n"));
        }
        if self.revocations > 0 {
            s.push_str("# How many nodes this mesh has revoked: a bundle that counts fewer is refused.\n");
            let _ = writeln!(s, "revocations = {}", self.revocations);
        }
        s
    }

    /// Reads the file: `controllers` (1 to [`MAX_CONTROLLERS`] of `HOST:PORT`) and
    /// `server_names` are required, `next_signing_key` optional; any other key is an error
    /// naming it.
    pub fn parse(text: &str) -> Result<TrustFile, TrustFileError> {
        let err = |problem: String| TrustFileError { problem };
        let table = DeTable::parse(text).map_err(|e| err(format!("invalid TOML: {}", e.message().trim_end_matches('\n'))))?;
        let mut file = TrustFile::default();
        let (mut controllers, mut names) = (None, None);
        let strings = |key: &str, value: &toml::de::DeValue| -> Result<Vec<String>, TrustFileError> {
            let items = value.as_array().ok_or_else(|| err(format!("`{key}` must be an array of strings")))?;
            items
                .iter()
                .map(|i| i.get_ref().as_str().map(str::to_string).ok_or_else(|| err(format!("`{key}` must be an array of strings"))))
                .collect()
        };
        for (key, value) in table.get_ref().iter() {
            match key.get_ref().as_ref() {
                "controllers" => controllers = Some(strings("controllers", value.get_ref())?),
                "server_names" => names = Some(strings("server_names", value.get_ref())?),
                "next_signing_key" => {
                    let key = value
                        .get_ref()
                        .as_str()
                        .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
                        .and_then(|b| <[u8; 32]>::try_from(b).ok())
                        .ok_or_else(|| err("`next_signing_key` is not 32 bytes of base64".into()))?;
                    file.next_signing_key = Some(key);
                }
                "ca" => {
                    let fp = value.get_ref().as_str().and_then(fingerprint).ok_or_else(|| err("`ca` is not 64 hex digits".into()))?;
                    file.ca = Some(fp);
                }
                "next_ca" => {
                    let pem = value.get_ref().as_str().ok_or_else(|| err("`next_ca` must be a string".into()))?;
                    let pem_chars = pem.bytes().all(|b| b.is_ascii_alphanumeric() || b"+/=- \n".contains(&b));
                    if pem.len() > MAX_CA_PEM || !pem_chars || !pem.starts_with("-----BEGIN CERTIFICATE-----") {
                        return Err(err(format!("`next_ca` is not one PEM certificate of at most {MAX_CA_PEM} bytes")));
                    }
                    file.next_ca = Some(pem.to_string());
                }
                "revocations" => {
                    let n = value.get_ref().as_integer().and_then(|i| u64::from_str_radix(i.as_str(), i.radix()).ok());
                    file.revocations = n.ok_or_else(|| err("`revocations` is not a count".into()))?;
                }
                other => return Err(err(format!("unknown key `{other}`"))),
            }
        }
        file.controllers = controllers.ok_or_else(|| err("no `controllers`".into()))?;
        file.server_names = names.ok_or_else(|| err("no `server_names`".into()))?;
        if file.controllers.is_empty() || file.controllers.len() > MAX_CONTROLLERS {
            return Err(err(format!("`controllers` must hold 1 to {MAX_CONTROLLERS} addresses")));
        }
        if let Some(bad) = file.controllers.iter().find(|c| !controller_address(c)) {
            return Err(err(format!("`controllers` holds {bad:?}, which is not HOST:PORT")));
        }
        Ok(file)
    }
}

/// Whether `s` is a controller's address as a node dials it: `HOST:PORT` (an IPv6 host in
/// brackets), the host a DNS name or an IP address, at most 255 characters.
pub fn controller_address(s: &str) -> bool {
    if s.len() > 255 {
        return false;
    }
    if s.parse::<std::net::SocketAddr>().is_ok() {
        return true;
    }
    let Some((host, port)) = s.rsplit_once(':') else { return false };
    let name = !host.is_empty()
        && host.split('.').all(|l| !l.is_empty() && l.len() <= 63 && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    name && port.parse::<u16>().is_ok_and(|p| p > 0)
}

/// 64 lower- or upper-case hex digits as 32 bytes.
fn fingerprint(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// A `trust.toml` this reader refuses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrustFileError {
    pub problem: String,
}

impl fmt::Display for TrustFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "trust.toml: {}", self.problem)
    }
}

impl std::error::Error for TrustFileError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_back_what_it_writes_and_refuses_what_it_does_not_know() {
        let plain = TrustFile { controllers: vec!["127.0.0.1:8443".into()], server_names: vec!["127.0.0.1".into()], ..Default::default() };
        let rotating = TrustFile {
            controllers: vec!["c1.acme.example:8443".into(), "[fd00::1]:8443".into()],
            server_names: vec!["c1.acme.example".into(), "fd00::1".into()],
            next_signing_key: Some([9; 32]),
            ca: Some([7; 32]),
            next_ca: Some("-----BEGIN CERTIFICATE-----\nMIIB+zCC\n-----END CERTIFICATE-----\n".into()),
            revocations: 3,
        };
        for f in [plain, rotating] {
            assert_eq!(TrustFile::parse(&f.write()), Ok(f.clone()), "{}", f.write());
        }
        for (text, problem) in [
            ("controllers = []\nserver_names = []\n", "`controllers` must hold 1 to 32 addresses"),
            ("controllers = [\"a b:1\"]\nserver_names = []\n", "`controllers` holds \"a b:1\", which is not HOST:PORT"),
            ("controllers = [\"a:1\"]\n", "no `server_names`"),
            ("controllers = [\"a:1\"]\nserver_names = []\nnext_signing_key = \"AAAA\"\n", "`next_signing_key` is not 32 bytes of base64"),
            ("controllers = [\"a:1\"]\nserver_names = []\nroot_keys = []\n", "unknown key `root_keys`"),
            ("controllers = [\"a:1\"]\nserver_names = []\nca = \"abcd\"\n", "`ca` is not 64 hex digits"),
            ("controllers = [\"a:1\"]\nserver_names = []\nrevocations = -1\n", "`revocations` is not a count"),
            ("controllers = [\"a:1\"]\nserver_names = []\nrevocations = \"2\"\n", "`revocations` is not a count"),
            (
                "controllers = [\"a:1\"]\nserver_names = []\nnext_ca = \"-----BEGIN CERTIFICATE-----\\n<script>\"\n",
                "`next_ca` is not one PEM certificate of at most 8192 bytes",
            ),
        ] {
            assert_eq!(TrustFile::parse(text).map_err(|e| e.problem), Err(problem.to_string()), "{text}");
        }
    }
}

//! Exposure through Traefik (ADR 0026): an ingress node's dynamic configuration for Traefik's
//! file provider (`etc/trellis/traefik/trellis.yml`), the settings its static configuration is
//! made from (`etc/trellis/ingress.toml`, written here and read back by the agent), and that
//! static configuration. Pure: text in, text out.

use std::fmt::Write;
use std::net::IpAddr;

use crate::decl::ExposeTls;
use crate::plan::{ExposurePlan, NodePlan};

/// The name of the ACME certificate resolver in the static and dynamic configurations.
pub const RESOLVER: &str = "trellis";

/// The name of the entry point on `port`.
pub fn entry_point(port: u16) -> String {
    format!("trellis-{port}")
}

/// A backend's address as a URL's authority or a TCP address: `10.88.0.3:8080`, `[fd88::3]:8080`.
fn authority(ip: IpAddr, port: u16) -> String {
    std::net::SocketAddr::new(ip, port).to_string()
}

/// Whether `s` is an ACME directory as a declaration may give it: `https://`, a host, and only the
/// bytes a URL is written with (no quotes, backslashes, braces, spaces or controls), so that it
/// reads as one string in every file it is written into (the review of 2026-12-02, finding 4).
pub fn acme_directory_ok(s: &str) -> bool {
    let Some(rest) = s.strip_prefix("https://") else { return false };
    let host = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host = host.rsplit('@').next().unwrap_or_default();
    !host.is_empty()
        && !host.starts_with(':')
        && s.len() <= 2048
        && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b"-._~:/?#[]@!$&()*+,;=%".contains(&b))
}

/// Whether `s` is an email address as ACME accounts take one: `USER@DOMAIN`, the user of the
/// letters, digits and `.!#$%&*+/=?^_|~-` of RFC 5322's atoms (no quotes, backslashes or
/// braces), the domain of two or more DNS labels.
pub fn acme_email_ok(s: &str) -> bool {
    let Some((user, domain)) = s.split_once('@') else { return false };
    let label = |l: &str| !l.is_empty() && l.len() <= 63 && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    s.len() <= 254
        && !user.is_empty()
        && user.bytes().all(|b| b.is_ascii_alphanumeric() || b".!#$%&*+/=?^_|~-".contains(&b))
        && domain.split('.').count() >= 2
        && domain.split('.').all(label)
}

fn list(items: impl IntoIterator<Item = String>) -> String {
    let v: Vec<String> = items.into_iter().map(|s| format!("\"{s}\"")).collect();
    format!("[{}]", v.join(", "))
}

/// The dynamic configuration of an ingress node: per exposure one router per host name (HTTP,
/// or TCP by SNI for `passthrough`), its service over the runners with keys (with a health check
/// for HTTP), and an allow-list middleware of its `sources`. Names, host names and prefixes are
/// validated by `load`, so nothing here needs quoting beyond the double quotes.
pub fn dynamic(plan: &NodePlan) -> String {
    let mut s = format!("# trellis: Traefik routes of ingress node {} in mesh {}. Generated; do not edit.\n", plan.node, plan.common.mesh);
    let (http, tcp): (Vec<&ExposurePlan>, Vec<&ExposurePlan>) = plan.ingress.iter().partition(|e| e.tls != ExposeTls::Passthrough);
    if !http.is_empty() {
        s.push_str("http:\n  routers:\n");
        for e in &http {
            for (i, h) in e.hostnames.iter().enumerate() {
                let _ = writeln!(s, "    {}-{i}:", e.name);
                let _ = writeln!(s, "      entryPoints: [\"{}\"]", entry_point(e.listen));
                let _ = writeln!(s, "      rule: \"Host(`{h}`)\"");
                let _ = writeln!(s, "      service: \"{}\"", e.name);
                let _ = writeln!(s, "      middlewares: [\"{}-sources\"]", e.name);
                if e.tls == ExposeTls::Acme {
                    let _ = writeln!(s, "      tls:\n        certResolver: \"{RESOLVER}\"\n        domains:\n          - main: \"{h}\"");
                }
            }
        }
        s.push_str("  services:\n");
        for e in &http {
            let _ = writeln!(s, "    {}:\n      loadBalancer:", e.name);
            if e.backends.is_empty() {
                s.push_str("        servers: []\n");
            } else {
                s.push_str("        servers:\n");
                for (name, ip) in &e.backends {
                    let _ = writeln!(s, "          # {name}\n          - url: \"http://{}\"", authority(*ip, e.port));
                }
            }
            s.push_str("        healthCheck:\n          path: \"/\"\n          interval: \"2s\"\n          timeout: \"1s\"\n");
        }
        s.push_str("  middlewares:\n");
        for e in &http {
            let _ = writeln!(
                s,
                "    {}-sources:\n      ipAllowList:\n        sourceRange: {}",
                e.name,
                list(e.sources.iter().map(|p| p.to_string()))
            );
        }
    }
    if !tcp.is_empty() {
        s.push_str("tcp:\n  routers:\n");
        for e in &tcp {
            for (i, h) in e.hostnames.iter().enumerate() {
                let _ = writeln!(s, "    {}-{i}:", e.name);
                let _ = writeln!(s, "      entryPoints: [\"{}\"]", entry_point(e.listen));
                let _ = writeln!(s, "      rule: \"HostSNI(`{h}`)\"");
                let _ = writeln!(s, "      service: \"{}\"", e.name);
                let _ = writeln!(s, "      middlewares: [\"{}-sources\"]", e.name);
                s.push_str("      tls:\n        passthrough: true\n");
            }
        }
        s.push_str("  services:\n");
        for e in &tcp {
            let _ = writeln!(s, "    {}:\n      loadBalancer:", e.name);
            if e.backends.is_empty() {
                s.push_str("        servers: []\n");
            } else {
                s.push_str("        servers:\n");
                for (name, ip) in &e.backends {
                    let _ = writeln!(s, "          # {name}\n          - address: \"{}\"", authority(*ip, e.port));
                }
            }
        }
        s.push_str("  middlewares:\n");
        for e in &tcp {
            let _ = writeln!(
                s,
                "    {}-sources:\n      ipAllowList:\n        sourceRange: {}",
                e.name,
                list(e.sources.iter().map(|p| p.to_string()))
            );
        }
    }
    s
}

/// What an ingress node's static configuration is made from: the ports it listens on and the
/// ACME directory and contact, as `ingress.toml` holds them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IngressFile {
    pub node: String,
    /// The entry points' ports, ascending.
    pub listen: Vec<u16>,
    pub acme_directory: Option<String>,
    pub acme_email: Option<String>,
}

impl IngressFile {
    pub fn of(plan: &NodePlan) -> IngressFile {
        let mut listen: Vec<u16> = plan.ingress.iter().map(|e| e.listen).collect();
        listen.sort_unstable();
        listen.dedup();
        let (acme_directory, acme_email) = match &plan.acme {
            Some((d, e)) => (Some(d.clone()), e.clone()),
            None => (None, None),
        };
        IngressFile { node: plan.node.to_string(), listen, acme_directory, acme_email }
    }

    pub fn write(&self) -> String {
        let mut s =
            format!("# trellis: ingress settings of node {}: Traefik's entry points and ACME. Generated; do not edit.\n", self.node);
        let ports: Vec<String> = self.listen.iter().map(|p| p.to_string()).collect();
        let _ = writeln!(s, "listen = [{}]", ports.join(", "));
        // Written by TOML's own serializer: whatever they hold, they read back as the same strings.
        if let Some(d) = &self.acme_directory {
            let _ = writeln!(s, "acme_directory = {}", toml::Value::String(d.clone()));
        }
        if let Some(e) = &self.acme_email {
            let _ = writeln!(s, "acme_email = {}", toml::Value::String(e.clone()));
        }
        s
    }

    /// Reads the file back: `listen` is required, any other key than the three is refused, naming it.
    pub fn parse(node: &str, text: &str) -> Result<IngressFile, String> {
        use toml::de::{DeTable, DeValue};
        let table = DeTable::parse(text).map_err(|e| format!("invalid TOML: {}", e.message().trim_end_matches('\n')))?;
        let mut out = IngressFile { node: node.to_string(), ..Default::default() };
        let mut listen = None;
        for (key, value) in table.get_ref().iter() {
            let string = || value.get_ref().as_str().map(str::to_string).ok_or_else(|| format!("`{}` must be a string", key.get_ref()));
            match key.get_ref().as_ref() {
                "listen" => {
                    let DeValue::Array(items) = value.get_ref() else { return Err("`listen` must be an array of ports".into()) };
                    let mut ports = Vec::new();
                    for i in items.iter() {
                        let port = match i.get_ref() {
                            DeValue::Integer(n) => n.as_str().parse::<u16>().ok().filter(|&p| p > 0),
                            _ => None,
                        };
                        ports.push(port.ok_or("`listen` must hold ports from 1 to 65535")?);
                    }
                    listen = Some(ports);
                }
                // Checked as a declaration's are: Traefik's static configuration is made of them.
                "acme_directory" => {
                    let d = string()?;
                    if !acme_directory_ok(&d) {
                        return Err(format!("`acme_directory` {d:?} is not an https:// URL of an ACME directory"));
                    }
                    out.acme_directory = Some(d);
                }
                "acme_email" => {
                    let e = string()?;
                    if !acme_email_ok(&e) {
                        return Err(format!("`acme_email` {e:?} is not an email address"));
                    }
                    out.acme_email = Some(e);
                }
                other => return Err(format!("unknown key `{other}`")),
            }
        }
        out.listen = listen.ok_or("the required key `listen` is missing")?;
        Ok(out)
    }
}

/// Where the agent's Traefik keeps what it writes and reads.
#[derive(Clone, Debug)]
pub struct StaticPaths {
    /// The directory the file provider watches (`etc/trellis/traefik` under the agent's root).
    pub dynamic_dir: String,
    /// The ACME account and certificates (created 0600 by the agent before Traefik starts).
    pub acme_storage: String,
    /// Traefik's API and ping, on loopback only: `127.0.0.1:PORT`.
    pub api: String,
}

/// Traefik's static configuration (YAML) for an ingress: one entry point per port, the file
/// provider watching the dynamic configuration's directory, the ACME resolver (TLS-ALPN-01 on the
/// entry point of port 443, or of the first port) when the ingress has a directory, and the API
/// on a loopback entry point of its own.
pub fn static_config(ingress: &IngressFile, paths: &StaticPaths) -> String {
    let mut s = format!("# trellis-agent: Traefik of ingress node {}. Written by the agent; do not edit.\n", ingress.node);
    // Traefik asks the internet for new releases unless told not to; nothing leaves for that.
    s.push_str("global:\n  checkNewVersion: false\n  sendAnonymousUsage: false\n");
    s.push_str("entryPoints:\n");
    for p in &ingress.listen {
        let _ = writeln!(s, "  {}:\n    address: \":{p}\"", entry_point(*p));
    }
    // `traefik` is the entry point the API and ping are served on: loopback only.
    let _ = writeln!(s, "  traefik:\n    address: \"{}\"", paths.api);
    // A new dynamic file takes effect within a fifth of a second (Traefik waits 2 s by default):
    // a revoked backend stops being sent to as soon as the bundle without it is written.
    let _ = writeln!(
        s,
        "providers:\n  providersThrottleDuration: \"200ms\"\n  file:\n    directory: \"{}\"\n    watch: true",
        paths.dynamic_dir
    );
    s.push_str("api:\n  insecure: true\n  dashboard: false\n");
    s.push_str("ping:\n  entryPoint: \"traefik\"\n");
    s.push_str("log:\n  level: \"INFO\"\n  noColor: true\n");
    if let Some(dir) = &ingress.acme_directory {
        let _ = writeln!(
            s,
            "certificatesResolvers:\n  {RESOLVER}:\n    acme:\n      caServer: {}\n      storage: {}",
            crate::nodefile::quoted(dir),
            crate::nodefile::quoted(&paths.acme_storage)
        );
        if let Some(e) = &ingress.acme_email {
            let _ = writeln!(s, "      email: {}", crate::nodefile::quoted(e));
        }
        s.push_str("      tlsChallenge: {}\n");
    }
    s
}

//! An ingress node's Traefik as its agent reports it (ADR 0026): `POST /v1/node/ingress`, and
//! every ingress node's last report as operators see it (`trellis status`, the metrics).

use serde::{Deserialize, Serialize};

/// The most routers and certificates one report may name, and the longest text in it (longer is
/// cut by the controller at a character boundary).
pub const MAX_INGRESS_ITEMS: usize = 256;
pub const MAX_INGRESS_TEXT: usize = 512;

/// What the agent sees of its Traefik after each apply and while it waits.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct IngressReport {
    /// `running`, `stopped` (the operator runs Traefik: `--ingress none`) or `failed`.
    pub traefik: String,
    pub error: Option<String>,
    pub routers: Vec<IngressRouter>,
    pub certificates: Vec<IngressCertificate>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct IngressRouter {
    /// `shop-0`: the exposure and the host name's position.
    pub name: String,
    /// Traefik's word: `enabled`, `warning` or `disabled`.
    pub status: String,
    pub errors: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct IngressCertificate {
    pub hostname: String,
    /// Unix seconds.
    pub not_after: i64,
}

/// The answer to a report: whether it was recorded (the node is an ingress of the current
/// declaration).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct IngressAck {
    pub recorded: bool,
}

/// An ingress node's last report, with when it arrived (the controller's clock).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct IngressState {
    pub node: String,
    pub reported_at: i64,
    pub report: IngressReport,
}

impl IngressState {
    /// One line for `trellis status`: `edge-1: ingress: Traefik running, 1 of 1 routers
    /// enabled, certificates: shop.example.com (89 d)`, with each router's errors.
    pub fn summary(&self, now: i64) -> String {
        use crate::text::{duration, printable};
        let r = &self.report;
        let enabled = r.routers.iter().filter(|x| x.status == "enabled").count();
        let mut out = format!(
            "{}: ingress: Traefik {}{}, {} of {} router(s) enabled",
            printable(&self.node),
            printable(&r.traefik),
            r.error.as_ref().map_or(String::new(), |e| format!(" ({})", printable(e))),
            enabled,
            r.routers.len()
        );
        for x in r.routers.iter().filter(|x| x.status != "enabled") {
            out.push_str(&format!("; {} {}: {}", printable(&x.name), printable(&x.status), printable(&x.errors.join("; "))));
        }
        if !r.certificates.is_empty() {
            let certs: Vec<String> = r
                .certificates
                .iter()
                .map(|c| {
                    let left = c.not_after.saturating_sub(now);
                    let when = if left > 0 { format!("expires in {}", duration(left)) } else { "expired".to_string() };
                    format!("{} ({when})", printable(&c.hostname))
                })
                .collect();
            out.push_str(&format!(", certificates: {}", certs.join(", ")));
        }
        out
    }
}

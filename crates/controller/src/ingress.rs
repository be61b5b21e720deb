//! What ingress nodes report of their Traefik (ADR 0026): recorded for the nodes the current
//! declaration makes ingress nodes (the `via` of an exposure), bounded, and shown with the
//! node's status.

use std::collections::{HashMap, HashSet};

use trellis_proto as proto;
use trellis_proto::ingress::{MAX_INGRESS_ITEMS, MAX_INGRESS_TEXT};

use crate::{Controller, Error, NodeIdentity, Result};

/// A text of the node's, as kept: cut to `MAX_INGRESS_TEXT` bytes, control characters escaped.
fn cut(text: &str) -> String {
    crate::certs::cut(text, MAX_INGRESS_TEXT)
}

/// The report as it is kept: every text cut, at most `MAX_INGRESS_ITEMS` of each list (and of a
/// router's errors).
fn bounded(r: &proto::IngressReport) -> proto::IngressReport {
    proto::IngressReport {
        traefik: cut(&r.traefik),
        error: r.error.as_deref().map(cut),
        routers: r
            .routers
            .iter()
            .take(MAX_INGRESS_ITEMS)
            .map(|x| proto::IngressRouter {
                name: cut(&x.name),
                status: cut(&x.status),
                errors: x.errors.iter().take(8).map(|e| cut(e)).collect(),
            })
            .collect(),
        certificates: r
            .certificates
            .iter()
            .take(MAX_INGRESS_ITEMS)
            .map(|c| proto::IngressCertificate { hostname: cut(&c.hostname), not_after: c.not_after })
            .collect(),
    }
}

impl Controller {
    /// The ingress nodes of the current declaration.
    async fn ingress_nodes(&self) -> Result<HashSet<String>> {
        let Some((_, decl)) = self.current_declaration().await? else { return Ok(HashSet::new()) };
        Ok(decl.exposures.iter().flat_map(|e| e.via.iter().cloned()).collect())
    }

    /// Records `who`'s report of its Traefik, if the current declaration makes it an ingress
    /// node; returns whether it did. A report naming more than `MAX_INGRESS_ITEMS` routers or
    /// certificates is refused; texts are cut to `MAX_INGRESS_TEXT` bytes.
    pub async fn report_ingress(&self, who: &NodeIdentity, report: &proto::IngressReport) -> Result<bool> {
        self.require_approved(who)?;
        if report.routers.len() > MAX_INGRESS_ITEMS || report.certificates.len() > MAX_INGRESS_ITEMS {
            return Err(Error::BadRequest(format!(
                "an ingress report names at most {MAX_INGRESS_ITEMS} routers and {MAX_INGRESS_ITEMS} certificates"
            )));
        }
        if !self.ingress_nodes().await?.contains(&who.name) {
            return Ok(false);
        }
        let kept = serde_json::to_string(&bounded(report)).map_err(|e| Error::internal("writing an ingress report", e))?;
        self.store.report_ingress(&who.name, &kept, self.now()).await?;
        Ok(true)
    }

    /// The last report of every ingress node of the current declaration, by node.
    pub(crate) async fn ingress_states(&self) -> Result<HashMap<String, proto::IngressState>> {
        let ingress = self.ingress_nodes().await?;
        if ingress.is_empty() {
            return Ok(HashMap::new());
        }
        Ok(self
            .store
            .ingress_reports()
            .await?
            .into_iter()
            .filter(|(node, _, _)| ingress.contains(node))
            .filter_map(|(node, text, at)| {
                let report = serde_json::from_str(&text).ok()?;
                Some((node.clone(), proto::IngressState { node, reported_at: at, report }))
            })
            .collect())
    }
}

//! The controller's Prometheus metrics: counters and histograms that decisions, publish runs and
//! the HTTP edge record into, and gauges of the roster (nodes by state, stale, failing, evidence
//! gaps) filled from `Controller::status` when they are scraped. Names follow Prometheus
//! conventions: a `trellis_` prefix, units in the name, `_total` on counters.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use trellis_proto::{self as proto, EvidenceResult, NodeState, NodeStatus};

use crate::Controller;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PathLabel {
    pub path: &'static str,
}

/// The paths a relayed pair may be on (ADR 0032), each always shown.
pub const PAIR_PATHS: [&str; 3] = ["direct", "trying", "relayed"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabel {
    pub node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AnswerLabel {
    /// `200` (the whole bundle), `delta` (the edits from the one held) or `304`.
    pub answer: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabel {
    /// One of [`METHODS`], or `other`: never the method as the client sent it.
    pub method: &'static str,
    /// The route as the router names it (`/v1/admin/nodes/{name}/revoke`), or [`UNMATCHED`];
    /// never the raw path.
    pub route: String,
    pub status: u16,
}

/// The request methods counted under their own name; any other is counted as `other`.
pub const METHODS: [&str; 9] = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE"];

/// The route label of a request that matched no route.
pub const UNMATCHED: &str = "unmatched";

/// The label of a request method: one of a fixed set, so that a client sending made-up methods
/// cannot make a series per method (5,000 made-up methods of 4,000 bytes made one scrape
/// 410 MB).
pub fn method_label(method: &str) -> &'static str {
    METHODS.iter().find(|m| **m == method).copied().unwrap_or("other")
}

/// The kinds of decision counted by `trellis_decisions_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Apply,
    TokenCreate,
    TokenRevoke,
    Enrol,
    Renew,
    Approve,
    Revoke,
}

impl Decision {
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Apply => "apply",
            Decision::TokenCreate => "token_create",
            Decision::TokenRevoke => "token_revoke",
            Decision::Enrol => "enrol",
            Decision::Renew => "renew",
            Decision::Approve => "approve",
            Decision::Revoke => "revoke",
        }
    }
}

fn latency() -> Histogram {
    // 1 ms to about 65 s: a long-poll may last a minute.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// Every metric of one controller process.
pub struct Metrics {
    registry: Registry,
    enrolments: Family<ResultLabel, Counter>,
    decisions: Family<KindLabel, Counter>,
    publish_runs: Family<ResultLabel, Counter>,
    publish_duration: Histogram,
    published_bundles: Counter,
    bundle_answers: Family<AnswerLabel, Counter>,
    bundle_bytes: Counter,
    renumbered: Counter,
    long_polls: Gauge,
    requests: Family<RouteLabel, Histogram, fn() -> Histogram>,
    nodes: Family<StateLabel, Gauge>,
    stale: Gauge,
    stale_for: Family<NodeLabel, Gauge>,
    failing: Gauge,
    evidence_missing: Gauge,
    revoking: Gauge,
    pairs: Family<PathLabel, Gauge>,
    revoking_oldest: Gauge,
    scrape_errors: Counter,
    service_certs_issued: Counter,
    service_cert_refusals: Family<ReasonLabel, Counter>,
    service_cert_expiry: Family<NodeLabel, Gauge>,
    ingress_routers: Family<RouterLabel, Gauge>,
    ingress_cert_expiry: Family<NodeLabel, Gauge>,
}

/// An ingress node and a router status as Traefik says it (`enabled`, `warning`, `disabled`, or
/// `other`): a fixed set per node.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouterLabel {
    pub node: String,
    pub status: &'static str,
}

/// Traefik's router statuses, as the metric labels them.
const ROUTER_STATUSES: [&str; 4] = ["enabled", "warning", "disabled", "other"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// One of [`crate::certs::REFUSAL_REASONS`].
    pub reason: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut r = Registry::with_prefix("trellis");
        let enrolments = Family::<ResultLabel, Counter>::default();
        r.register("enrolments", "Enrolment requests by result (enrolled, pending, or the refusal's code)", enrolments.clone());
        let decisions = Family::<KindLabel, Counter>::default();
        r.register("decisions", "Governance decisions taken by this process, by kind", decisions.clone());
        let publish_runs = Family::<ResultLabel, Counter>::default();
        r.register("publish_runs", "Publish runs by result (ok, failed)", publish_runs.clone());
        let publish_duration = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        r.register_with_unit("publish_run_duration", "Time one publish run took", Unit::Seconds, publish_duration.clone());
        let published_bundles = Counter::default();
        r.register("published_bundles", "Bundles given a new version by publish runs", published_bundles.clone());
        let bundle_answers = Family::<AnswerLabel, Counter>::default();
        r.register("bundle_answers", "Answers to GET /v1/bundle: 200 (whole), delta, 304 (unchanged)", bundle_answers.clone());
        let bundle_bytes = Counter::default();
        r.register_with_unit("bundle_sent", "Bundle and delta bytes sent", Unit::Bytes, bundle_bytes.clone());
        let renumbered = Counter::default();
        r.register(
            "bundles_renumbered",
            "Bundles numbered above what their node holds: the node held a version, or content under a version, this database never gave it (restored from an older backup)",
            renumbered.clone(),
        );
        let long_polls = Gauge::default();
        r.register("long_polls_open", "Bundle long-polls waiting now", long_polls.clone());
        let requests = Family::<RouteLabel, Histogram, fn() -> Histogram>::new_with_constructor(latency);
        r.register_with_unit("http_request_duration", "HTTP request latency by route, method and status", Unit::Seconds, requests.clone());
        let nodes = Family::<StateLabel, Gauge>::default();
        r.register("nodes", "Nodes of the roster by state", nodes.clone());
        let stale = Gauge::default();
        r.register("nodes_stale", "Active nodes that have not applied their desired version", stale.clone());
        let stale_for = Family::<NodeLabel, Gauge>::default();
        r.register_with_unit("node_stale", "How long each stale node has been stale", Unit::Seconds, stale_for.clone());
        let failing = Gauge::default();
        r.register("nodes_failing", "Nodes whose last evidence reports a failed apply", failing.clone());
        let evidence_missing = Gauge::default();
        r.register("evidence_missing_records", "Evidence sequence numbers missing, over every node (gaps)", evidence_missing.clone());
        let ingress_routers = Family::<RouterLabel, Gauge>::default();
        r.register(
            "ingress_routers",
            "On each ingress node, its trellis routers in Traefik by status, as its agent last reported (ADR 0026)",
            ingress_routers.clone(),
        );
        let ingress_cert_expiry = Family::<NodeLabel, Gauge>::default();
        r.register_with_unit(
            "ingress_certificate_expiry",
            "On each ingress node, the time until its earliest ACME certificate expires (negative: expired)",
            Unit::Seconds,
            ingress_cert_expiry.clone(),
        );
        let pairs = Family::<PathLabel, Gauge>::default();
        for path in PAIR_PATHS {
            let _ = pairs.get_or_create(&PathLabel { path });
        }
        r.register("pairs", "Relayed pairs by path, as their agents last said: direct, trying, or relayed (ADR 0032)", pairs.clone());
        let revoking = Gauge::default();
        r.register(
            "revocations_in_progress",
            "Revoked nodes whose key a node that held it has not dropped yet (revoking)",
            revoking.clone(),
        );
        let revoking_oldest = Gauge::default();
        r.register_with_unit(
            "revocation_oldest_age",
            "How long the oldest revocation in progress has been revoking (0 when none is)",
            Unit::Seconds,
            revoking_oldest.clone(),
        );
        let scrape_errors = Counter::default();
        r.register("metrics_roster_errors", "Scrapes whose roster gauges could not be read", scrape_errors.clone());
        let service_certs_issued = Counter::default();
        r.register("service_certificates_issued", "Service certificates signed (ADR 0023)", service_certs_issued.clone());
        let service_cert_refusals = Family::<ReasonLabel, Counter>::default();
        for reason in crate::certs::REFUSAL_REASONS {
            let _ = service_cert_refusals.get_or_create(&ReasonLabel { reason });
        }
        r.register(
            "service_certificate_refusals",
            "Service certificate requests and renewals refused, by reason",
            service_cert_refusals.clone(),
        );
        let service_cert_expiry = Family::<NodeLabel, Gauge>::default();
        r.register(
            "service_certificate_earliest_expiry_timestamp_seconds",
            "Per node holding a declared service certificate: when the first of them expires (Unix seconds)",
            service_cert_expiry.clone(),
        );
        Metrics {
            registry: r,
            enrolments,
            decisions,
            publish_runs,
            publish_duration,
            published_bundles,
            bundle_answers,
            bundle_bytes,
            renumbered,
            long_polls,
            requests,
            nodes,
            stale,
            stale_for,
            failing,
            evidence_missing,
            revoking,
            revoking_oldest,
            pairs,
            scrape_errors,
            service_certs_issued,
            service_cert_refusals,
            service_cert_expiry,
            ingress_routers,
            ingress_cert_expiry,
        }
    }

    pub(crate) fn service_cert_issued(&self) {
        self.service_certs_issued.inc();
    }

    /// A service certificate refused, by one of [`crate::certs::REFUSAL_REASONS`].
    pub(crate) fn service_cert_refused(&self, reason: &'static str) {
        self.service_cert_refusals.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Sets the earliest expiry of each node's declared, issued service certificates; a node
    /// without one has no series.
    pub fn service_cert_expiries(&self, certs: &[proto::ServiceCertInfo]) {
        self.service_cert_expiry.clear();
        let mut earliest: std::collections::BTreeMap<&str, i64> = Default::default();
        for c in certs.iter().filter(|c| c.declared) {
            if let Some(t) = c.not_after {
                let e = earliest.entry(c.node.as_str()).or_insert(t);
                *e = (*e).min(t);
            }
        }
        for (node, t) in earliest {
            self.service_cert_expiry.get_or_create(&NodeLabel { node: node.to_string() }).set(t);
        }
    }

    /// An enrolment request answered: `enrolled`, `pending`, or the refusal's code.
    pub fn enrolment(&self, result: &str) {
        self.enrolments.get_or_create(&ResultLabel { result: result.to_string() }).inc();
    }

    pub fn decision(&self, kind: Decision) {
        self.decisions.get_or_create(&KindLabel { kind: kind.as_str() }).inc();
    }

    /// One publish run finished (`Ok` with the bundles it published) or failed.
    pub fn publish_run(&self, took: Duration, outcome: Result<usize, ()>) {
        self.publish_duration.observe(took.as_secs_f64());
        let result = if outcome.is_ok() { "ok" } else { "failed" };
        self.publish_runs.get_or_create(&ResultLabel { result: result.to_string() }).inc();
        if let Ok(n) = outcome {
            self.published_bundles.inc_by(n as u64);
        }
    }

    /// A bundle answer: `200`, `delta` or `304`, and the bytes of its body.
    pub fn bundle_answer(&self, answer: &'static str, bytes: usize) {
        self.bundle_answers.get_or_create(&AnswerLabel { answer }).inc();
        self.bundle_bytes.inc_by(bytes as u64);
    }

    /// A bundle numbered above what its node held (`Controller::bundle_answer`).
    pub fn renumbered(&self) {
        self.renumbered.inc();
    }

    /// Counts a long-poll open for as long as the guard lives.
    pub(crate) fn long_poll(&self) -> LongPoll {
        self.long_polls.inc();
        LongPoll(self.long_polls.clone())
    }

    pub fn request(&self, method: &str, route: &str, status: u16, took: Duration) {
        self.requests
            .get_or_create(&RouteLabel { method: method_label(method), route: route.to_string(), status })
            .observe(took.as_secs_f64());
    }

    /// Sets the roster gauges from a status read (`None`: the read failed, counted).
    pub fn roster(&self, status: Option<&[NodeStatus]>) {
        let Some(status) = status else {
            self.scrape_errors.inc();
            return;
        };
        for s in NodeState::ALL {
            let n = status.iter().filter(|n| n.state == *s).count();
            self.nodes.get_or_create(&StateLabel { state: s.as_str() }).set(n as i64);
        }
        self.stale_for.clear();
        let mut stale = 0;
        for n in status.iter().filter(|n| n.stale) {
            stale += 1;
            self.stale_for.get_or_create(&NodeLabel { node: n.name.clone() }).set(n.stale_for.unwrap_or(0).max(0));
        }
        self.stale.set(stale);
        self.failing.set(status.iter().filter(|n| n.last_result == Some(EvidenceResult::Failed)).count() as i64);
        self.evidence_missing.set(status.iter().map(|n| n.evidence_missing).sum());
        let revoking: Vec<i64> =
            status.iter().filter(|n| n.state == NodeState::Revoking).filter_map(|n| n.revocation.as_ref().map(|r| r.seconds)).collect();
        self.revoking.set(revoking.len() as i64);
        self.ingress_routers.clear();
        self.ingress_cert_expiry.clear();
        let now = crate::unix_now();
        for i in status.iter().filter_map(|n| n.ingress.as_ref()) {
            for st in ROUTER_STATUSES {
                let n = i
                    .report
                    .routers
                    .iter()
                    .filter(|r| if st == "other" { !ROUTER_STATUSES[..3].contains(&r.status.as_str()) } else { r.status == st })
                    .count();
                self.ingress_routers.get_or_create(&RouterLabel { node: i.node.clone(), status: st }).set(n as i64);
            }
            if let Some(earliest) = i.report.certificates.iter().map(|c| c.not_after).min() {
                self.ingress_cert_expiry.get_or_create(&NodeLabel { node: i.node.clone() }).set(earliest.saturating_sub(now));
            }
        }
        self.revoking_oldest.set(revoking.iter().copied().max().unwrap_or(0).max(0));
    }

    /// Sets the relayed pairs by path (`paths::path_counts`, in the order of `PAIR_PATHS`).
    pub fn pairs(&self, counts: [usize; 3]) {
        for (path, n) in PAIR_PATHS.into_iter().zip(counts) {
            self.pairs.get_or_create(&PathLabel { path }).set(n as i64);
        }
    }

    /// The text exposition in OpenMetrics; `trellis_proto::exposition` turns it into the
    /// format the scraper asks for.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String");
        out
    }
}

/// What the HTTP edge records: each request answered, and the decisions and enrolments it asked
/// for.
impl Controller {
    /// A request answered, by method (one of [`METHODS`] or `other`), the route it matched (the
    /// router's name for it, or [`UNMATCHED`]; never the raw path) and status.
    pub fn request_answered(&self, method: &str, route: &str, status: u16, took: Duration) {
        self.metrics.request(method, route, status, took);
    }

    /// A decision taken over the API, counted by kind.
    pub fn count_decision(&self, kind: Decision) {
        self.metrics.decision(kind);
    }

    /// An enrolment request answered, counted by the state it gave or the refusal's code.
    pub fn count_enrolment(&self, answer: &crate::Result<proto::EnrolResponse>) {
        self.metrics.enrolment(match answer {
            Ok(e) => e.state.as_str(),
            Err(e) => e.code(),
        });
    }

    /// The metrics in OpenMetrics, with the roster gauges set from
    /// `status` now.
    pub async fn scrape(&self) -> String {
        let status = self.status_with(false).await;
        self.metrics.roster(status.as_deref().ok());
        if let Ok(reports) = self.path_reports().await {
            let pairs = self.publisher.pairs.read().expect("pairs").clone();
            self.metrics.pairs(crate::paths::path_counts(&pairs.relayed.ranked, pairs.relayed.others, &reports));
        }
        match self.service_certs().await {
            Ok(certs) => self.metrics.service_cert_expiries(&certs),
            Err(_) => {
                self.metrics.scrape_errors.inc();
            }
        }
        self.metrics.encode()
    }
}

/// A long-poll counted open; dropped when it answers.
pub struct LongPoll(Gauge);

impl Drop for LongPoll {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, state: NodeState, stale_for: Option<i64>, last: Option<EvidenceResult>, missing: i64) -> NodeStatus {
        NodeStatus {
            name: name.to_string(),
            state,
            desired_version: Some(2),
            applied_version: Some(1),
            last_contact: None,
            cert_not_after: None,
            stale: stale_for.is_some(),
            stale_for,
            last_result: last,
            last_error: None,
            evidence_records: 3,
            evidence_missing: missing,
            revocation: None,
            agent_refused: None,
            clock_skew: None,
            ingress: None,
            paths: Vec::new(),
        }
    }

    fn revoking(name: &str, seconds: i64) -> NodeStatus {
        let revocation = proto::Revocation {
            node: name.to_string(),
            kind: proto::Withdrawal::Revocation,
            decided_at: 1000,
            completed_at: None,
            seconds,
            holders_known: true,
            holders: 1,
            holding: Vec::new(),
            unverified: Vec::new(),
        };
        NodeStatus { revocation: Some(revocation), ..node(name, NodeState::Revoking, None, None, 0) }
    }

    #[test]
    fn roster_gauges_follow_the_last_status_read_and_counters_carry_units() {
        let m = Metrics::new();
        m.roster(Some(&[
            node("a", NodeState::Active, Some(30), None, 0),
            node("b", NodeState::Active, None, Some(EvidenceResult::Failed), 2),
            node("c", NodeState::Pending, None, None, 0),
            revoking("d", 40),
            revoking("e", 7),
        ]));
        m.publish_run(Duration::from_millis(5), Ok(3));
        m.bundle_answer("304", 0);
        m.request("GET", "/v1/bundle", 304, Duration::from_millis(2));
        let text = m.encode();
        for line in [
            "trellis_nodes{state=\"active\"} 2",
            "trellis_nodes{state=\"pending\"} 1",
            "trellis_nodes{state=\"revoked\"} 0",
            "trellis_nodes{state=\"revoking\"} 2",
            "trellis_revocations_in_progress 2",
            "trellis_revocation_oldest_age_seconds 40",
            "trellis_nodes_stale 1",
            "trellis_node_stale_seconds{node=\"a\"} 30",
            "trellis_nodes_failing 1",
            "trellis_evidence_missing_records 2",
            "trellis_publish_runs_total{result=\"ok\"} 1",
            "trellis_publish_run_duration_seconds_count 1",
            "trellis_published_bundles_total 3",
            "trellis_bundle_answers_total{answer=\"304\"} 1",
            "trellis_http_request_duration_seconds_count{method=\"GET\",route=\"/v1/bundle\",status=\"304\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        // The next read replaces the per-node series: a node no longer stale is gone.
        m.roster(Some(&[node("a", NodeState::Active, None, None, 0)]));
        let text = m.encode();
        assert!(!text.contains("node=\"a\""), "{text}");
        assert!(text.lines().any(|l| l == "trellis_nodes_stale 0"), "{text}");
        assert!(text.lines().any(|l| l == "trellis_revocations_in_progress 0"), "{text}");
        assert!(text.lines().any(|l| l == "trellis_revocation_oldest_age_seconds 0"), "{text}");
        m.roster(None);
        assert!(m.encode().lines().any(|l| l == "trellis_metrics_roster_errors_total 1"));
        let _open = m.long_poll();
        assert!(m.encode().lines().any(|l| l == "trellis_long_polls_open 1"));
        drop(_open);
        assert!(m.encode().lines().any(|l| l == "trellis_long_polls_open 0"));
    }
}

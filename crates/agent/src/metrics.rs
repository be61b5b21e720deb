//! The agent's Prometheus metrics, served in plain HTTP at `/metrics` on the address given to
//! `trellis-agent run --metrics-listen` (for scraping beside node_exporter): applies by result
//! and their duration, and, from the status the run loop keeps, the bundle version, the time
//! since the controller last answered and since its last freshness stamp, the peers and the age
//! of each one's last handshake, and the evidence waiting to be sent.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};
use tokio::net::TcpListener;
use trellis_proto::exposition::Format;

use crate::status::AgentStatus;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabel {
    /// Traefik's word for a router: enabled, warning or disabled.
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HostLabel {
    /// A declared exposure's host name.
    hostname: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabel {
    /// `direct`, `trying` or `backing-off`.
    path: &'static str,
}

/// The states a relayed peer's path may be in (ADR 0032), each always shown.
const PATH_STATES: [&str; 3] = ["direct", "trying", "backing-off"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabel {
    /// The peer's WireGuard public key (what the interface knows it by).
    peer: String,
}

pub struct Metrics {
    registry: Registry,
    applies: Family<ResultLabel, Counter>,
    apply_duration: Histogram,
    version: Gauge,
    contact_age: Gauge,
    fresh_age: Gauge,
    peers: Gauge,
    handshake_age: Family<PeerLabel, Gauge>,
    buffered: Gauge,
    dropped: Gauge,
    traefik_running: Gauge,
    routers: Family<StatusLabel, Gauge>,
    cert_expiry: Family<HostLabel, Gauge>,
    paths: Family<PathLabel, Gauge>,
    received: Gauge,
    sent: Gauge,
    /// The status last written by the run loop; the gauges are set from it at each scrape.
    status: Mutex<AgentStatus>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut r = Registry::with_prefix("trellis_agent");
        let applies = Family::<ResultLabel, Counter>::default();
        r.register("applies", "Bundles applied, by result (applied, failed)", applies.clone());
        let apply_duration = Histogram::new(exponential_buckets(0.001, 2.0, 15));
        r.register_with_unit(
            "apply_duration",
            "Time from a verified bundle to its files written and applied",
            Unit::Seconds,
            apply_duration.clone(),
        );
        let version = Gauge::default();
        r.register("bundle_version", "The version of the bundle applied (0: none yet)", version.clone());
        let contact_age = Gauge::default();
        r.register_with_unit("last_contact_age", "Time since the controller last answered (-1: never)", Unit::Seconds, contact_age.clone());
        let fresh_age = Gauge::default();
        r.register_with_unit(
            "freshness_age",
            "Time since the newest signed freshness stamp's time (-1: none yet)",
            Unit::Seconds,
            fresh_age.clone(),
        );
        let peers = Gauge::default();
        r.register("peers", "WireGuard peers on the interface", peers.clone());
        let handshake_age = Family::<PeerLabel, Gauge>::default();
        r.register_with_unit(
            "peer_last_handshake_age",
            "Time since each peer's last handshake (peers without one are left out)",
            Unit::Seconds,
            handshake_age.clone(),
        );
        let buffered = Gauge::default();
        r.register("evidence_buffered_records", "Evidence records waiting to be sent", buffered.clone());
        let dropped = Gauge::default();
        r.register("evidence_dropped_records", "Evidence records dropped (buffer bound, or refused for good)", dropped.clone());
        let traefik_running = Gauge::default();
        r.register("ingress_traefik_running", "On an ingress node: 1 while the agent's Traefik runs", traefik_running.clone());
        let routers = Family::<StatusLabel, Gauge>::default();
        r.register("ingress_routers", "On an ingress node: trellis's routers in Traefik, by Traefik's status", routers.clone());
        let cert_expiry = Family::<HostLabel, Gauge>::default();
        r.register_with_unit(
            "ingress_certificate_expiry",
            "On an ingress node: time until each ACME certificate expires (negative: expired)",
            Unit::Seconds,
            cert_expiry.clone(),
        );
        let paths = Family::<PathLabel, Gauge>::default();
        r.register("paths", "Relayed peers this node may reach directly, by the state of the path (ADR 0032)", paths.clone());
        let received = Gauge::default();
        r.register_with_unit(
            "interface_received",
            "Bytes the interface received from all its peers (on a hub, mostly what it relays)",
            Unit::Bytes,
            received.clone(),
        );
        let sent = Gauge::default();
        r.register_with_unit("interface_sent", "Bytes the interface sent to all its peers", Unit::Bytes, sent.clone());
        Metrics {
            paths,
            received,
            sent,
            traefik_running,
            routers,
            cert_expiry,
            registry: r,
            applies,
            apply_duration,
            version,
            contact_age,
            fresh_age,
            peers,
            handshake_age,
            buffered,
            dropped,
            status: Mutex::new(AgentStatus::default()),
        }
    }

    /// One apply finished.
    pub fn apply(&self, applied: bool, took: Duration) {
        self.applies.get_or_create(&ResultLabel { result: if applied { "applied" } else { "failed" } }).inc();
        self.apply_duration.observe(took.as_secs_f64());
    }

    /// The status the run loop just wrote.
    pub fn status(&self, status: &AgentStatus) {
        *self.status.lock().expect("agent status") = status.clone();
    }

    /// The text exposition in OpenMetrics, the gauges set from the status as of `now` (Unix
    /// seconds); `trellis_proto::exposition` turns it into the format the scraper asks for.
    pub fn encode(&self, now: i64) -> String {
        {
            let s = self.status.lock().expect("agent status");
            self.version.set(s.version as i64);
            self.contact_age.set(s.last_contact.map_or(-1, |t| (now - t).max(0)));
            self.fresh_age.set(s.fresh_at.map_or(-1, |t| (now - t).max(0)));
            self.peers.set(s.peers.len() as i64);
            self.handshake_age.clear();
            for p in &s.peers {
                if let Some(t) = p.last_handshake.filter(|t| *t > 0) {
                    self.handshake_age.get_or_create(&PeerLabel { peer: p.public_key.clone() }).set((now - t as i64).max(0));
                }
            }
            for state in PATH_STATES {
                let n = s.paths.iter().filter(|p| p.state == state).count();
                self.paths.get_or_create(&PathLabel { path: state }).set(n as i64);
            }
            self.received.set(s.peers.iter().map(|p| p.rx_bytes as i64).sum());
            self.sent.set(s.peers.iter().map(|p| p.tx_bytes as i64).sum());
            self.buffered.set(s.buffered_evidence as i64);
            self.dropped.set(s.dropped_evidence as i64);
            self.routers.clear();
            self.cert_expiry.clear();
            let ingress = s.ingress.as_ref();
            self.traefik_running.set(ingress.is_some_and(|i| i.traefik == "running") as i64);
            for r in ingress.iter().flat_map(|i| &i.routers) {
                self.routers.get_or_create(&StatusLabel { status: r.status.clone() }).inc();
            }
            for c in ingress.iter().flat_map(|i| &i.certificates) {
                self.cert_expiry.get_or_create(&HostLabel { hostname: c.hostname.clone() }).set(c.not_after - now);
            }
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String");
        out
    }
}

/// Binds the metrics address (so a bad one fails at start, not later).
pub async fn bind(listen: &str) -> Result<TcpListener> {
    let addr: std::net::SocketAddr = listen.parse().with_context(|| format!("the metrics listen address {listen} is not IP:PORT"))?;
    TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} for metrics"))
}

/// Answers `GET /metrics` on `listener` until the task is dropped; anything else is 404.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        let tcp = match listener.accept().await {
            Ok((tcp, _)) => tcp,
            Err(e) => {
                tracing::warn!("metrics listener: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let metrics = metrics.clone();
                async move {
                    // OpenMetrics when the scraper's Accept asks for it, the classic format otherwise.
                    let format = Format::negotiate(req.headers().get(hyper::header::ACCEPT).and_then(|v| v.to_str().ok()));
                    let (status, body) = if req.uri().path() == "/metrics" {
                        (200, format.render(metrics.encode(crate::unix_now())))
                    } else {
                        (404, "not found; the metrics are at /metrics\n".to_string())
                    };
                    hyper::Response::builder()
                        .status(status)
                        .header(hyper::header::CONTENT_TYPE, if status == 200 { format.content_type() } else { "text/plain" })
                        .header(hyper::header::VARY, "Accept")
                        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
                }
            });
            let io = hyper_util::rt::TokioIo::new(tcp);
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::PeerState;

    #[test]
    fn ages_are_taken_at_the_scrape_and_unknown_ones_are_minus_one() {
        let m = Metrics::new();
        let text = m.encode(1000);
        assert!(text.lines().any(|l| l == "trellis_agent_last_contact_age_seconds -1"), "{text}");
        let peer = |key: &str, at: Option<u64>| PeerState::new(key.to_string(), None, at);
        m.status(&AgentStatus {
            version: 7,
            last_contact: Some(990),
            fresh_at: Some(985),
            peers: vec![peer("k1", Some(900)), peer("k2", None)],
            buffered_evidence: 2,
            ..Default::default()
        });
        m.apply(true, Duration::from_millis(30));
        m.apply(false, Duration::from_millis(10));
        let text = m.encode(1000);
        for line in [
            "trellis_agent_bundle_version 7",
            "trellis_agent_last_contact_age_seconds 10",
            "trellis_agent_freshness_age_seconds 15",
            "trellis_agent_peers 2",
            "trellis_agent_peer_last_handshake_age_seconds{peer=\"k1\"} 100",
            "trellis_agent_evidence_buffered_records 2",
            "trellis_agent_applies_total{result=\"applied\"} 1",
            "trellis_agent_applies_total{result=\"failed\"} 1",
            "trellis_agent_apply_duration_seconds_count 2",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        assert!(!text.contains("peer=\"k2\""), "a peer without a handshake has no age: {text}");
    }
}

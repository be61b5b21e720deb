//! The metrics of a lab run: every controller serves them on its namespace's loopback
//! (`--metrics-listen 127.0.0.1:9464`), every agent on its own (`127.0.0.1:9465`). `check`
//! scrapes both, with `curl` in the namespace, and holds them against what the lab knows: every
//! enrolment counted, publish runs timed, no node stale once all converged, and each agent at the
//! version the controller desires for it.

use std::collections::BTreeMap;

use anyhow::{Context, Result};

use crate::net::in_ns;
use crate::LabState;

/// Where a controller serves its metrics, in its namespace.
pub const CONTROLLER: &str = "127.0.0.1:9464";
/// Where an agent serves its metrics, in its node's namespace.
pub const AGENT: &str = "127.0.0.1:9465";

/// `GET /metrics` inside a namespace.
pub fn scrape(ns: &str, addr: &str) -> Result<String> {
    in_ns(ns, &["curl", "-sf", "--max-time", "5", &format!("http://{addr}/metrics")])
        .with_context(|| format!("cannot scrape http://{addr}/metrics in {ns}"))
}

/// The value of the sample named exactly `series` (name and labels), if present.
pub fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' '))).and_then(|v| v.trim().parse().ok())
}

/// Scrapes every running controller and every agent, prints one line for each, and says what
/// does not hold. `desired`: each node's desired version, from `trellis status`.
pub fn report(st: &LabState, desired: &BTreeMap<String, i64>) -> Result<Vec<String>> {
    let mut wrong = Vec::new();
    let mut enrolled = 0.0;
    for r in st.controllers.iter().filter(|r| !r.killed) {
        let text = scrape(&r.ns, CONTROLLER)?;
        let get = |s: &str| value(&text, s).unwrap_or(0.0);
        let (runs, sum) = (get("trellis_publish_run_duration_seconds_count"), get("trellis_publish_run_duration_seconds_sum"));
        enrolled += get("trellis_enrolments_total{result=\"active\"}");
        println!(
            "metrics of controller {}: {} enrolments counted, {} publish runs ({:.1} ms on average), {} bundles published, {} nodes stale, {} long-polls open",
            r.host,
            get("trellis_enrolments_total{result=\"active\"}"),
            runs,
            if runs > 0.0 { sum * 1000.0 / runs } else { 0.0 },
            get("trellis_published_bundles_total"),
            get("trellis_nodes_stale"),
            get("trellis_long_polls_open")
        );
        // Relayed pairs by path (ADR 0032), as the agents last said.
        let (direct, trying, relayed) =
            (get("trellis_pairs{path=\"direct\"}"), get("trellis_pairs{path=\"trying\"}"), get("trellis_pairs{path=\"relayed\"}"));
        if direct + trying + relayed > 0.0 {
            println!("relayed pairs of controller {}: {direct} direct, {trying} trying, {relayed} on their hub", r.host);
            for p in crate::path::unsettled(st) {
                println!("a path neither direct nor trying: {p}");
            }
        }
        if runs == 0.0 || sum <= 0.0 {
            wrong.push(format!("controller {}: no publish run timed", r.host));
        }
        if get("trellis_nodes_stale") != 0.0 {
            wrong.push(format!("controller {}: nodes shown stale after every node converged", r.host));
        }
    }
    // An enrolment is counted by the replica that answered it; a killed one took its counts along.
    if st.controllers.iter().all(|r| !r.killed) && enrolled != st.agents.len() as f64 {
        wrong.push(format!("{enrolled} enrolments counted for {} nodes enrolled", st.agents.len()));
    }
    for node in &st.agents {
        let want = desired.get(node).map(|d| *d as f64);
        // The agent shows a version once it has reported it: a moment after the controller knows.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let (text, version) = loop {
            let text = scrape(&format!("{}-{node}", st.prefix), AGENT)?;
            let version = value(&text, "trellis_agent_bundle_version").unwrap_or(0.0);
            if Some(version) == want || std::time::Instant::now() > deadline {
                break (text, version);
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        };
        println!(
            "metrics of agent {node}: version {version}, {} applied, last contact {} s ago, {} peers",
            value(&text, "trellis_agent_applies_total{result=\"applied\"}").unwrap_or(0.0),
            value(&text, "trellis_agent_last_contact_age_seconds").unwrap_or(-1.0),
            value(&text, "trellis_agent_peers").unwrap_or(0.0)
        );
        if Some(version) != want {
            wrong.push(format!("agent {node}: version {version}, the controller desires {want:?}"));
        }
    }
    for w in &wrong {
        println!("metrics do not match the lab: {w}");
    }
    Ok(wrong)
}

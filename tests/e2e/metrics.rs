//! Both metric endpoints scraped while a controller and an agent run (real binaries on
//! loopback): an enrolment and a refusal are counted, a node that never applies is shown stale,
//! publish runs are timed, the agent shows the version it applied and its last contact.

use std::io::{Read, Write};
use std::process::Stdio;
use std::time::{Duration, Instant};

use trellis_testing::cmd::{run, Proc};
use trellis_testing::{repo, TempDir};

use crate::controller::{agent_bin, enrol, free_port, Controller};

/// `GET /metrics` over plain HTTP (the listener may be a moment behind the API's).
fn scrape(port: u16) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut s = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => panic!("metrics on port {port}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("application/openmetrics-text"), "{text}");
    text
}

/// The value of the sample named exactly `series` (name and labels as exposed), if present.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' '))).map(|v| v.trim().parse().unwrap())
}

#[track_caller]
fn must_value(text: &str, series: &str) -> f64 {
    value(text, series).unwrap_or_else(|| panic!("no {series} in\n{text}"))
}

/// Polls `scrape` until `ok` holds (at most 30 s); returns the last scrape.
#[track_caller]
fn until(port: u16, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = scrape(port);
        if ok(&text) {
            return text;
        }
        assert!(Instant::now() < deadline, "{what} never held:\n{text}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn both_metric_endpoints_count_enrolments_show_staleness_and_time_publishing() {
    let ctl_port = free_port();
    let listen = format!("127.0.0.1:{ctl_port}");
    let c = Controller::start_serving(None, &[], &["--metrics-listen", &listen]);
    let before = scrape(ctl_port);
    assert_eq!(value(&before, "trellis_enrolments_total{result=\"active\"}"), None, "nothing enrolled yet");
    assert_eq!(must_value(&before, "trellis_nodes{state=\"active\"}"), 0.0);

    c.ok(&["apply", repo().join("lab/basic").to_str().unwrap()]);
    let applied = scrape(ctl_port);
    assert_eq!(must_value(&applied, "trellis_decisions_total{kind=\"apply\"}"), 1.0);
    assert_eq!(must_value(&applied, "trellis_nodes{state=\"declared\"}"), 3.0, "lab/basic declares three nodes");

    // db-1 enrols and runs an agent; api-1 enrols and never runs one, so it stays stale.
    let dir = TempDir::new("metrics");
    let token = c.token("db-1", &[]);
    let (out, d) = run(enrol(&token, &dir.path().join("db-1")));
    assert!(out.status.success(), "{d}");
    let (out, _) = run(enrol(&token, &dir.path().join("again")));
    assert!(!out.status.success(), "a used token is refused");
    let (out, d) = run(enrol(&c.token("api-1", &[]), &dir.path().join("api-1")));
    assert!(out.status.success(), "{d}");

    // Every decision so far is published (the checkpoint waits for the run covering them): the
    // desired versions read below are the ones the agent will apply.
    c.ok(&["audit", "verify"]);
    let agent_port = free_port();
    let agent_listen = format!("127.0.0.1:{agent_port}");
    let root = dir.path().join("root-db-1");
    let mut cmd = agent_bin();
    cmd.args(["run", "--files-only", "--wait", "5", "--metrics-listen", &agent_listen]);
    cmd.args(["--state-dir", dir.path().join("db-1").to_str().unwrap(), "--root", root.to_str().unwrap()]);
    let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
    let _agent = Proc(cmd.stdout(Stdio::null()).stderr(log).spawn().unwrap());

    let status: serde_json::Value = serde_json::from_str(&c.ok(&["status", "--json"])).unwrap();
    let desired = |n: &str| status.as_array().unwrap().iter().find(|x| x["name"] == n).unwrap()["desired_version"].as_f64();
    let db_version = desired("db-1").expect("db-1 has a desired version");

    let ctl = until(ctl_port, "db-1 applied and api-1 stale", |t| {
        value(t, "trellis_nodes_stale") == Some(1.0) && value(t, "trellis_long_polls_open") == Some(1.0)
    });
    assert_eq!(must_value(&ctl, "trellis_enrolments_total{result=\"active\"}"), 2.0, "two enrolments counted");
    assert_eq!(must_value(&ctl, "trellis_enrolments_total{result=\"token_used\"}"), 1.0, "the refusal counted by its code");
    assert_eq!(must_value(&ctl, "trellis_decisions_total{kind=\"enrol\"}"), 2.0);
    assert!(value(&ctl, "trellis_node_stale_seconds{node=\"api-1\"}").is_some(), "api-1 shown stale:\n{ctl}");
    assert_eq!(value(&ctl, "trellis_node_stale_seconds{node=\"db-1\"}"), None, "db-1 applied its bundle:\n{ctl}");
    assert_eq!(must_value(&ctl, "trellis_nodes{state=\"active\"}"), 2.0);
    let runs = must_value(&ctl, "trellis_publish_run_duration_seconds_count");
    assert!(runs > must_value(&applied, "trellis_publish_run_duration_seconds_count"), "the enrolments' publish runs were timed");
    assert!(must_value(&ctl, "trellis_publish_run_duration_seconds_sum") > 0.0, "a publish run takes time");
    assert!(must_value(&ctl, "trellis_published_bundles_total") >= 2.0);
    assert!(must_value(&ctl, "trellis_bundle_answers_total{answer=\"200\"}") >= 1.0);
    assert!(must_value(&ctl, "trellis_bundle_sent_bytes_total") > 0.0);
    assert_eq!(
        must_value(&ctl, "trellis_http_request_duration_seconds_count{method=\"POST\",route=\"/v1/enrol\",status=\"200\"}"),
        2.0,
        "requests timed by route"
    );

    let agent = until(agent_port, "db-1's agent applied its bundle", |t| value(t, "trellis_agent_bundle_version") == Some(db_version));
    assert_eq!(must_value(&agent, "trellis_agent_applies_total{result=\"applied\"}"), 1.0);
    assert_eq!(must_value(&agent, "trellis_agent_apply_duration_seconds_count"), 1.0);
    let contact = must_value(&agent, "trellis_agent_last_contact_age_seconds");
    assert!((0.0..30.0).contains(&contact), "the controller answered recently: {contact}");
    assert_eq!(must_value(&agent, "trellis_agent_evidence_buffered_records"), 0.0, "evidence delivered");

    // Revoking api-1 ends its staleness: it has no desired version any more.
    c.ok(&["node", "revoke", "api-1"]);
    let after = until(ctl_port, "api-1 revoked and no longer stale", |t| value(t, "trellis_nodes_stale") == Some(0.0));
    assert_eq!(must_value(&after, "trellis_nodes{state=\"revoked\"}"), 1.0);
    assert_eq!(must_value(&after, "trellis_decisions_total{kind=\"revoke\"}"), 1.0);
}

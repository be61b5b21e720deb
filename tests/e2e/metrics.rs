//! Both metric endpoints scraped while a controller and an agent run (real binaries on
//! loopback): an enrolment and a refusal are counted, a node that never applies is shown stale,
//! publish runs are timed, the agent shows the version it applied and its last contact.

use std::io::{Read, Write};
use std::process::Stdio;
use std::time::{Duration, Instant};

use trellis_testing::cmd::{run, Proc};
use trellis_testing::{repo, TempDir};

use crate::controller::{agent_bin, enrol, free_port, Controller};

/// What Prometheus sends when it scrapes: OpenMetrics first.
const PROMETHEUS_ACCEPT: &str =
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// `GET /metrics` as Prometheus asks for it (the listener may be a moment behind the API's).
fn scrape(port: u16) -> String {
    let text = scrape_as(port, Some(PROMETHEUS_ACCEPT));
    assert!(text.contains("application/openmetrics-text"), "{text}");
    text
}

/// `GET /metrics` over plain HTTP with this `Accept` header (none: without one); the whole
/// answer, headers included.
fn scrape_as(port: u16, accept: Option<&str>) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut s = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(e) if Instant::now() > deadline => panic!("metrics on port {port}: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let accept = accept.map(|a| format!("Accept: {a}\r\n")).unwrap_or_default();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n{accept}Connection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
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

    // Revoking api-1 ends its staleness: it has no desired version any more. It is counted
    // `revoking` until every holder of its key has dropped it (db-1's agent applies the bundle
    // without it), then `revoked`: both are waited for, since a scrape can fall between them.
    c.ok(&["node", "revoke", "api-1"]);
    let after = until(ctl_port, "api-1 revoked and no longer stale", |t| {
        value(t, "trellis_nodes_stale") == Some(0.0) && value(t, "trellis_nodes{state=\"revoked\"}") == Some(1.0)
    });
    assert_eq!(must_value(&after, "trellis_nodes{state=\"revoking\"}"), 0.0);
    assert_eq!(must_value(&after, "trellis_nodes{state=\"active\"}"), 1.0);
    assert_eq!(must_value(&after, "trellis_decisions_total{kind=\"revoke\"}"), 1.0);
}

/// The answer's `Content-Type` and body (the answers are not chunked: one body of known length).
fn split(answer: &str) -> (String, String) {
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    let ct = head.lines().find_map(|l| l.to_ascii_lowercase().strip_prefix("content-type:").map(|v| v.trim().to_string()));
    (ct.unwrap_or_default(), body.to_string())
}

/// Runs `program args` with `input` on standard input; its status and output.
fn lint(program: &str, args: &[&str], input: &str) -> (bool, String) {
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// Python's OpenMetrics parser (Debian's python3-prometheus-client), strict about the format
/// (`# EOF`, counter and unit naming); promtool reads only the classic format.
const OPENMETRICS_PARSE: &str = "import sys\nfrom prometheus_client.openmetrics.parser import text_string_to_metric_families as parse\nfor f in parse(sys.stdin.read()):\n    print(f.name, f.type, len(f.samples))\n";

/// Both endpoints answer in the format the scraper asks for, and each answer passes its linter:
/// `promtool check metrics` for the classic text format (asked for, or no Accept header), the
/// OpenMetrics parser of the Python client for OpenMetrics. Before, both always answered
/// OpenMetrics, which promtool rejects ("no help text" for every counter).
#[test]
fn both_metric_endpoints_answer_the_format_asked_for_and_pass_promtool() {
    let python = "/usr/bin/python3";
    let have_parser =
        std::process::Command::new(python).args(["-c", "import prometheus_client"]).output().is_ok_and(|o| o.status.success());
    if std::process::Command::new("promtool").arg("--version").output().is_err() || !have_parser {
        eprintln!(
            "skipped: promtool (Debian package prometheus) or python3-prometheus-client is absent; scripts/install-deps installs both"
        );
        return;
    }
    let ctl_port = free_port();
    let c = Controller::start_serving(None, &[], &["--metrics-listen", &format!("127.0.0.1:{ctl_port}")]);
    c.ok(&["apply", repo().join("lab/basic").to_str().unwrap()]);
    let dir = TempDir::new("promtool");
    let (out, d) = run(enrol(&c.token("db-1", &[]), &dir.path().join("db-1")));
    assert!(out.status.success(), "{d}");
    c.ok(&["audit", "verify"]);
    let agent_port = free_port();
    let mut cmd = agent_bin();
    cmd.args(["run", "--files-only", "--wait", "5", "--metrics-listen", &format!("127.0.0.1:{agent_port}")]);
    cmd.args(["--state-dir", dir.path().join("db-1").to_str().unwrap(), "--root", dir.path().join("root").to_str().unwrap()]);
    let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
    let _agent = Proc(cmd.stdout(Stdio::null()).stderr(log).spawn().unwrap());
    // Every kind of series is present: the agent applied (a histogram observed, a counter
    // counted) and holds a long-poll (a gauge at 1); a token is used up (a refusal counted).
    until(agent_port, "the agent applied its bundle", |t| value(t, "trellis_agent_applies_total{result=\"applied\"}") == Some(1.0));
    until(ctl_port, "the agent's long-poll is open", |t| value(t, "trellis_long_polls_open") == Some(1.0));
    // db-1 runs postgres and ssh, which ask for certificates: the per-node expiry series is
    // linted too.
    until(ctl_port, "db-1's service certificates issued", |t| value(t, "trellis_service_certificates_issued_total") == Some(2.0));

    for (port, who) in [(ctl_port, "controller"), (agent_port, "agent")] {
        for accept in [None, Some("text/plain; version=0.0.4"), Some("*/*")] {
            let (ct, body) = split(&scrape_as(port, accept));
            assert_eq!(ct, "text/plain; version=0.0.4; charset=utf-8", "{who}, Accept {accept:?}");
            assert!(!body.contains("# EOF") && !body.contains("# UNIT"), "{who}, Accept {accept:?}:\n{body}");
            let (ok, said) = lint("promtool", &["check", "metrics"], &body);
            assert!(ok, "promtool check metrics refused the {who}'s answer to Accept {accept:?}:\n{said}\n{body}");
        }
        let (ct, body) = split(&scrape_as(port, Some(PROMETHEUS_ACCEPT)));
        assert_eq!(ct, "application/openmetrics-text; version=1.0.0; charset=utf-8", "{who}");
        assert!(body.ends_with("# EOF\n"), "{who}:\n{body}");
        let (ok, said) = lint(python, &["-c", OPENMETRICS_PARSE], &body);
        assert!(ok, "the OpenMetrics parser refused the {who}'s answer:\n{said}\n{body}");
        // The same series in both (by name: a long-poll may answer between the two scrapes and
        // add a label set); only the format differs.
        let (_, classic) = split(&scrape_as(port, None));
        let names = |t: &str| {
            let names: std::collections::BTreeSet<String> =
                t.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).map(str::to_string).collect();
            names
        };
        assert_eq!(names(&classic), names(&body), "{who}");
    }
}

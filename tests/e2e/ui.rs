//! The live picture in a real browser: headless Chromium, driven through chromedriver's
//! WebDriver protocol, against a real controller on loopback with lab/cgnat's declaration and
//! real agents. Every node is shown with its state, a revoked node changes colour without a
//! reload, and `explain` between two clicked nodes says what the CLI says. With
//! TRELLIS_UI_SCREENSHOT=FILE the page is saved as a PNG (the README's picture).

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};

use trellis_testing::cmd::{ok, run, Proc};
use trellis_testing::{can_run, repo, Need, TempDir};

use crate::controller::{agent_bin, enrol, free_port, Controller};
use crate::support::trellis_cmd;

/// A WebDriver session on a chromedriver of our own.
struct Browser {
    port: u16,
    session: String,
    // Dropped in this order: the driver, then the browser's profile.
    _driver: Proc,
    _profile: TempDir,
}

/// One WebDriver request over plain HTTP/1.1; the answer's `value`. Panics with the error the
/// driver names.
#[track_caller]
fn webdriver(port: u16, method: &str, path: &str, body: Option<&Value>) -> Value {
    try_webdriver(port, method, path, body).unwrap_or_else(|e| panic!("{e}"))
}

/// One WebDriver request; the answer's `value`, or the error the driver names.
fn try_webdriver(port: u16, method: &str, path: &str, body: Option<&Value>) -> Result<Value, String> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // chromedriver keeps the connection open: the answer is read by its Content-Length.
    let mut bytes = Vec::new();
    let mut buf = [0u8; 65536];
    let (head, length) = loop {
        let n = s.read(&mut buf).map_err(|e| format!("{method} {path}: {e}"))?;
        if n == 0 {
            return Err(format!("{method} {path}: chromedriver closed the connection"));
        }
        bytes.extend_from_slice(&buf[..n]);
        if let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&bytes[..end]).to_string();
            let length: usize = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap()))
                .ok_or_else(|| format!("{method} {path}: no Content-Length in {head}"))?;
            bytes.drain(..end + 4);
            break (head, length);
        }
    };
    while bytes.len() < length {
        let n = s.read(&mut buf).map_err(|e| format!("{method} {path}: {e}"))?;
        if n == 0 {
            break;
        }
        bytes.extend_from_slice(&buf[..n]);
    }
    let rest = String::from_utf8_lossy(&bytes).to_string();
    let v: Value = serde_json::from_str(&rest).map_err(|e| format!("{method} {path}: {e}: {rest}"))?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("{method} {path} {body}: {head}\n{v:#}"));
    }
    Ok(v["value"].clone())
}

impl Browser {
    fn start() -> Browser {
        let driver = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect("chromedriver is not installed: scripts/install-deps installs Debian's chromium and chromium-driver");
        let port = free_port();
        let child = Command::new(driver).arg(format!("--port={port}")).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        let driver = Proc(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not listen on {port}");
            std::thread::sleep(Duration::from_millis(100));
        }
        let profile = TempDir::new("chromium");
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "acceptInsecureCerts": true,
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1440,960",
                         format!("--user-data-dir={}", profile.path().display())]
            }
        }}});
        let v = webdriver(port, "POST", "/session", Some(&caps));
        Browser { port, session: v["sessionId"].as_str().unwrap().to_string(), _driver: driver, _profile: profile }
    }

    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        webdriver(self.port, method, &format!("/session/{}{path}", self.session), body.as_ref())
    }

    fn script(&self, js: &str) -> Value {
        self.call("POST", "/execute/sync", Some(json!({"script": js, "args": []})))
    }

    fn element(&self, css: &str) -> String {
        let v = self.call("POST", "/element", Some(json!({"using": "css selector", "value": css})));
        v.as_object().unwrap().values().next().unwrap().as_str().unwrap().to_string()
    }

    /// A real click (the driver moves the pointer there); found again if the page redrew it
    /// between the finding and the click.
    fn click(&self, css: &str) {
        let mut tries = 0;
        loop {
            let id = self.element(css);
            let path = format!("/session/{}/element/{id}/click", self.session);
            match try_webdriver(self.port, "POST", &path, Some(&json!({}))) {
                Ok(_) => return,
                Err(e) if e.contains("stale element") && tries < 5 => tries += 1,
                Err(e) => panic!("{e}"),
            }
        }
    }

    /// Polls a script until it returns something `ok` accepts (30 s at most).
    #[track_caller]
    fn until(&self, what: &str, js: &str, ok: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let v = self.script(js);
            if ok(&v) {
                return v;
            }
            assert!(Instant::now() < deadline, "{what} never held; the page shows {v}");
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = try_webdriver(self.port, "DELETE", &format!("/session/{}", self.session), None);
    }
}

/// What the page shows, node by node: `{name: shown}`.
const SHOWN: &str = "return Object.fromEntries([...document.querySelectorAll('.node')].map(n => [n.dataset.name, n.dataset.shown]));";

#[test]
fn the_live_page_shows_every_node_turns_a_revoked_one_red_without_a_reload_and_explains_like_the_cli() {
    if !(can_run(Need::Program("chromium")) && can_run(Need::Program("chromedriver"))) {
        return;
    }
    let c = Controller::start_serving(None, &[], &[]);
    let decl = repo().join("lab/cgnat");
    c.ok(&["apply", decl.to_str().unwrap()]);
    // hub-1 and a-1 run agents (active); b-1 enrols and never applies (stale).
    let dir = TempDir::new("ui");
    let mut agents = Vec::new();
    for node in ["hub-1", "a-1", "b-1"] {
        let state = dir.path().join(node);
        let (out, d) = run(enrol(&c.token(node, &[]), &state));
        assert!(out.status.success(), "{d}");
        if node == "b-1" {
            continue;
        }
        let mut cmd = agent_bin();
        cmd.args(["run", "--files-only", "--wait", "5", "--state-dir", state.to_str().unwrap()]);
        cmd.args(["--root", dir.path().join(format!("root-{node}")).to_str().unwrap()]);
        agents.push(Proc(cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()));
    }

    let b = Browser::start();
    b.call("POST", "/url", Some(json!({"url": format!("https://127.0.0.1:{}/ui/", c.port)})));
    let admin = std::fs::read_to_string(c.state.join("admin.token")).unwrap();
    let field = b.element("#token");
    b.call("POST", &format!("/element/{field}/value"), Some(json!({"text": admin.trim()})));
    b.click("#show");
    let expected = json!({"hub-1": "active", "a-1": "active", "b-1": "stale"});
    b.until("every node of lab/cgnat shown with its state", SHOWN, |v| *v == expected);
    let fill = |node: &str| format!("return getComputedStyle(document.querySelector('#node-{node} circle')).fill;");
    assert_eq!(b.script(&fill("a-1")), "rgb(46, 125, 50)", "active is green");
    assert_eq!(b.script(&fill("b-1")), "rgb(239, 108, 0)", "stale is orange");

    // Two nodes clicked: the explanation is the CLI's, word for word.
    b.click("#node-a-1 circle");
    b.click("#node-b-1 circle");
    let shown = b.until("an explanation shown", "return document.querySelector('#explain').textContent;", |v| {
        v.as_str().is_some_and(|t| t.starts_with("path "))
    });
    // The CLI names files under the directory it was given; the controller holds them relative
    // to the declaration.
    let cli = ok(trellis_cmd(&["explain", decl.to_str().unwrap(), "a-1", "b-1"])).replace(&format!("{}/", decl.display()), "");
    assert_eq!(shown.as_str().unwrap(), cli, "the page's explain is the CLI's");
    assert!(cli.contains("relayed through hub hub-1"), "{cli}");

    // Revoked from the CLI: the node turns red in place (the marker set in this page survives).
    b.script("window.trellisMarker = 'same page'; return null;");
    c.ok(&["node", "revoke", "a-1"]);
    b.until("a-1 shown revoked", SHOWN, |v| v["a-1"] == "revoked");
    assert_eq!(b.script(&fill("a-1")), "rgb(198, 40, 40)", "revoked is red");
    assert_eq!(b.script("return window.trellisMarker;"), "same page", "the page was not reloaded");

    // hub-1 revoked: a-1 (revoked) no longer counts, b-1 never applies, so hub-1 stays revoking
    // and b-1 is ringed as still holding its key (ADR 0022).
    c.ok(&["node", "revoke", "hub-1"]);
    b.until("hub-1 shown revoking", SHOWN, |v| v["hub-1"] == "revoking");
    const HOLDS: &str = "return document.querySelector('#node-b-1').dataset.holds;";
    b.until("b-1 ringed as holding hub-1's key", HOLDS, |v| v == "hub-1");
    assert_eq!(b.script("return document.querySelector('#node-a-1').dataset.holds;"), "", "a-1 holds nothing it counts for");

    if let Ok(path) = std::env::var("TRELLIS_UI_SCREENSHOT") {
        b.script("window.scrollTo(0, 0); return null;");
        let png = b.call("GET", "/screenshot", None);
        let bytes = base64::engine::general_purpose::STANDARD.decode(png.as_str().unwrap()).unwrap();
        std::fs::write(&path, bytes).unwrap();
    }
    drop(agents);
}

/// Whether the credential form is shown, the page's error line, and what the tab stores.
const LOGIN: &str = "return [getComputedStyle(document.querySelector('#login')).display !== 'none', document.querySelector('#error').textContent, sessionStorage.getItem('trellis-admin')];";

/// The attack on the operator: a wrong credential typed once. Before, it stayed in the tab's
/// storage and the form was gone, so the page kept sending it (a reload too) and the only way
/// back was a new tab. Now the refusal is shown, the credential forgotten and the form offered
/// again, in the same tab and after a reload.
#[test]
fn a_refused_credential_is_forgotten_and_the_form_offered_again() {
    let c = Controller::start_serving(None, &[], &[]);
    c.ok(&["apply", repo().join("lab/cgnat").to_str().unwrap()]);
    let b = Browser::start();
    b.call("POST", "/url", Some(json!({"url": format!("https://127.0.0.1:{}/ui/", c.port)})));
    let type_in = |text: &str| {
        let field = b.element("#token");
        b.call("POST", &format!("/element/{field}/clear"), Some(json!({})));
        b.call("POST", &format!("/element/{field}/value"), Some(json!({"text": text})));
        b.click("#show");
    };
    let offered = |v: &Value| v[0] == true && v[1] == "the admin credential is wrong" && v[2].is_null();
    type_in("trellis-admin-wrong");
    b.until("the refusal shown, the form offered again and the credential forgotten", LOGIN, offered);

    // A wrong credential already in the tab's storage (kept by an earlier page): a reload offers
    // the form too.
    b.script("sessionStorage.setItem('trellis-admin', 'trellis-admin-stale'); return null;");
    b.call("POST", "/refresh", Some(json!({})));
    b.until("the form offered after a reload with a wrong stored credential", LOGIN, offered);

    let admin = std::fs::read_to_string(c.state.join("admin.token")).unwrap();
    type_in(admin.trim());
    b.until("every node of lab/cgnat shown", SHOWN, |v| v.as_object().is_some_and(|o| o.len() == 3));
    let v = b.until("the form gone once the credential is taken", LOGIN, |v| v[0] == false);
    assert_eq!(v[2], admin.trim(), "the credential taken is kept for the tab");
}

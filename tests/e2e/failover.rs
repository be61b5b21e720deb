//! A controller that goes silent (issue 21, item 4): the agent asks the controller that answered
//! last first, so a silent one costs its connect timeout once, not on every request.

use std::net::TcpListener;
use std::time::Duration;

use trellis_testing::cmd::ok;
use trellis_testing::TempDir;

use crate::controller::{enrol, files_only_agent, Controller, Db};
use crate::support::{basic_with_extra_nodes, until_zone_names};

/// The controller listed first takes connections and never answers (a hung process, or a
/// firewall that lets the SYN through). Before, every request (each long-poll, each evidence
/// post) waited out the 5 s connect timeout on it before asking the next: a change reached the
/// agent 5 to 10 s late. Now only the first request does.
#[test]
fn a_silent_controller_costs_its_timeout_once_not_on_every_request() {
    let c = Controller::start(Db::Sqlite);
    let work = TempDir::new("silent");
    let (state, root, decl) = (work.path().join("db-1"), work.path().join("root"), work.path().join("decl"));
    basic_with_extra_nodes(&decl, 0);
    c.ok(&["apply", decl.to_str().unwrap()]);
    ok(enrol(&c.token("db-1", &[]), &state));
    // A silent controller first in the node's list: it accepts and holds every connection.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in silent.incoming().flatten() {
            held.push(s);
        }
    });
    let identity = state.join("identity.toml");
    let text = std::fs::read_to_string(&identity).unwrap();
    let real = format!("\"127.0.0.1:{}\"", c.port);
    assert!(text.contains(&real), "{text}");
    std::fs::write(&identity, text.replace(&real, &format!("\"{silent_addr}\", {real}"))).unwrap();
    // And in the list every bundle delivers (ADR 0028), so that the first bundle keeps it first.
    let real_addr = format!("127.0.0.1:{}", c.port);
    c.ok(&["controllers", "add", &silent_addr]);
    c.ok(&["controllers", "remove", &real_addr]);
    c.ok(&["controllers", "add", &real_addr]);

    let _agent = files_only_agent(&state, &root);
    let first = until_zone_names(&root, "db-1").unwrap();
    let mut later = Vec::new();
    for k in 1..=3 {
        basic_with_extra_nodes(&decl, k);
        c.ok(&["apply", decl.to_str().unwrap()]);
        later.push(until_zone_names(&root, &format!("extra-{k}")).unwrap());
    }
    eprintln!("first bundle after {} ms (the silent controller tried first); later changes: {later:?}", first.as_millis());
    for (k, took) in later.iter().enumerate() {
        assert!(*took < Duration::from_secs(4), "change {}: {took:?}, the silent controller was tried again", k + 1);
    }
}

//! Docs that cannot drift: the book builds and no relative link of it or of the README is
//! broken; the references of declaration keys, commands, metrics and error codes are checked
//! against the parser's schema, the command lines, the metrics registries and the codes in the
//! source; every `console` block of the README and the book is run and must print what it shows.
//! Refresh the generated command reference with `UPDATE_GOLDEN=1`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use trellis_testing::cmd::run;
use trellis_testing::{can_run, repo, Need, TempDir};

use crate::support::agent;

/// The README and every page of the book, as (path, text).
fn pages() -> Vec<(PathBuf, String)> {
    let root = repo();
    let mut out = vec![(root.join("README.md"), read(&root.join("README.md")))];
    let mut dirs = vec![root.join("docs/src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push((path.clone(), read(&path)));
            }
        }
    }
    out.sort();
    out
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// The text outside fenced code blocks and inline code, line by line (code shows links as text).
fn prose(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut kept = String::new();
        for (n, part) in line.split('`').enumerate() {
            if n % 2 == 0 {
                kept.push_str(part);
            }
        }
        out.push((i + 1, kept));
    }
    out
}

/// Every inline link and image target `](TARGET)` of the prose.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose(text) {
        let mut rest = line.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push((n, after[..end].split_whitespace().next().unwrap_or("").to_string()));
            rest = &after[end..];
        }
    }
    out
}

/// A heading's anchor as mdBook and the forges make it: lower case, spaces to `-`, the rest of
/// the punctuation dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

#[test]
fn docs_links() {
    let mut broken = Vec::new();
    for (page, text) in pages() {
        for (line, target) in links(&text) {
            if target.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = target.split_once('#').map_or((target.as_str(), None), |(f, a)| (f, Some(a)));
            let path = if file.is_empty() { page.clone() } else { page.parent().expect("a page's directory").join(file) };
            if !path.exists() {
                broken.push(format!("{}:{line}: {target}: no such file", page.display()));
                continue;
            }
            if let Some(anchor) = anchor.filter(|_| path.extension().is_some_and(|e| e == "md")) {
                if !anchors(&read(&path)).contains(anchor) {
                    broken.push(format!("{}:{line}: {target}: no heading makes #{anchor}", page.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Every page of docs/src is in SUMMARY.md, and every page SUMMARY.md names exists.
#[test]
fn docs_summary_holds_every_page() {
    let src = repo().join("docs/src");
    let summary = read(&src.join("SUMMARY.md"));
    let named: BTreeSet<PathBuf> = links(&summary).into_iter().map(|(_, t)| src.join(t)).collect();
    let on_disk: BTreeSet<PathBuf> =
        pages().into_iter().map(|(p, _)| p).filter(|p| p.starts_with(&src) && !p.ends_with("SUMMARY.md")).collect();
    assert_eq!(named, on_disk, "SUMMARY.md and the pages of docs/src differ");
}

/// The book builds with mdBook, without a warning.
#[test]
fn docs_book_builds() {
    if !can_run(Need::Program("mdbook")) {
        return;
    }
    let out_dir = TempDir::new("book");
    let mut cmd = Command::new("mdbook");
    cmd.args(["build", "docs", "--dest-dir"]).arg(out_dir.path()).current_dir(repo());
    let (out, d) = run(cmd);
    assert!(out.status.success(), "the book does not build\n{d}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!said.contains("WARN") && !said.contains("ERROR"), "mdbook warned\n{d}");
    assert!(out_dir.join("index.html").exists() && out_dir.join("reference/declaration.html").exists(), "{d}");
}

/// The sections of a reference page: `## \`NAME\`` (or `## NAME`) and the first cells of its
/// table rows that are code (`| \`KEY\` |`).
fn sections(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut current = None;
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            let name = h.trim().trim_matches('`').to_string();
            out.entry(name.clone()).or_default();
            current = Some(name);
        } else if let (Some(name), Some(row)) = (&current, line.strip_prefix("| `")) {
            if let Some((key, _)) = row.split_once('`') {
                out.get_mut(name).expect("its section").insert(key.to_string());
            }
        }
    }
    out
}

#[test]
fn docs_declaration_keys() {
    let page = repo().join("docs/src/reference/declaration.md");
    let documented = sections(&read(&page));
    let schema: BTreeMap<String, BTreeSet<String>> =
        trellis_core::load::SCHEMA.iter().map(|(t, keys)| (t.to_string(), keys.iter().map(|k| k.to_string()).collect())).collect();
    let mut wrong = Vec::new();
    for (table, keys) in &schema {
        match documented.get(table) {
            None => wrong.push(format!("table {table} is not documented (a section `## \\`{table}\\``)")),
            Some(doc) => {
                for k in keys.difference(doc) {
                    wrong.push(format!("{table} takes `{k}`, which is not documented"));
                }
                for k in doc.difference(keys) {
                    wrong.push(format!("{table} documents `{k}`, which the parser refuses"));
                }
            }
        }
    }
    for table in documented.keys().filter(|t| !schema.contains_key(*t)) {
        wrong.push(format!("{table} is documented, and the parser has no such table"));
    }
    assert!(wrong.is_empty(), "{} and the parser's schema differ:\n{}", page.display(), wrong.join("\n"));

    // The parser's refusal names the same keys, as an operator sees them.
    let files =
        [("mesh.toml".to_string(), "[mesh]\nname = \"x\"\ndomain = \"x.mesh\"\noverlay_ipv4 = \"10.0.0.0/16\"\nnosuch = 1\n".to_string())];
    let loaded = trellis_core::load_relative(&files, |p| p.to_string());
    let said: Vec<String> = loaded.errors().map(|d| d.to_string()).collect();
    let mesh_keys: Vec<&str> = schema["[mesh]"].iter().map(String::as_str).collect();
    assert!(said.iter().any(|d| d.contains("unknown key `nosuch` in [mesh]") && mesh_keys.iter().all(|k| d.contains(k))), "{said:?}");
}

/// Every subcommand path of a binary, from its own `--help` ("Commands:" sections), in order.
fn command_paths(program: &str, path: Vec<String>, out: &mut Vec<Vec<String>>) {
    let help = help_of(program, &path);
    out.push(path.clone());
    let mut in_commands = false;
    for line in help.lines() {
        if line == "Commands:" {
            in_commands = true;
        } else if in_commands && line.starts_with("  ") && !line.starts_with("   ") {
            let name = line.split_whitespace().next().expect("a command name").to_string();
            if name != "help" {
                let mut sub = path.clone();
                sub.push(name);
                command_paths(program, sub, out);
            }
        } else if in_commands && !line.starts_with(' ') {
            in_commands = false;
        }
    }
}

fn help_of(program: &str, path: &[String]) -> String {
    let mut cmd = Command::new(program);
    cmd.args(path).arg("--help").env("COLUMNS", "100").env_remove("RUST_LOG");
    let (out, d) = run(cmd);
    assert!(out.status.success(), "{d}");
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

/// The generated half of the command reference: every command's `--help`, as it prints it.
fn command_reference() -> String {
    let mut text = String::new();
    for (name, program) in [("trellis", env!("CARGO_BIN_EXE_trellis")), ("trellis-agent", agent())] {
        let mut paths = Vec::new();
        command_paths(program, Vec::new(), &mut paths);
        text.push_str(&format!("\n## `{name}`\n"));
        for path in paths {
            let title = std::iter::once(name.to_string()).chain(path.iter().cloned()).collect::<Vec<_>>().join(" ");
            let help = help_of(program, &path);
            text.push_str(&format!("\n### `{title}`\n\n```text\n{}\n```\n", help.trim_end()));
        }
    }
    text
}

const GENERATED: &str =
    "<!-- Generated from the binaries' --help by the test docs_commands (UPDATE_GOLDEN=1 refreshes it); do not edit below. -->\n";

#[test]
fn docs_commands() {
    let page = repo().join("docs/src/reference/commands.md");
    let text = read(&page);
    let (head, body) = text.split_once(GENERATED).unwrap_or_else(|| panic!("{} has no line {GENERATED:?}", page.display()));
    let now = command_reference();
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&page, format!("{head}{GENERATED}{now}")).expect("writing the command reference");
        return;
    }
    assert!(
        body == now,
        "{} differs from the commands' --help: run UPDATE_GOLDEN=1 cargo test -p trellis --test e2e docs_commands, and read the diff",
        page.display()
    );
}

/// The metric names an OpenMetrics text declares, as their samples are named (a counter's with
/// `_total`).
fn registered(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .map(|l| {
            let mut parts = l.split_whitespace();
            let (name, kind) = (parts.next().expect("a name"), parts.next().expect("a type"));
            if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_string()
            }
        })
        .collect()
}

/// The controller's registry with a sample in every family: a family without one is not
/// encoded, so each is given one through the calls the controller makes.
fn controller_metrics() -> trellis_controller::metrics::Metrics {
    use std::time::Duration;
    let m = trellis_controller::metrics::Metrics::new();
    m.enrolment("active");
    m.decision(trellis_controller::metrics::Decision::Apply);
    m.publish_run(Duration::from_millis(1), Ok(1));
    m.bundle_answer("304", 0);
    m.request("GET", "/v1/bundle", 200, Duration::from_millis(1));
    let status: trellis_proto::NodeStatus = serde_json::from_value(serde_json::json!({
        "name": "edge-1", "state": "active", "desired_version": 2, "applied_version": 1, "last_contact": 1,
        "cert_not_after": 1, "stale": true, "stale_for": 5, "last_result": null, "last_error": null,
        "evidence_records": 1, "evidence_missing": 0,
        "ingress": {"node": "edge-1", "reported_at": 1, "report": {"traefik": "running", "error": null,
            "routers": [{"name": "shop-0", "status": "enabled", "errors": []}],
            "certificates": [{"hostname": "shop.example.com", "not_after": 9}]}},
    }))
    .expect("a node status");
    m.roster(Some(&[status]));
    let cert: trellis_proto::certs::ServiceCertInfo = serde_json::from_value(serde_json::json!({
        "node": "db-1", "module": "postgres", "declared": true, "names": [], "serial": "1", "issued_at": 1,
        "not_after": 9, "lifetime_secs": 8, "refused_at": null, "refusal": null,
    }))
    .expect("a service certificate");
    m.service_cert_expiries(&[cert]);
    m
}

/// The agent's registry with a sample in every family, as [`controller_metrics`].
fn agent_metrics() -> trellis_agent::metrics::Metrics {
    let m = trellis_agent::metrics::Metrics::new();
    m.apply(true, std::time::Duration::from_millis(1));
    use trellis_agent::status::{CertState, IngressStatus, RouterState};
    let status = trellis_agent::status::AgentStatus {
        peers: vec![trellis_agent::status::PeerState::new("k1".into(), None, Some(1))],
        paths: vec![trellis_agent::status::PathStatus {
            peer: "b-1".into(),
            public_key: "k2".into(),
            hub: "hub-1".into(),
            state: "direct".into(),
            since: 1,
            endpoint: "203.0.113.2:4002".into(),
            reason: None,
        }],
        ingress: Some(IngressStatus {
            traefik: "running".into(),
            error: None,
            routers: vec![RouterState {
                name: "shop-0".into(),
                kind: "http".into(),
                rule: "Host(`shop.example.com`)".into(),
                status: "enabled".into(),
                errors: vec![],
            }],
            certificates: vec![CertState { hostname: "shop.example.com".into(), not_after: 9 }],
        }),
        ..Default::default()
    };
    m.status(&status);
    m
}

#[test]
fn docs_metrics() {
    let page = repo().join("docs/src/reference/metrics.md");
    let documented = sections(&read(&page));
    let controller = registered(&controller_metrics().encode());
    let agent = registered(&agent_metrics().encode(0));
    let mut wrong = Vec::new();
    for (section, names) in [("Controller", controller), ("Agent", agent)] {
        let doc = documented.get(section).cloned().unwrap_or_default();
        for n in names.difference(&doc) {
            wrong.push(format!("{section}: {n} is registered and not documented"));
        }
        for n in doc.difference(&names) {
            wrong.push(format!("{section}: {n} is documented and not registered"));
        }
    }
    assert!(wrong.is_empty(), "{} and the registries differ:\n{}", page.display(), wrong.join("\n"));
}

/// The codes the controller and the server answer with: the literals of every `fn code` of the
/// controller's refusals, and those the server's edge gives `ApiError::body`.
fn codes_in_source() -> BTreeSet<String> {
    let root = repo();
    let mut out = BTreeSet::new();
    for file in ["crates/controller/src/error.rs", "crates/controller/src/certs.rs"] {
        let text = read(&root.join(file));
        let mut inside = false;
        for line in text.lines() {
            if line.trim_start().starts_with("pub fn code(") {
                inside = true;
            } else if inside && line == "    }" {
                inside = false;
            } else if inside {
                out.extend(quoted(line));
            }
        }
    }
    for entry in std::fs::read_dir(root.join("crates/server/src")).expect("the server's source") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|e| e == "rs") {
            let text = read(&path).replace('\n', " ");
            for (n, part) in text.split("ApiError::body(").enumerate() {
                if n > 0 {
                    out.extend(quoted(part).into_iter().take(1));
                }
            }
        }
    }
    out
}

/// The `"snake_case"` literals of a line.
fn quoted(line: &str) -> Vec<String> {
    line.split('"')
        .enumerate()
        .filter(|(n, s)| n % 2 == 1 && !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
        .map(|(_, s)| s.to_string())
        .collect()
}

#[test]
fn docs_error_codes() {
    let page = repo().join("docs/src/reference/errors.md");
    let documented: BTreeSet<String> =
        read(&page).lines().filter_map(|l| l.strip_prefix("| `")).filter_map(|r| r.split_once('`')).map(|(c, _)| c.to_string()).collect();
    let source = codes_in_source();
    assert!(source.len() > 30, "too few codes found in the source: {source:?}");
    let missing: Vec<_> = source.difference(&documented).collect();
    let gone: Vec<_> = documented.difference(&source).collect();
    assert!(
        missing.is_empty() && gone.is_empty(),
        "{}: codes not documented: {missing:?}; documented and not in the source: {gone:?}",
        page.display()
    );
}

/// The files of a bundle, each listed (`- \`PATH\``) in the reference, and nothing else listed
/// as delivered.
#[test]
fn docs_files() {
    let page = repo().join("docs/src/reference/files.md");
    let documented: BTreeSet<String> = read(&page)
        .lines()
        .filter_map(|l| l.strip_prefix("- `"))
        .flat_map(|l| l.split(", `").map(|p| p.split('`').next().unwrap_or("").to_string()).collect::<Vec<_>>())
        .filter(|p| !p.ends_with('/'))
        .collect();
    let delivered: BTreeSet<String> = trellis_core::compile::DELIVERED.iter().map(|p| p.to_string()).collect();
    assert_eq!(documented, delivered, "{} and the files a bundle may carry differ", page.display());
    // The parts of the peers, by their directory and their first and last names.
    let text = read(&page);
    let (first, last) =
        (trellis_core::plan::wireguard_part(0), trellis_core::plan::wireguard_part(trellis_core::plan::WIREGUARD_PARTS - 1));
    let dir = format!("- `{}/`", trellis_core::plan::WIREGUARD_DIR);
    let named = |p: &str| text.contains(p.rsplit('/').next().unwrap());
    assert!(
        text.contains(&dir) && named(first) && named(last),
        "{} names the parts of the peers ({dir}, {first} .. {last})",
        page.display()
    );
}

/// One command of a `console` block and the output it shows.
#[derive(Debug)]
struct Shown {
    page: PathBuf,
    line: usize,
    command: String,
    output: Vec<String>,
}

/// Every `console` block's commands: a line `$ COMMAND` (continued by a trailing `\`), then what
/// it prints, standard output and error as a terminal shows them. In the output a line `...`
/// stands for any lines, and `[..]` for any text within a line.
fn console_blocks() -> Vec<Shown> {
    let mut out = Vec::new();
    for (page, text) in pages() {
        let mut in_block = false;
        let mut current: Option<Shown> = None;
        let mut continued = false;
        for (i, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                if in_block {
                    out.extend(current.take());
                }
                in_block = !in_block && line.trim() == "```console";
                continue;
            }
            if !in_block {
                continue;
            }
            if continued {
                let c = current.as_mut().expect("a command continued");
                c.command.push('\n');
                c.command.push_str(line);
                continued = line.ends_with('\\');
            } else if let Some(cmd) = line.strip_prefix("$ ") {
                out.extend(current.take());
                current = Some(Shown { page: page.clone(), line: i + 1, command: cmd.to_string(), output: Vec::new() });
                continued = cmd.ends_with('\\');
            } else if let Some(c) = current.as_mut() {
                c.output.push(line.to_string());
            }
        }
    }
    out
}

fn line_matches(expected: &str, actual: &str) -> bool {
    let parts: Vec<&str> = expected.split("[..]").collect();
    if parts.len() == 1 {
        return expected == actual;
    }
    let mut rest = actual;
    for (n, part) in parts.iter().enumerate() {
        if n == 0 {
            let Some(r) = rest.strip_prefix(part) else { return false };
            rest = r;
        } else if n == parts.len() - 1 {
            return rest.ends_with(part);
        } else {
            let Some(at) = rest.find(part) else { return false };
            rest = &rest[at + part.len()..];
        }
    }
    true
}

fn lines_match(expected: &[String], actual: &[&str]) -> bool {
    match expected.split_first() {
        None => actual.is_empty(),
        Some((e, rest)) if e == "..." => (0..=actual.len()).any(|skip| lines_match(rest, &actual[skip..])),
        Some((e, rest)) => actual.split_first().is_some_and(|(a, arest)| line_matches(e, a) && lines_match(rest, arest)),
    }
}

/// Every command of the README's and the book's `console` blocks runs and prints what they show.
/// They run in one directory per page, in order (a page's commands may build on each other),
/// where `lab/` and `modules/` are the repository's, with `trellis` and `trellis-agent` first on
/// PATH. Commands that need root or a network are shown in `sh` blocks instead, and the lab
/// runs them (see the quick start).
#[test]
fn docs_console_blocks() {
    let shown = console_blocks();
    assert!(shown.len() >= 5, "too few console commands found: {shown:?}");
    let bin = Path::new(env!("CARGO_BIN_EXE_trellis")).parent().expect("the binaries' directory").to_path_buf();
    let _ = agent();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let mut dirs: BTreeMap<PathBuf, TempDir> = BTreeMap::new();
    let mut failed = Vec::new();
    for s in &shown {
        let dir = dirs.entry(s.page.clone()).or_insert_with(|| {
            let d = TempDir::new("console");
            for link in ["lab", "modules"] {
                std::os::unix::fs::symlink(repo().join(link), d.join(link)).expect("a symlink");
            }
            d
        });
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(format!("exec 2>&1\n{}", s.command)).current_dir(dir.path()).env("PATH", &path).env("COLUMNS", "100");
        let (out, _) = run(cmd);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let actual: Vec<&str> = text.lines().collect();
        if !lines_match(&s.output, &actual) {
            failed.push(format!(
                "{}:{}: $ {}\n--- shown ---\n{}\n--- printed ---\n{}",
                s.page.display(),
                s.line,
                s.command,
                s.output.join("\n"),
                text.trim_end()
            ));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} console commands print otherwise than shown:\n\n{}",
        failed.len(),
        shown.len(),
        failed.join("\n\n")
    );
}

#[test]
fn console_matching() {
    let e = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert!(lines_match(&e(&["a", "...", "d"]), &["a", "b", "c", "d"]));
    assert!(lines_match(&e(&["a", "..."]), &["a"]));
    assert!(!lines_match(&e(&["a", "d"]), &["a", "b", "d"]));
    assert!(line_matches("ca [..] fingerprint [..]", "ca sha256 fingerprint 0a1b"));
    assert!(!line_matches("ca [..] fingerprint", "ca sha256 fingerprints"));
    assert_eq!(slug("The lab: a mesh in `netns`"), "the-lab-a-mesh-in-netns");
}

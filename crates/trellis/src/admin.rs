//! The controller commands: `init`, `serve`, and the admin commands that talk to a running
//! controller (`apply`, `token`, `nodes`, `node`, `audit`).

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Result};
use clap::Subcommand;
use serde_json::json;
use trellis_client::AdminClient;
use trellis_controller::state::{self, InitOptions};
use trellis_proto as proto;
use trellis_proto::text::{date, printable};

use crate::conn::{runtime, Conn};

pub fn init(dir: &Path, advertise: Vec<String>, listen: Option<String>, database_url: Option<String>, cert_secs: u64) -> Result<ExitCode> {
    if cert_secs == 0 {
        bail!("--cert-lifetime must be longer than zero");
    }
    let opts = InitOptions { advertise, listen, database_url, node_cert_secs: cert_secs };
    let st = runtime().block_on(state::init(dir, &opts))?;
    println!("created a trellis controller in {}", dir.display());
    println!("  mesh CA fingerprint (SHA-256): {}", state::ca_fingerprint_hex(&st)?);
    println!("  advertised at: {}", st.config.advertise.join(", "));
    println!("  listens on: {}", st.config.listen);
    println!("  database: {}", state::redact(&st.config.database_url));
    println!("  admin credential: {} (mode 0600)", dir.join(trellis_controller::layout::ADMIN_TOKEN).display());
    println!("next: trellis serve --state-dir {}", dir.display());
    Ok(ExitCode::SUCCESS)
}

pub fn serve(
    dir: &Path,
    database_url: Option<String>,
    listen: Option<String>,
    metrics_listen: Option<String>,
    restored: bool,
) -> Result<ExitCode> {
    let st = state::StateDir::load(dir)?;
    runtime().block_on(async {
        let mut server = trellis_server::Server::bind_restored(&st, database_url.as_deref(), listen.as_deref(), restored).await?;
        if let Some(m) = &metrics_listen {
            server = server.with_metrics(m).await?;
        }
        let url = database_url.as_deref().unwrap_or(&st.config.database_url);
        tracing::info!(
            "listening on {} ({}); database {}{}",
            server.local_addr(),
            st.config.advertise.join(", "),
            state::redact(url),
            metrics_listen.as_deref().map(|m| format!("; metrics on http://{m}/metrics")).unwrap_or_default()
        );
        let shutdown = async {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("signal handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term.recv() => {},
            }
            tracing::info!("stopping");
        };
        server.run(shutdown).await
    })?;
    Ok(ExitCode::SUCCESS)
}

fn print_refusal(e: &anyhow::Error, prefix: &Path) {
    if let Some(r) = e.downcast_ref::<trellis_client::Error>().and_then(trellis_client::Error::refused) {
        for d in &r.body.diagnostics {
            let mut d = d.clone();
            d.file = prefix.join(&d.file).display().to_string();
            eprintln!("{}", printable(&d.to_string()));
        }
    }
}

pub fn apply(conn: &Conn, dir: &Path, expect_revision: Option<i64>, json_out: bool) -> Result<ExitCode> {
    // Read exactly what `check` reads, and send it as written.
    let files = crate::declfs::files(dir)?.into_iter().map(|(path, text)| proto::DeclFile { path, text }).collect();
    let client = conn.client()?;
    let result = runtime().block_on(client.apply(&proto::ApplyRequest { files, expect_revision })).map_err(anyhow::Error::from);
    match result {
        Ok(r) => {
            for d in &r.diagnostics {
                let mut d = d.clone();
                d.file = dir.join(&d.file).display().to_string();
                eprintln!("{}", printable(&d.to_string()));
            }
            if json_out {
                println!("{}", serde_json::to_string_pretty(&json!({"revision": r.revision, "unchanged": r.unchanged}))?);
            } else if r.unchanged {
                println!("unchanged: revision {} already holds this declaration", r.revision);
            } else {
                println!("applied {} as revision {}", dir.display(), r.revision);
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            print_refusal(&e, dir);
            Err(e)
        }
    }
}

#[derive(Subcommand)]
pub enum TokenCommand {
    /// Create a one-time enrolment token for a declared node, or a reusable one for a pool's
    /// members (--pool); prints the one line the node enrols with (`trellis-agent enrol --token-file`)
    Create {
        /// The node, as declared (not with --pool)
        #[arg(required_unless_present = "pool", conflicts_with = "pool")]
        node: Option<String>,
        /// A token for members of this [[pool]], each named by the controller POOL-1, POOL-2, ...
        #[arg(long)]
        pool: Option<String>,
        /// How many members the pool token may enrol (with --pool; default 1)
        #[arg(long)]
        uses: Option<u32>,
        /// How long the token stays valid: 90s, 30m, 1h, 7d
        #[arg(long, default_value = "1h", value_parser = parse_duration)]
        ttl: u64,
        /// The node waits in "pending" until `trellis node approve NAME`
        #[arg(long)]
        require_approval: bool,
        #[arg(long)]
        json: bool,
    },
    /// List tokens and their state (valid, used, expired, revoked); secrets are never shown
    List {
        #[arg(long)]
        json: bool,
    },
    /// Revoke an unused token by its id
    Revoke { id: String },
}

pub fn parse_duration(s: &str) -> Result<u64, String> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a duration such as 90s, 30m, 1h or 7d"))?;
    let mult = match unit {
        "s" | "" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("{s:?}: the unit must be s, m, h or d")),
    };
    Ok(n * mult)
}

pub fn token(conn: &Conn, cmd: TokenCommand) -> Result<ExitCode> {
    let client = conn.client()?;
    let rt = runtime();
    match cmd {
        TokenCommand::Create { node, pool, uses, ttl, require_approval, json } => {
            let req = proto::TokenRequest { node: node.unwrap_or_default(), ttl_secs: ttl, require_approval, pool, uses };
            let t = rt.block_on(client.create_token(&req))?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(
                        &json!({"token": t.token, "id": t.id, "node": t.node, "pool": t.pool, "uses": t.uses, "expires_at": t.expires_at})
                    )?
                );
            } else {
                let what = match &t.pool {
                    Some(pool) => format!("pool {} ({} use(s), each a new member)", printable(pool), t.uses),
                    None => format!("node {}", printable(&t.node)),
                };
                eprintln!(
                    "token {} for {what}, valid until {}; on the node, save it to a file and run: trellis-agent enrol --token-file FILE --state-dir DIR (or give it on standard input with --token-file -)",
                    t.id,
                    date(t.expires_at)
                );
                println!("{}", t.token);
            }
        }
        TokenCommand::List { json } => {
            let list = rt.block_on(client.tokens())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                println!("{:<18} {:<20} {:<8} {:<9} {:<22} APPROVAL", "ID", "NODE", "STATE", "USES", "EXPIRES");
                for t in list {
                    // A pool token names its pool, and how many of its uses were taken.
                    let node = match &t.pool {
                        Some(p) => format!("pool:{}", printable(p)),
                        None => printable(&t.node).to_string(),
                    };
                    println!(
                        "{:<18} {:<20} {:<8} {:<9} {:<22} {}",
                        printable(&t.id),
                        node,
                        t.state,
                        format!("{}/{}", t.used, t.uses),
                        date(t.expires_at),
                        if t.require_approval { "required" } else { "-" }
                    );
                }
            }
        }
        TokenCommand::Revoke { id } => {
            let t = rt.block_on(client.revoke_token(&id))?;
            println!("token {} for node {} is {}", printable(&t.id), printable(&t.node), t.state);
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn nodes(conn: &Conn, json_out: bool) -> Result<ExitCode> {
    let list = runtime().block_on(conn.client()?.nodes())?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<20} {:<9} {:<12} {:<16} {:<28} {:<17} {:<22} {:<22} AGENT",
        "NODE", "STATE", "POOL", "IPV4", "IPV6", "KEY", "CERT EXPIRES", "LAST CONTACT"
    );
    for n in list.clone() {
        let opt = |o: Option<String>| o.unwrap_or_else(|| "-".into());
        // The agent's release and, after it, the protocol it speaks: `0.1.0 (1.0)`.
        let agent = match (&n.agent_release, &n.agent_protocol) {
            (Some(r), Some(p)) => format!("{} ({})", printable(r), printable(p)),
            _ => "-".into(),
        };
        println!(
            "{:<20} {:<9} {:<12} {:<16} {:<28} {:<17} {:<22} {:<22} {agent}",
            printable(&n.name),
            n.state,
            n.pool.as_deref().map_or("-".into(), |p| printable(p).to_string()),
            opt(n.ipv4),
            opt(n.ipv6),
            opt(n.key_fingerprint),
            n.cert_not_after.map_or("-".into(), date),
            n.last_contact.map_or("-".into(), date)
        );
    }
    print_revoking(list.iter().filter_map(|n| n.revocation.as_ref().map(|r| (n.name.as_str(), r))));
    Ok(ExitCode::SUCCESS)
}

#[derive(Subcommand)]
pub enum NodeCommand {
    /// Let a node that enrolled with --require-approval take part
    Approve { name: String },
    /// Revoke a node: its certificate is refused at once, and its peers drop its key in their
    /// next bundle. It is "revoking" until every node that held its key (its peers, a hub relaying
    /// for it, the routers of its routes) has reported applying a bundle without it, then
    /// "revoked" (`trellis nodes` shows which peers still hold it, and why)
    Revoke {
        name: String,
        /// Return once the revocation is complete; exit 1 naming the peers that still hold the
        /// key, and why, if it is not within --timeout
        #[arg(long)]
        wait: bool,
        /// How long --wait waits: 90s, 30m, 1h
        #[arg(long, default_value = "60s", value_parser = parse_duration, requires = "wait")]
        timeout: u64,
        /// Print the revocation as JSON (with --wait, as it stands when the wait ends)
        #[arg(long)]
        json: bool,
    },
}

pub fn node(conn: &Conn, cmd: NodeCommand) -> Result<ExitCode> {
    let client = conn.client()?;
    let rt = runtime();
    match cmd {
        NodeCommand::Approve { name } => {
            let r = rt.block_on(client.approve(&name))?;
            println!("node {} is {}", printable(&r.node), r.state);
            Ok(ExitCode::SUCCESS)
        }
        NodeCommand::Revoke { name, wait, timeout, json } => revoke(&client, &rt, &name, wait.then_some(timeout), json),
    }
}

/// `trellis node revoke`: the decision, then (with a timeout) its revocation followed until it
/// is complete.
fn revoke(client: &AdminClient, rt: &tokio::runtime::Runtime, name: &str, wait: Option<u64>, json_out: bool) -> Result<ExitCode> {
    let started = std::time::Instant::now();
    rt.block_on(client.revoke(name))?;
    let mut r = rt.block_on(client.revocation(name))?;
    if let Some(secs) = wait {
        let deadline = started + std::time::Duration::from_secs(secs);
        while !r.complete() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(200));
            r = rt.block_on(client.revocation(name))?;
        }
    }
    let took = started.elapsed().as_secs_f64();
    let now = trellis_controller::unix_now();
    if json_out {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else if r.complete() {
        println!(
            "node {} is {}; {took:.2} s after the request, every node that held its key has applied a bundle without it",
            printable(name),
            r.summary(now)
        );
    } else if wait.is_some() {
        eprintln!("node {} is still {} after {took:.0} s", printable(name), r.summary(now));
    } else {
        println!(
            "node {} is {}: its certificate is refused now; `trellis node revoke {} --wait` or `trellis nodes` tells when every peer has dropped its key",
            printable(name),
            r.summary(now),
            printable(name)
        );
    }
    Ok(if wait.is_some() && !r.complete() { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// A line for each revocation in progress, under a table of nodes.
fn print_revoking<'a>(revocations: impl Iterator<Item = (&'a str, &'a proto::Revocation)>) {
    let now = trellis_controller::unix_now();
    for (name, r) in revocations.filter(|(_, r)| !r.complete()) {
        println!("{}: {}", printable(name), r.summary(now));
    }
}

/// Reads the audit chain page by page (at most `page` records a request), handing each page to
/// `each`: however long the chain, memory holds one page.
fn audit_pages(
    client: &trellis_client::AdminClient,
    rt: &tokio::runtime::Runtime,
    page: i64,
    mut each: impl FnMut(&[proto::AuditRecord]) -> Result<()>,
) -> Result<()> {
    let mut after = 0;
    loop {
        let records = rt.block_on(client.audit_page(after, page))?;
        each(&records)?;
        match records.last() {
            Some(r) if records.len() as i64 >= page => after = r.seq,
            _ => return Ok(()),
        }
    }
}

pub fn audit_verify(conn: &Conn, page: i64) -> Result<ExitCode> {
    let client = conn.client()?;
    let rt = runtime();
    // The checkpoint first: records decided in between only lengthen the chain past it.
    let checkpoint = rt.block_on(client.audit_checkpoint())?;
    // On the controller's machine its key is at hand: the checkpoint's signature is checked too.
    let signed = match (&checkpoint, conn.state_dir()) {
        (Some(cp), Some(dir)) => {
            let key = state::StateDir::load(dir)?.signing_key()?.verifying_key();
            if !trellis_controller::audit::checkpoint_signed_by(cp, &key) {
                bail!("the audit checkpoint's signature does not verify with the controller's key: it was forged or damaged");
            }
            "signed by the controller's key"
        }
        _ => "signature not checked from afar",
    };
    let mut check = trellis_proto::audit::ChainCheck::new(checkpoint.clone());
    audit_pages(&client, &rt, page, |records| records.iter().try_for_each(|r| check.feed(r)).map_err(|e| anyhow::anyhow!("{e}")))?;
    let head = check.head().to_string();
    let n = check.finish().map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("audit chain verified: {n} records, head {}", if head.is_empty() { "-" } else { head.as_str() });
    match checkpoint {
        Some(cp) => println!("matches the controller's checkpoint at record {} ({signed})", cp.seq),
        None => println!("no checkpoint yet (the controller signs one after its first decision)"),
    }
    Ok(ExitCode::SUCCESS)
}

pub fn audit_list(conn: &Conn, json_out: bool, page: i64) -> Result<ExitCode> {
    let client = conn.client()?;
    let rt = runtime();
    let mut out = std::io::stdout().lock();
    // Printed as it is read, page by page.
    if json_out {
        let mut first = true;
        write!(out, "[")?;
        audit_pages(&client, &rt, page, |records| {
            for r in records {
                write!(out, "{}\n  {}", if first { "" } else { "," }, serde_json::to_string(r)?)?;
                first = false;
            }
            Ok(())
        })?;
        writeln!(out, "{}]", if first { "" } else { "\n" })?;
        return Ok(ExitCode::SUCCESS);
    }
    writeln!(out, "{:>5}  {:<20}  {:<26}  {:<20}  {:<24}  DETAIL", "SEQ", "AT", "ACTION", "SUBJECT", "ACTOR")?;
    audit_pages(&client, &rt, page, |records| {
        for r in records {
            writeln!(
                out,
                "{:>5}  {:<20}  {:<26}  {:<20}  {:<24}  {}",
                r.seq,
                date(r.at),
                printable(&r.action),
                printable(&r.subject),
                printable(&r.actor),
                printable(&r.detail)
            )?;
        }
        Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

pub fn status(conn: &Conn, json_out: bool) -> Result<ExitCode> {
    let list = runtime().block_on(conn.client()?.status())?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<20} {:<9} {:>7} {:>7}  {:<14} {:<22} {:<22} {:>4}  LAST ERROR",
        "NODE", "STATE", "DESIRED", "APPLIED", "STALENESS", "LAST CONTACT", "CERT EXPIRES", "GAPS"
    );
    for n in &list {
        let num = |v: Option<i64>| v.map_or("-".to_string(), |v| v.to_string());
        let staleness = match (n.stale, n.stale_for) {
            (true, Some(s)) => format!("stale {s}s"),
            (true, None) => "stale".to_string(),
            (false, _) if n.desired_version.is_some() => "current".to_string(),
            _ => "-".to_string(),
        };
        println!(
            "{:<20} {:<9} {:>7} {:>7}  {:<14} {:<22} {:<22} {:>4}  {}",
            printable(&n.name),
            n.state,
            num(n.desired_version),
            num(n.applied_version),
            staleness,
            n.last_contact.map_or("-".into(), date),
            n.cert_not_after.map_or("-".into(), date),
            n.evidence_missing,
            printable(n.last_error.as_deref().unwrap_or_default())
        );
    }
    print_revoking(list.iter().filter_map(|n| n.revocation.as_ref().map(|r| (n.name.as_str(), r))));
    // Agents older than `[mesh] min_agent_version`: refused on every request until upgraded.
    for refused in list.iter().filter_map(|n| n.agent_refused.as_deref()) {
        println!("refused: {}", printable(refused));
    }
    // Clocks further off than tolerated: served all the same, but worth an operator's look.
    for skew in list.iter().filter_map(|n| n.clock_skew.as_deref()) {
        println!("clock: {}", printable(skew));
    }
    // Relayed pairs: each one's path, once from each side (ADR 0032).
    for n in &list {
        for p in &n.paths {
            println!("path: {} -> {}: {}", printable(&n.name), printable(&p.peer), printable(&p.text));
        }
    }
    // Ingress nodes: their Traefik as their agents last reported it (ADR 0026).
    let now = trellis_files::unix_now();
    for ingress in list.iter().filter_map(|n| n.ingress.as_ref()) {
        println!("{}", ingress.summary(now));
    }
    // A controller without service certificates answers 404 here: nothing to add.
    if let Ok(certs) = runtime().block_on(conn.client()?.certificates()) {
        for note in crate::certs::notes(&certs, trellis_files::unix_now()) {
            println!("{note}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

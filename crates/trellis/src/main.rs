//! `trellis`: the controller, the admin CLI, the offline tools and the lab, as one binary.

mod admin;
#[path = "../../agent/src/assets.rs"]
mod assets;
mod certs;
mod conn;
mod declfs;
mod offline;
mod trust;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use trellis_client::log;

#[derive(Parser)]
#[command(
    name = "trellis",
    version,
    about = "Mesh connectivity and enrolment controller",
    long_about = "trellis computes, for every node of a declared mesh, its WireGuard peers, the endpoints it may dial, its inbound filter and its DNS zone, and delivers them as files.\n\nExit status: 0 on success, 1 when the input is wrong (the message says where), 2 on a usage error."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a declaration directory and run its policy tests; reports every problem at once
    Check {
        /// Directory holding mesh.toml and modules/*.toml
        dir: PathBuf,
        /// Print the diagnostics as JSON
        #[arg(long)]
        json: bool,
    },
    /// Write a node's files (wireguard.conf, nftables.conf, mesh.zone) offline; keys come from the declaration
    Compile {
        /// Directory holding mesh.toml and modules/*.toml
        dir: PathBuf,
        /// The node to compile
        #[arg(long, required_unless_present = "all", conflicts_with = "all")]
        node: Option<String>,
        /// Compile every node, each under OUT/NODE/
        #[arg(long)]
        all: bool,
        /// Where to write: OUT/etc/trellis/... (or OUT/NODE/etc/trellis/... with --all)
        #[arg(long)]
        out: PathBuf,
        /// Print what was written as JSON
        #[arg(long)]
        json: bool,
    },
    /// Explain the path between two nodes and what the filter lets through each way; with
    /// `expose:NAME` alone, which ingress nodes serve an exposure, its backends and the rule that
    /// admits the edge
    Explain {
        /// Directory holding mesh.toml and modules/*.toml
        dir: PathBuf,
        /// One node, or `expose:NAME`
        from: String,
        /// The other node, a route (`route:NAME`) or an address; none for `expose:NAME`
        to: Option<String>,
        /// Print the explanation as JSON
        #[arg(long)]
        json: bool,
    },
    /// Draw the declared mesh offline: nodes, direct peerings, pairs relayed through a hub, pairs with no path
    Graph {
        /// Directory holding mesh.toml and modules/*.toml
        dir: PathBuf,
        /// dot (Graphviz) or svg (drawn by trellis, no Graphviz needed)
        #[arg(long, value_enum, default_value = "svg")]
        format: offline::GraphFormat,
        /// Write here instead of standard output
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Create a controller: mesh CA, TLS certificate, bundle-signing key, admin credential, database
    Init {
        /// Where the controller keeps its keys, configuration and (by default) its SQLite database
        #[arg(long)]
        state_dir: PathBuf,
        /// HOST:PORT where nodes and admins reach the controller; repeat for several
        #[arg(long, required = true)]
        advertise: Vec<String>,
        /// The socket address to listen on (default 0.0.0.0 with the first advertised port)
        #[arg(long)]
        listen: Option<String>,
        /// sqlite://PATH or postgres://... (default: sqlite in the state directory)
        #[arg(long)]
        database_url: Option<String>,
        /// Lifetime of node certificates: 24h, 90m, 7d; nodes renew at two thirds of it
        #[arg(long, default_value = "24h", value_parser = admin::parse_duration)]
        cert_lifetime: u64,
    },
    /// Run the controller: HTTPS API for enrolment, nodes and admins
    Serve {
        #[arg(long)]
        state_dir: PathBuf,
        /// Override the database: sqlite://PATH or postgres://USER@HOST/DB (several controllers may share one PostgreSQL)
        #[arg(long)]
        database_url: Option<String>,
        /// Override the listen address
        #[arg(long)]
        listen: Option<String>,
        /// Serve Prometheus metrics in plain HTTP at http://ADDR/metrics (off unless given)
        #[arg(long, value_name = "ADDR")]
        metrics_listen: Option<String>,
        /// The log on standard error: text, or one JSON object a line (filter with RUST_LOG, e.g. RUST_LOG=debug)
        #[arg(long, value_enum, default_value = "text")]
        log_format: log::LogFormat,
        /// The database was restored from a backup: serve it although it is behind this
        /// controller's signed audit checkpoint (refused otherwise). Every bundle version moves
        /// past the highest ever published, so every node takes its next bundle, and the restore
        /// is recorded in the audit chain. Needed once; harmless when nothing was restored.
        #[arg(long)]
        restored: bool,
    },
    /// Publish a declaration directory to the controller as a new revision (validated exactly like check)
    Apply {
        dir: PathBuf,
        /// Fail with a conflict unless the current revision is N (0 before the first apply)
        #[arg(long)]
        expect_revision: Option<i64>,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: conn::Conn,
    },
    /// Enrolment tokens: create, list, revoke
    Token {
        #[command(subcommand)]
        cmd: admin::TokenCommand,
        #[command(flatten)]
        conn: conn::Conn,
    },
    /// Every node: state, overlay addresses, key fingerprint, certificate expiry, last contact; under the table, each
    /// revocation in progress and the peers that still hold its key
    Nodes {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: conn::Conn,
    },
    /// Per node: desired and applied bundle version, staleness, last contact, certificate expiry, last error, evidence gaps
    Status {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: conn::Conn,
    },
    /// Every service certificate: node, module, serial, expiry, state and the names it carries (ADR 0023)
    Certs {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: conn::Conn,
    },
    /// The controllers nodes are given in their signed bundles: list, add or remove one, no node enrols again (ADR 0028)
    Controllers {
        #[command(subcommand)]
        cmd: trust::ControllersCommand,
        #[command(flatten)]
        conn: conn::Conn,
    },
    /// Rotate the bundle-signing key without re-enrolling any node, and follow the rotation (ADR 0027)
    Rotate {
        #[command(subcommand)]
        cmd: trust::RotateCommand,
        #[command(flatten)]
        conn: conn::Conn,
    },
    /// Approve or revoke a node
    Node {
        #[command(subcommand)]
        cmd: admin::NodeCommand,
        #[command(flatten)]
        conn: conn::Conn,
    },
    /// Verify the audit chain of every governance decision
    Audit {
        #[command(subcommand)]
        cmd: AuditCommand,
        #[command(flatten)]
        conn: conn::Conn,
    },
    /// Write shell completions and man pages made from this command line into DIR (for packages)
    #[command(hide = true)]
    Assets { dir: PathBuf },
    /// Lab topologies in network namespaces with the real controller and agents (needs root)
    Lab {
        #[command(subcommand)]
        cmd: LabCommand,
    },
}

#[derive(Subcommand)]
enum LabCommand {
    /// Build the namespaces, start the controller and an agent per node, wait for convergence
    Up {
        file: PathBuf,
        #[command(flatten)]
        agents: LabAgents,
    },
    /// Run every expectation through the overlay and print expected versus seen; exit 1 on a mismatch
    Check { file: PathBuf },
    /// Remove every namespace and process the lab made
    Down { file: PathBuf },
    /// up, check and down
    Run {
        file: PathBuf,
        #[command(flatten)]
        agents: LabAgents,
    },
}

/// How the lab runs its agents.
#[derive(clap::Args)]
struct LabAgents {
    /// The WireGuard backend of every agent (`trellis-agent run --wireguard`)
    #[arg(long, default_value = "auto", value_parser = ["auto", "kernel", "wireguard-go", "boringtun", "userspace", "gotatun", "none"])]
    wireguard: String,
}

#[derive(Subcommand)]
enum AuditCommand {
    /// List every governance decision: tokens, redemptions, enrolments, approvals, revocations, renewals, applies
    List {
        #[arg(long)]
        json: bool,
        /// Records read per request (1 to 1000); the list is printed as it is read
        #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=1000))]
        page_size: i64,
    },
    /// Check that every audit record follows the one before it, unaltered, up to the controller's signed checkpoint; names the first that does not
    Verify {
        /// Records read per request (1 to 1000); memory holds one page, however long the chain
        #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=1000))]
        page_size: i64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check { dir, json } => offline::check(&dir, json),
        Command::Compile { dir, node, all: _, out, json } => offline::compile(&dir, node.as_deref(), &out, json),
        Command::Explain { dir, from, to, json } => offline::explain(&dir, &from, to.as_deref(), json),
        Command::Assets { dir } => assets::write(<Cli as clap::CommandFactory>::command(), &dir).map(|()| ExitCode::SUCCESS),
        Command::Graph { dir, format, out } => offline::graph(&dir, format, out.as_deref()),
        Command::Lab { cmd } => match cmd {
            LabCommand::Up { file, agents } => trellis_lab::up(&file, declfs::read, &agents.wireguard).map(|_| ExitCode::SUCCESS),
            LabCommand::Check { file } => {
                trellis_lab::check(&file, declfs::read).map(|ok| if ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
            }
            LabCommand::Down { file } => trellis_lab::down(&file).map(|_| ExitCode::SUCCESS),
            LabCommand::Run { file, agents } => trellis_lab::run(&file, declfs::read, &agents.wireguard),
        },
        Command::Init { state_dir, advertise, listen, database_url, cert_lifetime } => {
            admin::init(&state_dir, advertise, listen, database_url, cert_lifetime)
        }
        Command::Serve { state_dir, database_url, listen, metrics_listen, log_format, restored } => log::init(log_format, "info")
            .map_err(anyhow::Error::from)
            .and_then(|()| admin::serve(&state_dir, database_url, listen, metrics_listen, restored)),
        Command::Apply { dir, expect_revision, json, conn } => admin::apply(&conn, &dir, expect_revision, json),
        Command::Token { cmd, conn } => admin::token(&conn, cmd),
        Command::Nodes { json, conn } => admin::nodes(&conn, json),
        Command::Node { cmd, conn } => admin::node(&conn, cmd),
        Command::Status { json, conn } => admin::status(&conn, json),
        Command::Certs { json, conn } => certs::certs(&conn, json),
        Command::Controllers { cmd, conn } => trust::controllers(cmd, &conn),
        Command::Rotate { cmd, conn } => trust::rotate(cmd, &conn),
        Command::Audit { cmd: AuditCommand::Verify { page_size }, conn } => admin::audit_verify(&conn, page_size),
        Command::Audit { cmd: AuditCommand::List { json, page_size }, conn } => admin::audit_list(&conn, json, page_size),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            // The sentence may quote what the controller or a file said: kept on one line.
            eprintln!("error: {}", trellis_proto::text::printable(&format!("{e:#}")));
            ExitCode::from(1)
        }
    }
}

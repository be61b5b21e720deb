//! `trellis`: the controller, the admin CLI, the offline tools and the lab, as one binary.

mod bench;
mod declfs;
mod offline;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

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
    /// Explain the path between two nodes and what the filter lets through each way
    Explain {
        /// Directory holding mesh.toml and modules/*.toml
        dir: PathBuf,
        /// One node
        from: String,
        /// The other node
        to: String,
        /// Print the explanation as JSON
        #[arg(long)]
        json: bool,
    },
    /// Measure the compiler on a generated mesh and print the figures
    Bench {
        #[command(subcommand)]
        what: bench::BenchCommand,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check { dir, json } => offline::check(&dir, json),
        Command::Compile {
            dir,
            node,
            all: _,
            out,
            json,
        } => offline::compile(&dir, node.as_deref(), &out, json),
        Command::Explain {
            dir,
            from,
            to,
            json,
        } => offline::explain(&dir, &from, &to, json),
        Command::Bench { what } => bench::run(what),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

//! `trellis-dev`: tools for developing trellis (benchmarks and the delivery load test), kept out
//! of the binaries that are shipped.

mod agentbench;
mod applybench;
mod args;
mod bench;
mod certs;
mod compilebench;
mod delivery;
mod enrolbench;
mod enrolling;
mod figures;
mod fleet;
mod meshdir;
mod meshgen;
mod storm;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "trellis-dev", version, about = "Development tools for trellis: benchmarks and load tests (not shipped)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure the compiler, enrolment or delivery and print the figures
    Bench {
        #[command(subcommand)]
        what: args::BenchCommand,
    },
    /// Write a generated fleet-shaped mesh (by default 10,000 nodes) as a declaration directory
    Mesh(args::MeshArgs),
}

/// The admin client of the controller whose state directory is `dir`.
fn admin_client(dir: &std::path::Path) -> anyhow::Result<trellis_client::AdminClient> {
    let (host, ca, token) = trellis_controller::state::StateDir::load(dir)?.admin_access()?;
    Ok(trellis_client::AdminClient::new(&trellis_client::base_url(&host), &ca, &token)?)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The controllers and agents a bench runs in this process log only when asked (`RUST_LOG`):
    // an apply's stages, a publish run's, at debug.
    if std::env::var_os("RUST_LOG").is_some() {
        if let Err(e) = trellis_client::log::init(trellis_client::log::LogFormat::Text, "off") {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    }
    let result = match cli.command {
        Command::Bench { what } => bench::run(what),
        Command::Mesh(a) => meshgen::write_mesh(&a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

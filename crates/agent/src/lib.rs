//! `trellis-agent`: enrols a node with a pasted token, keeps its identity current, and brings
//! the host to the bundles the controller decides. The binary of the same name only calls
//! [`main`].

mod assets;
pub mod backoff;
pub mod bundle;
pub mod certs;
pub mod dns;
pub mod doctor;
pub mod exec;
pub mod host;
pub mod identity;
pub mod ingress;
pub mod install;
pub mod libnft;
pub use trellis_client::log;
pub mod metrics;
pub mod nftgen;
pub mod nfthelper;
pub mod paths;
pub mod plan;
pub mod routes;
pub mod run;
pub mod state;
pub mod statedir;
pub mod status;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

pub use trellis_files::unix_now;

#[derive(Parser)]
#[command(
    name = "trellis-agent",
    version,
    about = "The trellis host agent: enrol this node, then pull and apply what the controller decided for it",
    long_about = "The trellis host agent. Enrol this node by pasting the token `trellis token create NODE` printed; its private keys are made here and never leave this machine.\n\nExit status: 0 on success, 1 when something is wrong (the message says what), 2 on a usage error."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where and how a bundle is applied on this host.
#[derive(clap::Args)]
struct HostArgs {
    /// Where the node's keys, certificate, identity, manifest and evidence buffer are kept
    #[arg(long)]
    state_dir: PathBuf,
    /// Where file resources are written (a directory per host in the lab)
    #[arg(long, default_value = "/")]
    root: PathBuf,
    /// WireGuard backend
    #[arg(long, value_enum, default_value = "auto")]
    wireguard: host::WgMode,
    /// Write the files only: no interface, no ruleset, no DNS
    #[arg(long)]
    files_only: bool,
    /// The port the mesh zone is served on, on the node's overlay addresses
    #[arg(long, default_value_t = 53)]
    dns_port: u16,
    /// Serve Prometheus metrics in plain HTTP at http://ADDR/metrics (`run` only; off unless given)
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// On an ingress node (one the declaration names in an exposure's `via`): run Traefik as the
    /// agent's child (`traefik`; `auto`: when a `traefik` is on PATH), or leave etc/trellis/traefik/
    /// to an operator's own Traefik (`none`)
    #[arg(long, value_enum, default_value = "auto")]
    ingress: ingress::IngressMode,
    /// Where the agent's Traefik serves its API and ping, on loopback, for the agent to read
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9180")]
    ingress_api: std::net::SocketAddr,
}

impl HostArgs {
    /// The agent's options and the real host's backends.
    fn agent(self, wait: u64, max_applies: u64, max_backoff: u64) -> Result<run::Agent> {
        if !self.files_only {
            self.wireguard.check()?;
            self.ingress.check()?;
        }
        if !self.ingress_api.ip().is_loopback() {
            anyhow::bail!("--ingress-api {}: Traefik's API is served on loopback only", self.ingress_api);
        }
        let backends = exec::Backends::host(&self.root, &self.state_dir, self.wireguard, self.files_only);
        run::Agent::new(self.options(wait, max_applies, max_backoff), backends)
    }

    fn options(self, wait: u64, max_applies: u64, max_backoff: u64) -> run::Options {
        run::Options {
            state_dir: self.state_dir,
            root: self.root,
            files_only: self.files_only,
            wait,
            max_applies,
            max_backoff,
            dns_port: self.dns_port,
            metrics_listen: self.metrics_listen,
            ingress: if self.files_only { ingress::IngressMode::None } else { self.ingress },
            ingress_api: self.ingress_api,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Enrol this node: make its keys, check the controller against the token's CA fingerprint, get its certificate
    Enrol {
        /// The token, as printed by `trellis token create` (one line); prefer --token-file, which
        /// keeps it out of the process list and the shell's history
        #[arg(required_unless_present = "token_file", conflicts_with = "token_file")]
        token: Option<String>,
        /// Read the token from this file (`-`: standard input)
        #[arg(long, value_name = "FILE")]
        token_file: Option<PathBuf>,
        /// Where the node's keys, certificate and identity are kept
        #[arg(long)]
        state_dir: PathBuf,
        /// Enrol again even if the state directory already holds an identity (keeps the WireGuard key)
        #[arg(long)]
        force: bool,
        /// How long to keep asking when no controller answers. Every attempt sends the same keys,
        /// so an enrolment that reached the controller but whose answer was lost is answered
        /// again; after this the keys stay, and running the same command later completes it
        #[arg(long, value_name = "SECONDS", default_value_t = 60)]
        retry_for: u64,
    },
    /// Renew the node certificate over mutual TLS once two thirds of its lifetime have passed
    Renew {
        #[arg(long)]
        state_dir: PathBuf,
        /// Renew now, whatever the certificate's age
        #[arg(long)]
        force: bool,
    },
    /// Save the node's current bundle exactly as the controller sends it
    Fetch {
        #[arg(long)]
        state_dir: PathBuf,
        /// Where to save it
        #[arg(long)]
        out: PathBuf,
        /// Long-poll: wait up to this many seconds for a version newer than --held
        #[arg(long, default_value_t = 0)]
        wait: u64,
        /// The version already held (sent as If-None-Match)
        #[arg(long)]
        held: Option<i64>,
    },
    /// Verify a saved bundle with the agent's own checks, or with --held the bundle this node
    /// holds (its signed head and the files written under --root); prints why when it refuses (exit 1)
    Verify {
        /// A bundle saved by `fetch`
        #[arg(required_unless_present = "held")]
        file: Option<PathBuf>,
        /// Verify what this node holds instead: the signed head kept in the state directory and
        /// every file it names, read from under --root (a file changed by hand is named)
        #[arg(long, conflicts_with_all = ["file", "last_version", "last_bundle"])]
        held: bool,
        /// Where the held files are written (as the agent's --root)
        #[arg(long, default_value = "/")]
        root: PathBuf,
        #[arg(long)]
        state_dir: PathBuf,
        /// Refuse versions not greater than this one, as the agent would
        #[arg(long, conflicts_with = "last_bundle")]
        last_version: Option<u64>,
        /// The bundle applied before (a file saved by `fetch`): its version and content are what
        /// the new one is checked against; the same version with other content is refused
        #[arg(long)]
        last_bundle: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Pull, verify, write and apply this node's bundles until stopped; keeps the overlay up when the controller is away
    Run {
        #[command(flatten)]
        host: HostArgs,
        /// Long-poll wait in seconds (at most 60)
        #[arg(long, default_value_t = 55)]
        wait: u64,
        /// Stop after applying this many bundles (0: run until stopped)
        #[arg(long, default_value_t = 0)]
        max_applies: u64,
        /// The longest wait between retries while the controller is unreachable, in seconds
        #[arg(long, default_value_t = 30)]
        max_backoff: u64,
        /// The log on standard error: text, or one JSON object a line (filter with RUST_LOG, e.g. RUST_LOG=debug)
        #[arg(long, value_enum, default_value = "text")]
        log_format: log::LogFormat,
    },
    /// Apply one saved bundle now, exactly as `run` would (verify, write, apply, roll back on failure, report)
    Apply {
        /// A bundle saved by `fetch`
        file: PathBuf,
        #[command(flatten)]
        host: HostArgs,
    },
    /// Write shell completions and man pages made from this command line into DIR (for packages)
    #[command(hide = true)]
    Assets { dir: PathBuf },
    /// nftables' library for the agent, in a process of its own (the agent starts it: `nfthelper`)
    #[command(hide = true, name = nfthelper::SUBCOMMAND)]
    NftHelper,
    /// What this host has and lacks for the agent, each line ✓ or ✗ with what fixes it (exit 1
    /// when a ✗ stops the agent); before `enrol` give the token, so the node is checked before
    /// the token is spent
    Doctor {
        /// The node's state directory (read only: its modes, and once enrolled its controllers)
        #[arg(long, default_value = "/var/lib/trellis-agent")]
        state_dir: PathBuf,
        /// Where the node's files are (an ingress node holds etc/trellis/ingress.toml there)
        #[arg(long, default_value = "/")]
        root: PathBuf,
        /// Before enrolment: the token, whose controllers are tried against its CA fingerprint
        /// (nothing is sent but a TLS handshake and a HEAD request); prefer --token-file
        #[arg(long, conflicts_with = "token_file")]
        token: Option<String>,
        /// Read the token from this file (`-`: standard input)
        #[arg(long, value_name = "FILE")]
        token_file: Option<PathBuf>,
        /// Print as JSON
        #[arg(long)]
        json: bool,
    },
    /// Show this node's identity and certificate
    Status {
        #[arg(long)]
        state_dir: PathBuf,
        /// Print as JSON
        #[arg(long)]
        json: bool,
    },
}

/// The whole command line of `trellis-agent`.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // The loop logs what it does; a one-shot command only what went wrong.
    let logging = match &cli.command {
        // gotatun says "Peer added" at info for every peer: ten thousand lines a first apply.
        Command::Run { log_format, .. } => log::init(*log_format, "info,gotatun=warn"),
        _ => log::init(log::LogFormat::Text, "warn"),
    };
    if let Err(e) = logging {
        eprintln!("error: {}", trellis_proto::text::printable(&format!("{e:#}")));
        return ExitCode::from(2);
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let result = rt.block_on(async {
        match cli.command {
            Command::Enrol { token, token_file, state_dir, force, retry_for } => {
                let source = match (token, token_file) {
                    (Some(t), _) => identity::TokenSource::Argument(t),
                    (None, Some(f)) => identity::TokenSource::File(f),
                    (None, None) => unreachable!("clap requires one"),
                };
                identity::enrol(source, &state_dir, force, std::time::Duration::from_secs(retry_for)).await
            }
            Command::Renew { state_dir, force } => identity::renew(&state_dir, force).await,
            Command::Status { state_dir, json } => identity::status(&state_dir, json),
            Command::Doctor { state_dir, root, token, token_file, json } => {
                doctor::run(&state_dir, &root, doctor::read_token(token, token_file.as_deref())?, json)
            }
            Command::Assets { dir } => assets::write(<Cli as clap::CommandFactory>::command(), &dir),
            Command::NftHelper => nfthelper::serve(),
            Command::Run { host, wait, max_applies, max_backoff, .. } => host.agent(wait.min(60), max_applies, max_backoff)?.run().await,
            Command::Apply { file, host } => {
                let state_dir = host.state_dir.clone();
                let ev = host.agent(0, 0, 1)?.apply_file(&file).await?;
                match ev.as_ref().and_then(|ev| ev.error.clone()) {
                    None => {
                        // A bundle already applied is left as it is; the outcome is the same.
                        let version = ev.map_or_else(|| state::Manifest::load(&state_dir).version as i64, |ev| ev.version);
                        println!("applied version {version} from {}", file.display());
                        Ok(())
                    }
                    Some(e) => Err(anyhow::anyhow!(
                        "version {} from {} failed and the previous configuration was restored: {e}",
                        ev.map_or(0, |ev| ev.version),
                        file.display()
                    )),
                }
            }
            Command::Fetch { state_dir, out, wait, held } => bundle::fetch(&state_dir, &out, wait.min(60), held).await,
            Command::Verify { file: Some(file), state_dir, last_version, last_bundle, json, .. } => {
                bundle::verify(&file, &state_dir, last_version, last_bundle.as_deref(), json)
            }
            Command::Verify { file: None, state_dir, root, json, .. } => bundle::verify_held(&state_dir, &root, json),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", trellis_proto::text::printable(&format!("{e:#}")));
            ExitCode::from(1)
        }
    }
}

//! The command line of the benches and of `trellis-dev mesh`: what each takes, shared by the
//! benches that take the same (`delivery` and `fleet`, the two enrolment benches).

use clap::{Args, Subcommand};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Full compile of every node, and a one-node change recompiling only what it affects
    Compile(CompileArgs),
    /// Enrolments per second against an in-process controller on loopback (CSR signing included);
    /// with --mesh DIR, every node of a real declaration enrols and the bench also reports when
    /// every node holds its first bundle
    Enrol(EnrolArgs),
    /// N simulated agents against a real `trellis serve` on loopback: 304s per second, and the
    /// time from one `apply` until every long-polling agent holds its new bundle; with --mesh
    /// DIR, on a real declaration: a change to about 1 % of the nodes, one node added, and the
    /// controller's memory
    Delivery(DeliveryArgs),
    /// Service certificates (ADR 0023): the services CA's signatures per second, issuance over
    /// HTTPS end to end, and what renewals cost a controller at a fleet's size
    Certs(CertsArgs),
    /// A real agent in a network namespace on a node that sees N peers (an operator's): the
    /// first apply, a change of three peers, each split by phase (files, WireGuard, ruleset,
    /// DNS), its memory and its resolver's answer time, on each WireGuard backend; needs root
    Agent(AgentArgs),
    /// One `trellis apply` of a one-node group move on a real declaration directory, against a
    /// controller in this process, with the stages before the store timed offline
    Apply(ApplyArgs),
}

#[derive(Args)]
pub struct ApplyArgs {
    /// The declaration directory (`trellis-dev mesh --out DIR`; nodes without public_key)
    #[arg(long, value_name = "DIR")]
    pub mesh: std::path::PathBuf,
    /// How many times each stage is timed, and half how many applies (the move and back)
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// sqlite://... or postgres://... of an empty database (default: SQLite in a temporary state
    /// directory)
    #[arg(long)]
    pub database_url: Option<String>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct DeliveryArgs {
    /// How many simulated agents (each enrols, then long-polls); with --mesh, that many of the
    /// mesh's nodes, spread evenly over it
    #[arg(long, default_value_t = 2000)]
    pub agents: usize,
    /// How many `304` requests to time (spread over 64 concurrent agents; not with --mesh)
    #[arg(long, default_value_t = 20000)]
    pub requests: usize,
    /// A declaration directory (`trellis-dev mesh --out DIR`; nodes without public_key) to run
    /// on. Every node of it enrols (the ones without an agent too, so that bundles are those of
    /// a fully enrolled fleet); --agents of them long-poll. Then: a few nodes move to another
    /// group (chosen so that about 1 % of the bundles change), one node is added and enrols;
    /// the figures are the time until every affected agent holds its new bundle, the bytes
    /// agents fetched again, and the peak memory of `trellis serve`
    #[arg(long, value_name = "DIR", conflicts_with = "requests")]
    pub mesh: Option<std::path::PathBuf>,
    /// sqlite://... or postgres://... (default: SQLite in a temporary state directory)
    #[arg(long)]
    pub database_url: Option<String>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct EnrolArgs {
    /// How many nodes enrol (in a generated mesh of nodes without modules; not with --mesh)
    #[arg(long, default_value_t = 500, conflicts_with = "mesh")]
    pub nodes: usize,
    /// How many enrolments are in flight at once (default 16, or 64 with --mesh)
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// A declaration directory (`trellis-dev mesh --out DIR`; nodes without public_key): apply
    /// it and enrol every one of its nodes
    #[arg(long, value_name = "DIR")]
    pub mesh: Option<std::path::PathBuf>,
    /// With --mesh: how many nodes fetch their first bundle over HTTPS with their own certificate
    #[arg(long, default_value_t = 16)]
    pub sample: usize,
    /// sqlite://... or postgres://... of an empty database (default: SQLite in a temporary state
    /// directory)
    #[arg(long)]
    pub database_url: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// The shape of a generated mesh.
#[derive(Args, Clone)]
pub struct Shape {
    #[arg(long, default_value_t = 10_000)]
    pub nodes: usize,
    #[arg(long, default_value_t = 500)]
    pub groups: usize,
    #[arg(long, default_value_t = 50)]
    pub modules: usize,
    #[arg(long, default_value_t = 20)]
    pub networks: usize,
    #[arg(long, default_value_t = 10)]
    pub hubs: usize,
}

#[derive(Args)]
pub struct CompileArgs {
    #[command(flatten)]
    pub shape: Shape,
    /// How many times to time the full compile and each change (the medians are reported)
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Time only this change (its JSON key: rekey_one_node, enrol_one_node, regroup_one_node,
    /// pool_member_joins, no_change), for a profiler
    #[arg(long, value_name = "KEY")]
    pub only: Option<String>,
    /// Print the figures as JSON
    #[arg(long)]
    pub json: bool,
}

/// `trellis-dev mesh`: a generated declaration directory, for `trellis compile` and the benches.
#[derive(Args)]
pub struct MeshArgs {
    #[command(flatten)]
    pub shape: Shape,
    /// Where to write mesh.toml and modules/ (created; must not hold a mesh.toml yet)
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// Declare every node's WireGuard key in the mesh (nodes managed outside trellis); by
    /// default nodes have no key and get one by enrolling
    #[arg(long)]
    pub declared_keys: bool,
}

#[derive(Args)]
pub struct CertsArgs {
    /// How many enrolled nodes each ask for one service certificate over HTTPS
    #[arg(long, default_value_t = 300)]
    pub nodes: usize,
    /// How many requests are in flight at once
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// How many CSRs the services CA signs in the signing-alone figure
    #[arg(long, default_value_t = 2000)]
    pub signatures: usize,
    /// The fleet the renewal cost is worked out for (one certificate a node, 24 h lifetime,
    /// renewed at two thirds)
    #[arg(long, default_value_t = 10_000)]
    pub fleet: usize,
    /// sqlite://... or postgres://... of an empty database (default: SQLite in a temporary state
    /// directory)
    #[arg(long)]
    pub database_url: Option<String>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct AgentArgs {
    /// How many peers the measured node has (every other node of the mesh)
    #[arg(long, default_value_t = 10_000)]
    pub peers: usize,
    /// The WireGuard backends to measure, in turn
    #[arg(long, value_delimiter = ',', default_value = "wireguard-go,gotatun,boringtun")]
    pub wireguard: Vec<String>,
    /// How many DNS queries to time (the median is reported)
    #[arg(long, default_value_t = 20)]
    pub queries: usize,
    /// How many three-peer changes to time, each undoing the one before (the median is reported,
    /// each phase's median beside it)
    #[arg(long, default_value_t = 5)]
    pub changes: usize,
    /// Seconds the node rests after its first bundle before the changes are timed: the first
    /// bundle's handshake follow-ups (about 6 s, up to 256 peers restarted eight times) are the
    /// first apply's cost, not a change's. 0 times the changes while they run.
    #[arg(long, default_value_t = 8)]
    pub rest: u64,
    /// Print the figures as JSON
    #[arg(long)]
    pub json: bool,
}

//! The lab's PostgreSQL: Debian's server, run as the `postgres` user in its host's namespace on
//! the host's lab addresses, trusting the lab's nets; the database every controller replica
//! shares. Its data directory lives in the lab's directory and goes with it.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::file::{Host, LabFile};
use crate::net::{in_ns, sh};
use crate::LabState;

/// The port PostgreSQL listens on in its namespace.
const PORT: u16 = 5432;
/// The database the controllers share.
const DATABASE: &str = "trellis";

/// A PostgreSQL server the lab started, recorded so that `down` can stop it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Postgres {
    pub host: String,
    pub ns: String,
    /// The server's binaries (`initdb`, `pg_ctl`, `createdb`).
    pub bin: PathBuf,
    /// Owned by `postgres`: the data directory (`data/`), the socket and the log.
    pub dir: PathBuf,
    pub url: String,
}

/// The newest installed server's binaries, as `scripts/postgres` finds them.
fn bin_dir() -> Result<PathBuf> {
    let root = Path::new("/usr/lib/postgresql");
    let newest = std::fs::read_dir(root)
        .ok()
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse::<u32>().ok()?, e.path().join("bin"))))
        .filter(|(_, bin)| bin.join("pg_ctl").exists())
        .max();
    newest
        .map(|(_, bin)| bin)
        .context("PostgreSQL is not installed (apt-get install postgresql); the lab's role = \"postgres\" host needs it")
}

/// A shell command run as the `postgres` user, each argument quoted.
fn as_postgres(args: &[&str]) -> String {
    args.iter().map(|a| format!("'{}'", a.replace('\'', r"'\''"))).collect::<Vec<_>>().join(" ")
}

fn su(ns: Option<&str>, args: &[&str]) -> Result<String> {
    let script = as_postgres(args);
    let cmd = ["su", "postgres", "-s", "/bin/sh", "-c", script.as_str()];
    match ns {
        Some(ns) => in_ns(ns, &cmd),
        None => sh(&cmd),
    }
}

fn path(p: &Path) -> Result<&str> {
    p.to_str().with_context(|| format!("{} is not UTF-8", p.display()))
}

/// Creates a cluster in the lab's directory and starts it in `ns` on the host's lab addresses,
/// trusting every lab net, with one database for the controllers. Recorded in `st` before it
/// starts, so that `down` stops it after any failure. Returns the URL the controllers use.
pub(crate) fn start(lab: &LabFile, host: &Host, ns: &str, st: &mut LabState) -> Result<String> {
    let bin = bin_dir()?;
    // The `postgres` user must pass through the lab's directory (only that: it lists nothing).
    std::fs::set_permissions(&st.dir, std::os::unix::fs::PermissionsExt::from_mode(0o711))
        .with_context(|| format!("cannot open {} to the postgres user", st.dir.display()))?;
    let dir = st.dir.join("postgres");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    sh(&["chown", "postgres", path(&dir)?])?;
    let data = dir.join("data");
    let (b, d) = (bin.clone(), path(&dir)?.to_string());
    let tool = |name: &str| b.join(name).to_str().map(str::to_string).context("PostgreSQL's directory is not UTF-8");
    su(None, &[&tool("initdb")?, "-D", path(&data)?, "-A", "trust", "-U", "postgres", "--no-sync"])
        .context("initdb for the lab's PostgreSQL")?;
    // Trust for the lab's own nets only: nothing else can reach these namespaces.
    let hba = data.join("pg_hba.conf");
    let mut rules = std::fs::read_to_string(&hba).with_context(|| format!("cannot read {}", hba.display()))?;
    rules.push_str("\n# The lab's nets.\n");
    for n in &lab.net {
        for prefix in [&n.ipv4, &n.ipv6].into_iter().flatten() {
            rules.push_str(&format!("host all all {prefix} trust\n"));
        }
    }
    std::fs::write(&hba, rules).with_context(|| format!("cannot write {}", hba.display()))?;
    let listen: Vec<&str> = host.addresses.values().map(String::as_str).collect();
    let first = listen.first().context("the postgres host has no address")?;
    let url_host = if first.contains(':') { format!("[{first}]") } else { first.to_string() };
    let url = format!("postgres://postgres@{url_host}:{PORT}/{DATABASE}");
    st.postgres = Some(Postgres { host: host.name.clone(), ns: ns.to_string(), bin, dir: dir.clone(), url: url.clone() });
    let options = format!("-k {d} -p {PORT} -c listen_addresses={} -c fsync=off -c max_connections=200", listen.join(","));
    let log = dir.join("server.log");
    if let Err(e) = su(Some(ns), &[&tool("pg_ctl")?, "-D", path(&data)?, "-l", path(&log)?, "-w", "-t", "30", "-o", &options, "start"]) {
        let tail = std::fs::read_to_string(&log).unwrap_or_default();
        bail!("the lab's PostgreSQL did not start: {e}\n{}", tail.trim());
    }
    su(Some(ns), &[&tool("createdb")?, "-h", &d, "-p", &PORT.to_string(), DATABASE]).context("createdb for the lab's PostgreSQL")?;
    Ok(url)
}

/// Stops the server (immediately: the lab's data is thrown away), so that nothing of it
/// outlives the lab; a server already gone is no error.
pub(crate) fn stop(pg: &Postgres) {
    let (Some(pg_ctl), Some(data)) = (pg.bin.join("pg_ctl").to_str().map(str::to_string), pg.dir.join("data").to_str().map(str::to_string))
    else {
        return;
    };
    if pg.dir.join("data/postmaster.pid").exists() {
        let _ = su(None, &[&pg_ctl, "-D", &data, "-m", "immediate", "-w", "-t", "10", "stop"]);
    }
}

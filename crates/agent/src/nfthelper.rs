//! nftables' library in a process of its own: the agent's helper (`trellis-agent nft-helper`,
//! hidden), started by the agent from its own executable at the first ruleset and kept. The
//! library calls `exit()` or `abort()` on some failures (`nft_ctx_new` exits with status 3 when
//! it cannot open its netlink socket, an allocation that fails exits, an internal `BUG()`
//! aborts); in the agent's process that would end the data plane, the resolver and Traefik
//! with it. The agent sends each batch of commands over a socket and reads the result: one
//! round trip, tens of microseconds. A helper that ends (or does not start) fails the apply it
//! served, as nft refusing the batch would; the next apply starts another, and after
//! `ATTEMPTS` failures in a row the agent runs `nft` instead (ADR 0031).

use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// The hidden subcommand the helper runs as.
pub const SUBCOMMAND: &str = "nft-helper";

/// The most bytes in one frame either way: a ruleset of a hundred thousand sources, or its
/// listing, is a few megabytes.
const MAX_FRAME: usize = 64 << 20;

/// How long the agent waits for an answer: a whole load of ten thousand sources takes tens of
/// milliseconds; a helper silent this long is stopped, so that it cannot hold the run loop.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

/// Failures in a row (a start that failed, a helper that ended), with no answer between, after
/// which the agent gives up on the helper and runs `nft`.
const ATTEMPTS: u32 = 3;

/// What the helper keeps of its standard error for the agent's message, from its end.
const SAID: u64 = 1024;

/// A request's kind, the first byte of its frame.
const RUN: u8 = b'r';
const LOAD: u8 = b'l';
/// An answer's kind: done (what nft printed), refused (nft's message), and, as the first answer
/// only, that the library does not load (why).
const DONE: u8 = b'd';
const REFUSED: u8 = b'e';
const NO_LIBRARY: u8 = b'n';

/// One batch for nft, as `LibNft` takes it.
pub enum Request<'a> {
    /// Commands run as one transaction; the answer is what nft printed.
    Run(&'a str),
    /// A ruleset's text loaded as nft loads a file; `name` stands for it in nft's message.
    Load { text: &'a str, name: &'a str },
}

#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    /// nft's own message: the batch was refused, and nothing changed.
    #[error("{0}")]
    Refused(String),
    /// The library does not load on this host (the agent runs `nft`).
    #[error("{0}")]
    NoLibrary(String),
    /// The helper could not be started, or it ended (an exit, an abort, a signal) or stopped
    /// answering before it answered this batch.
    #[error("{0}")]
    Ended(String),
}

/// The agent's side: the helper it runs, started again after it ended.
pub struct Helper {
    /// Environment the helper gets besides the agent's (a test's fault).
    env: Vec<(String, String)>,
    running: Option<Running>,
    /// Failures in a row since the last answer (see `ATTEMPTS`).
    failures: u32,
}

struct Running {
    child: Child,
    socket: UnixStream,
    /// The helper's standard error, a file in memory: what libnftables printed as it exited.
    stderr: std::fs::File,
}

impl Default for Helper {
    fn default() -> Self {
        Self::new()
    }
}

impl Helper {
    /// Started at the first batch.
    pub fn new() -> Helper {
        Helper { env: Vec::new(), running: None, failures: 0 }
    }

    /// A helper started with this in its environment (a test's fault).
    #[cfg(test)]
    pub(crate) fn with_env(key: &str, value: &str) -> Helper {
        Helper { env: vec![(key.to_string(), value.to_string())], ..Helper::new() }
    }

    /// The running helper's process id.
    pub fn pid(&self) -> Option<u32> {
        self.running.as_ref().map(|r| r.child.id())
    }

    /// Whether it kept failing (`ATTEMPTS` in a row): the agent runs `nft` instead.
    pub fn exhausted(&self) -> bool {
        self.failures >= ATTEMPTS
    }

    /// One batch, one round trip; the helper is started first if none runs.
    pub fn run(&mut self, request: Request<'_>) -> Result<String, HelperError> {
        let frame = request.frame().map_err(HelperError::Refused)?;
        if self.running.is_none() {
            match Running::start(&self.env) {
                Ok(r) => self.running = Some(r),
                Err(e) => {
                    if matches!(e, HelperError::Ended(_)) {
                        self.failures += 1;
                    }
                    return Err(e);
                }
            }
        }
        let running = self.running.as_mut().expect("started above");
        let answer = running.socket.write_all(&frame).and_then(|()| read_frame(&mut running.socket));
        match answer {
            Ok((kind @ (DONE | REFUSED), body)) => {
                self.failures = 0;
                let text = String::from_utf8_lossy(&body).into_owned();
                if kind == DONE {
                    Ok(text)
                } else {
                    Err(HelperError::Refused(text))
                }
            }
            Ok((kind, _)) => Err(self.ended(io::Error::new(io::ErrorKind::InvalidData, format!("an answer of unknown kind {kind}")))),
            Err(e) => Err(self.ended(e)),
        }
    }

    /// The running helper gone, and why, as the batch's error.
    fn ended(&mut self, error: io::Error) -> HelperError {
        self.failures += 1;
        let running = self.running.take().expect("a helper ran");
        HelperError::Ended(running.end("before it answered", error))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // It holds nothing: stopped now, and reaped (both nothing once it was reaped).
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Running {
    /// This executable again, as the helper, its standard input one end of a socket pair and
    /// its standard error a file in memory; ready when it says its library loaded.
    fn start(env: &[(String, String)]) -> Result<Running, HelperError> {
        let cannot = |what: &str, e: io::Error| HelperError::Ended(format!("cannot start nftables' helper process ({what}): {e}"));
        let (ours, theirs) = UnixStream::pair().map_err(|e| cannot("making a socket pair", e))?;
        let stderr = memfd().map_err(|e| cannot("making a file in memory for its standard error", e))?;
        let child_stderr = stderr.try_clone().map_err(|e| cannot("duplicating that file", e))?;
        let mut command = command();
        command.envs(env.iter().map(|(k, v)| (k, v)));
        command.stdin(Stdio::from(OwnedFd::from(theirs))).stdout(Stdio::null()).stderr(Stdio::from(child_stderr));
        let child = command.spawn().map_err(|e| cannot("running /proc/self/exe", e))?;
        // The command holds the helper's end of the socket: this process must not, or the
        // helper's end would never be seen.
        drop(command);
        let set = ours.set_read_timeout(Some(ANSWER_TIMEOUT)).and_then(|()| ours.set_write_timeout(Some(ANSWER_TIMEOUT)));
        let mut running = Running { child, socket: ours, stderr };
        if let Err(e) = set {
            return Err(HelperError::Ended(running.end("as it started", e)));
        }
        match read_frame(&mut running.socket) {
            Ok((DONE, _)) => {
                tracing::debug!(pid = running.child.id(), "nftables' helper process started");
                Ok(running)
            }
            Ok((NO_LIBRARY, why)) => {
                let _ = running.child.wait();
                Err(HelperError::NoLibrary(String::from_utf8_lossy(&why).into_owned()))
            }
            Ok((kind, _)) => Err(HelperError::Ended(
                running.end("as it started", io::Error::new(io::ErrorKind::InvalidData, format!("a first answer of kind {kind}"))),
            )),
            Err(e) => Err(HelperError::Ended(running.end("as it started", e))),
        }
    }

    /// Reaps the helper (stopping it if it still runs: it stopped answering) and says how it
    /// ended and what it printed.
    fn end(mut self, when: &str, error: io::Error) -> String {
        let pid = self.child.id();
        let silent = matches!(error.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut);
        // Its end of the socket closes as it exits, a moment before it can be reaped.
        let status = if silent { None } else { exited_within(&mut self.child, Duration::from_secs(1)) };
        let said = said(&self.stderr);
        match status {
            Some(status) => format!("nftables' helper process (pid {pid}) ended {when}: it {}{said}", describe(status)),
            None => {
                let _ = self.child.kill();
                let _ = self.child.wait();
                if silent {
                    format!(
                        "nftables' helper process (pid {pid}) did not answer within {} s and was stopped{said}",
                        ANSWER_TIMEOUT.as_secs()
                    )
                } else {
                    format!("nftables' helper process (pid {pid}) failed {when} and was stopped: {error}{said}")
                }
            }
        }
    }
}

/// How the helper is started: this executable again, with the hidden subcommand. A unit-test
/// binary is libtest's, which knows no subcommand: there the helper is the ignored test
/// `nfthelper::tests::helper`, run alone.
fn command() -> Command {
    use std::os::unix::process::CommandExt;
    // The executable this process runs, even when a package upgrade replaced the file.
    let mut command = Command::new("/proc/self/exe");
    if cfg!(test) {
        command.args(["--exact", "nfthelper::tests::helper", "--ignored", "--quiet", "--test-threads=1"]).env(TEST_HELPER, "serve");
    } else {
        command.arg0("trellis-agent").arg(SUBCOMMAND);
    }
    command
}

/// Set to the helper of the tests (`serve`, or a fault to make first).
const TEST_HELPER: &str = "TRELLIS_TEST_NFT_HELPER";

/// Waits for the child to exit by itself, this long at most.
fn exited_within(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    let until = Instant::now() + grace;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(1)),
            _ => return None,
        }
    }
}

/// "exited with status 3", "was killed by signal 9 (SIGKILL)".
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => {
            let name = nix::sys::signal::Signal::try_from(signal).map_or("unknown", |s| s.as_str());
            let core = if status.core_dumped() { ", dumping core" } else { "" };
            format!("was killed by signal {signal} ({name}){core}")
        }
        (None, None) => format!("ended ({status})"),
    }
}

/// The end of what the helper printed, as ", and said: …", or nothing.
fn said(stderr: &std::fs::File) -> String {
    use std::os::unix::fs::FileExt;
    let len = stderr.metadata().map_or(0, |m| m.len());
    let from = len.saturating_sub(SAID);
    let mut tail = vec![0; (len - from) as usize];
    if stderr.read_exact_at(&mut tail, from).is_err() {
        return String::new();
    }
    let text = String::from_utf8_lossy(&tail);
    let text: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    if text.is_empty() {
        String::new()
    } else {
        format!(", and said: {}", text.join(" / "))
    }
}

/// A file in memory, closed on exec (the helper gets its own copy as its standard error).
fn memfd() -> io::Result<std::fs::File> {
    // SAFETY: a NUL-terminated name; the descriptor is owned as soon as it exists.
    let fd = unsafe { libc::memfd_create(c"trellis-nft-helper".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a new descriptor nothing else owns.
    Ok(unsafe { std::fs::File::from_raw_fd(fd) })
}

impl Request<'_> {
    /// Its frame: kind, length, then the commands, or the name's length, the name and the text.
    fn frame(&self) -> Result<Vec<u8>, String> {
        let (kind, len) = match self {
            Request::Run(commands) => (RUN, commands.len()),
            Request::Load { text, name } => (LOAD, 4 + name.len() + text.len()),
        };
        if len > MAX_FRAME {
            return Err(format!("nft's commands are {len} bytes, more than the {} MiB the agent sends at once", MAX_FRAME >> 20));
        }
        let mut frame = Vec::with_capacity(5 + len);
        frame.push(kind);
        frame.extend_from_slice(&(len as u32).to_le_bytes());
        match self {
            Request::Run(commands) => frame.extend_from_slice(commands.as_bytes()),
            Request::Load { text, name } => {
                frame.extend_from_slice(&(name.len() as u32).to_le_bytes());
                frame.extend_from_slice(name.as_bytes());
                frame.extend_from_slice(text.as_bytes());
            }
        }
        Ok(frame)
    }
}

/// Writes one frame.
fn write_frame(w: &mut impl Write, kind: u8, body: &[u8]) -> io::Result<()> {
    let mut frame = Vec::with_capacity(5 + body.len());
    frame.push(kind);
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(body);
    w.write_all(&frame)
}

/// Reads one frame, its size bounded; the other end closed before one is an error.
fn read_frame(r: &mut impl Read) -> io::Result<(u8, Vec<u8>)> {
    let mut header = [0u8; 5];
    r.read_exact(&mut header)?;
    let len = u32::from_le_bytes(header[1..].try_into().expect("four bytes")) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("a frame of {len} bytes, more than {} MiB", MAX_FRAME >> 20)));
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body)?;
    Ok((header[0], body))
}

/// The helper's side (`trellis-agent nft-helper`): loads the library, says whether it did, and
/// answers batches from its standard input, the agent's socket, until the agent closes it.
pub fn serve() -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fstat into a zeroed struct of its own.
    let is_socket = unsafe {
        let mut stat: libc::stat = std::mem::zeroed();
        libc::fstat(io::stdin().as_raw_fd(), &mut stat) == 0 && stat.st_mode & libc::S_IFMT == libc::S_IFSOCK
    };
    if !is_socket {
        anyhow::bail!("`trellis-agent {SUBCOMMAND}` is started by the agent itself, with a socket as its standard input");
    }
    // SAFETY: standard input is a socket (checked above), owned here from now on.
    let mut socket = unsafe { UnixStream::from_raw_fd(0) };
    let mut lib = match crate::libnft::LibNft::load() {
        Ok(lib) => lib,
        Err(e) => return Ok(write_frame(&mut socket, NO_LIBRARY, format!("{e:#}").as_bytes())?),
    };
    write_frame(&mut socket, DONE, b"")?;
    loop {
        let (kind, body) = match read_frame(&mut socket) {
            Ok(frame) => frame,
            // The agent closed its end (or ended): nothing more to do.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let done = match kind {
            RUN => lib.run(&String::from_utf8_lossy(&body)),
            LOAD => {
                let (name, text) = load_parts(&body)?;
                lib.load_ruleset(text, name).map(|()| String::new())
            }
            other => anyhow::bail!("a request of unknown kind {other}"),
        };
        match done {
            Ok(out) if out.len() > MAX_FRAME => {
                let why = format!("nft printed {} bytes, more than the {} MiB the helper answers with", out.len(), MAX_FRAME >> 20);
                write_frame(&mut socket, REFUSED, why.as_bytes())?
            }
            Ok(out) => write_frame(&mut socket, DONE, out.as_bytes())?,
            Err(e) => write_frame(&mut socket, REFUSED, format!("{e:#}").as_bytes())?,
        }
    }
}

/// A load's name and text.
fn load_parts(body: &[u8]) -> anyhow::Result<(&str, &str)> {
    let (len, rest) = body.split_at_checked(4).ok_or_else(|| anyhow::anyhow!("a load without its name's length"))?;
    let len = u32::from_le_bytes(len.try_into().expect("four bytes")) as usize;
    let (name, text) = rest.split_at_checked(len).ok_or_else(|| anyhow::anyhow!("a load shorter than its name"))?;
    Ok((std::str::from_utf8(name)?, std::str::from_utf8(text)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{Firewall, Nft};

    /// The helper of this test binary (see `command`): a process the tests start, not a test.
    /// `no-descriptor` first leaves the process no descriptor free, as an exhausted
    /// `RLIMIT_NOFILE` does: libnftables then cannot open its netlink socket, and `nft_ctx_new`
    /// exits with status 3 (review finding 9).
    #[test]
    #[ignore = "the helper process the tests start, not a test"]
    fn helper() {
        let Ok(what) = std::env::var(TEST_HELPER) else { return };
        if what == "no-descriptor" {
            // Loaded first, so that loading it again takes no descriptor.
            // SAFETY: as in `LibNft::load`; kept loaded until the process exits.
            std::mem::forget(unsafe { libloading::Library::new("libnftables.so.1") }.expect("libnftables loads"));
            let limit = libc::rlimit { rlim_cur: 64, rlim_max: 64 };
            // SAFETY: a plain call with a struct that outlives it.
            assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) }, 0);
            while let Ok(f) = std::fs::File::open("/dev/null") {
                std::mem::forget(f);
            }
        }
        serve().unwrap();
    }

    /// Frames are bounded both ways, and a load's name and text come back as they were sent.
    #[test]
    fn frames_are_bounded_and_a_load_comes_back_as_sent() {
        let frame = Request::Load { text: "table inet trellis {}\n", name: "/etc/trellis/nftables.conf" }.frame().unwrap();
        let (kind, body) = read_frame(&mut &frame[..]).unwrap();
        assert_eq!((kind, load_parts(&body).unwrap()), (LOAD, ("/etc/trellis/nftables.conf", "table inet trellis {}\n")));
        assert_eq!(read_frame(&mut &frame[..3]).unwrap_err().kind(), io::ErrorKind::UnexpectedEof, "a frame cut short");
        let mut big = vec![DONE];
        big.extend_from_slice(&(MAX_FRAME as u32 + 1).to_le_bytes());
        assert_eq!(read_frame(&mut &big[..]).unwrap_err().kind(), io::ErrorKind::InvalidData, "more than a frame holds");
        let e = Request::Run(&"x".repeat(MAX_FRAME + 1)).frame().unwrap_err();
        assert!(e.contains("more than the 64 MiB the agent sends at once"), "{e}");
        assert!(load_parts(&[9, 0, 0, 0, b'a']).is_err(), "a name longer than the load");
        assert!(load_parts(&[1, 0]).is_err(), "no name's length");
    }

    /// A network namespace of its own, deleted on drop.
    struct Namespace(String);

    impl Namespace {
        fn new(tag: &str) -> Option<Namespace> {
            use trellis_testing::{can_run, Need};
            if !can_run(Need::Root) || !can_run(Need::Program("nft")) {
                return None;
            }
            let name = format!("trellis-{tag}-{}", std::process::id());
            let _ = std::process::Command::new("ip").args(["netns", "del", &name]).output();
            trellis_testing::cmd::ok(trellis_testing::cmd::sh("ip", &["netns", "add", &name]));
            Some(Namespace(name))
        }

        /// Runs `f` on a thread in the namespace: nftables' generation is read there, and the
        /// helper, started from that thread, runs there.
        fn within<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
            use std::os::fd::AsRawFd;
            std::thread::scope(|s| {
                s.spawn(|| {
                    let ns = std::fs::File::open(format!("/var/run/netns/{}", self.0)).unwrap();
                    // SAFETY: setns on this thread only, with a namespace file it holds open.
                    assert_eq!(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "{}", io::Error::last_os_error());
                    f()
                })
                .join()
                .unwrap()
            })
        }

        /// `nft ARGS` in the namespace, behind the agent's back; its output.
        fn nft(&self, args: &[&str]) -> String {
            trellis_testing::cmd::ok(trellis_testing::cmd::sh("ip", &[&["netns", "exec", &self.0, "nft"], args].concat()))
        }

        /// The sources of the rule's set in the kernel.
        fn sources(&self) -> String {
            let set = self.nft(&["list", "set", "inet", "trellis", "src_ssh_v4"]);
            set.split("elements = { ").nth(1).and_then(|e| e.split(" }").next()).unwrap_or("").to_string()
        }
    }

    impl Drop for Namespace {
        fn drop(&mut self) {
            let _ = std::process::Command::new("ip").args(["netns", "del", &self.0]).output();
        }
    }

    /// A ruleset as trellis writes one: a rule whose sources are a named set.
    fn ruleset(sources: &[&str], port: u16) -> String {
        format!(
            "table inet trellis {{\n}}\ndelete table inet trellis\n\ntable inet trellis {{\n\tset src_ssh_v4 {{\n\t\ttype ipv4_addr\n\t\telements = {{ {} }}\n\t}}\n\n\tchain input {{\n\t\ttype filter hook input priority filter; policy accept;\n\t\tiifname \"trellis0\" ip saddr @src_ssh_v4 tcp dport {{ {port} }} accept\n\t}}\n}}\n",
            sources.join(", ")
        )
    }

    fn apply(nft: &mut Nft, file: &std::path::Path, sources: &[&str], port: u16) -> anyhow::Result<()> {
        let text = ruleset(sources, port);
        let f = trellis_core::bundle::BundleFile::new(trellis_core::plan::NFTABLES_CONF, 0o644, text.into_bytes());
        nft.apply(&[crate::plan::TextFile { path: file.display().to_string(), sha256: f.sha256, content: f.content, change: None }])
    }

    fn kill(pid: u32) {
        use nix::sys::signal::{kill, Signal};
        kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    }

    /// Review finding 9: libnftables ran in the agent's process, and its `exit()` or `abort()`
    /// ended the agent. Its helper killed between applies (an abort, the OOM killer) fails the
    /// apply that finds it gone, in a sentence, with the ruleset loaded before still in the
    /// kernel; the next apply starts another helper. A change of elements does not need the
    /// helper (the kernel's own element messages, `nftgen::ElementBatch`): it goes through, and
    /// the whole load after it finds the helper gone.
    #[test]
    fn a_helper_that_ends_fails_the_apply_and_the_next_apply_starts_another() {
        let Some(ns) = Namespace::new("helper-killed") else { return };
        let dir = trellis_testing::TempDir::new("nft-helper-killed");
        let file = dir.path().join("nftables.conf");
        ns.within(|| {
            let mut nft = Nft::new();
            apply(&mut nft, &file, &["10.0.0.1"], 22).unwrap();
            let first = nft.helper_pid().expect("a helper runs");

            kill(first);
            apply(&mut nft, &file, &["10.0.0.2"], 22).expect("a change of elements goes without the helper");
            assert_eq!(ns.sources(), "10.0.0.2");
            assert_eq!(nft.whole_loads(), 1, "elements only: the table was the one loaded");
            let e = apply(&mut nft, &file, &["10.0.0.2"], 2222).expect_err("its helper was killed").to_string();
            let killed = format!("nftables' helper process (pid {first}) ended before it answered: it was killed by signal 9 (SIGKILL)");
            assert_eq!(e, format!("cannot load {}: {killed}", file.display()));
            assert!(ns.nft(&["list", "chain", "inet", "trellis", "input"]).contains("dport 22 accept"), "the ruleset loaded before stays");
            assert_eq!(nft.helper_pid(), None);

            apply(&mut nft, &file, &["10.0.0.2"], 2222).unwrap();
            let second = nft.helper_pid().expect("another helper runs");
            assert_ne!(first, second);
            assert!(ns.nft(&["list", "chain", "inet", "trellis", "input"]).contains("dport 2222 accept"));
            assert_eq!(nft.whole_loads(), 2);

            kill(second);
            let e = apply(&mut nft, &file, &["10.0.0.2"], 22).expect_err("its helper was killed").to_string();
            assert!(
                e.starts_with(&format!("cannot load {}: nftables' helper process (pid {second}) ended before it answered", file.display())),
                "{e}"
            );
            assert!(
                ns.nft(&["list", "chain", "inet", "trellis", "input"]).contains("dport 2222 accept"),
                "the ruleset loaded before stays"
            );

            apply(&mut nft, &file, &["10.0.0.2"], 22).unwrap();
            assert!(ns.nft(&["list", "chain", "inet", "trellis", "input"]).contains("dport 22 accept"));
            assert_eq!(nft.whole_loads(), 3);
            assert!(nft.in_process(), "through the library, in a third helper");
        });
    }

    /// Review finding 9, the fault it observed: with no descriptor free, libnftables cannot
    /// open its netlink socket and `nft_ctx_new` exits with status 3. In the helper that is a
    /// failed apply, with libnftables' own words, and the ruleset in the kernel stays; after
    /// three failures in a row the agent runs `nft`, and the next apply loads.
    #[test]
    fn libnftables_exiting_in_its_helper_fails_the_apply_and_the_agent_runs_nft_if_it_keeps_exiting() {
        let Some(ns) = Namespace::new("helper-exits") else { return };
        let dir = trellis_testing::TempDir::new("nft-helper-exits");
        let file = dir.path().join("nftables.conf");
        std::fs::write(&file, ruleset(&["10.0.0.1"], 22)).unwrap();
        ns.nft(&["-f", file.to_str().unwrap()]);
        ns.within(|| {
            let mut nft = Nft::with_helper(Helper::with_env(TEST_HELPER, "no-descriptor"));
            for attempt in 1..=ATTEMPTS {
                assert!(nft.in_process(), "attempt {attempt}: through the library");
                let e = apply(&mut nft, &file, &["10.0.0.2"], 22).expect_err("its helper exits").to_string();
                let start = format!("cannot load {}: nftables' helper process (pid ", file.display());
                assert!(e.starts_with(&start) && e.contains(") ended as it started: it exited with status 3, and said: "), "{e}");
                assert!(e.ends_with("Unable to initialize Netlink socket: Too many open files"), "{e}");
                assert_eq!(ns.sources(), "10.0.0.1", "the ruleset loaded before stays");
            }
            assert!(!nft.in_process(), "after {ATTEMPTS} failures in a row, the agent runs `nft`");
            apply(&mut nft, &file, &["10.0.0.2"], 22).unwrap();
            assert_eq!(ns.sources(), "10.0.0.2");
        });
    }

    /// The helper's round trip, against the library in this process: an empty batch, and a
    /// change of two elements. `cargo test -p trellis-agent --lib nfthelper::tests::round_trip
    /// -- --ignored --nocapture`, as root.
    #[test]
    #[ignore = "a measurement"]
    fn round_trip() {
        let Some(ns) = Namespace::new("helper-bench") else { return };
        ns.within(|| {
            const N: usize = 2000;
            let text = ruleset(&["10.0.0.1"], 22);
            let create = "create element inet trellis src_ssh_v4 { 10.9.0.1, 10.9.0.2 }\n";
            let delete = "delete element inet trellis src_ssh_v4 { 10.9.0.1, 10.9.0.2 }\n";
            let median = |mut f: Box<dyn FnMut() + '_>| {
                let mut times: Vec<Duration> = (0..N)
                    .map(|_| {
                        let t = Instant::now();
                        f();
                        t.elapsed()
                    })
                    .collect();
                times.sort();
                times[N / 2]
            };
            let mut helper = Helper::new();
            helper.run(Request::Load { text: &text, name: "bench" }).unwrap();
            let empty = median(Box::new(|| drop(helper.run(Request::Run("")).unwrap())));
            let mut flip = false;
            let two = median(Box::new(|| {
                flip = !flip;
                helper.run(Request::Run(if flip { create } else { delete })).unwrap();
            }));
            let mut lib = crate::libnft::LibNft::load().unwrap();
            let empty_here = median(Box::new(|| drop(lib.run("").unwrap())));
            let mut flip = false;
            let two_here = median(Box::new(|| {
                flip = !flip;
                lib.run(if flip { create } else { delete }).unwrap();
            }));
            eprintln!(
                "median of {N}: through the helper, an empty batch {empty:?}, two elements {two:?}; in this process, {empty_here:?} and {two_here:?}"
            );
        });
    }
}

//! The kernel's nftables generation: a number the kernel moves by one at every ruleset
//! transaction committed in a network namespace, whoever commits it and whatever table it
//! changes (`NFT_MSG_GETGEN` over netlink, what nft's own cache is checked with). Read right
//! before and after the agent's own commit, and again later, it says in one netlink round trip
//! of a few microseconds whether anything was committed since (ADR 0031).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `NFTA_GEN_ID` (linux/netfilter/nf_tables.h), which the libc crate does not name.
const NFTA_GEN_ID: u16 = 1;
/// A netlink message's header, and nfnetlink's after it.
const NLMSG_HEADER: usize = 16;
const NFGEN_HEADER: usize = 4;

/// A netlink socket the generation is read through, in the network namespace it was made in
/// (a socket keeps it whatever thread uses it).
pub struct Generation {
    socket: OwnedFd,
    seq: u32,
}

impl Generation {
    /// A socket in this thread's network namespace.
    pub fn open() -> io::Result<Generation> {
        // SAFETY: a plain socket call; the descriptor is owned as soon as it exists.
        let fd = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_NETFILTER) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a new descriptor nothing else owns.
        let socket = unsafe { OwnedFd::from_raw_fd(fd) };
        // A second at most: an answer that does not come must not hold the agent's loop.
        let timeout = libc::timeval { tv_sec: 1, tv_usec: 0 };
        // SAFETY: the option's value is a timeval that outlives the call, with its size.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Generation { socket, seq: 0 })
    }

    /// A socket in the named network namespace (`ip netns`), made by a thread that enters it,
    /// so that this process's own namespace is left as it is.
    pub fn in_namespace(name: &str) -> io::Result<Generation> {
        let path = format!("/var/run/netns/{name}");
        std::thread::scope(|s| {
            s.spawn(|| {
                let ns = std::fs::File::open(&path).map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))?;
                // SAFETY: setns on this short-lived thread only, with a namespace file it holds open.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(io::Error::last_os_error());
                }
                Generation::open()
            })
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the thread entering the network namespace panicked")))
        })
    }

    /// The generation now.
    pub fn read(&mut self) -> io::Result<u32> {
        self.seq = self.seq.wrapping_add(1);
        let kind = ((libc::NFNL_SUBSYS_NFTABLES << 8) | libc::NFT_MSG_GETGEN) as u16;
        // nfgenmsg: AF_UNSPEC, NFNETLINK_V0, 0.
        let mut request = Vec::with_capacity(NLMSG_HEADER + NFGEN_HEADER);
        message(&mut request, kind, libc::NLM_F_REQUEST as u16, self.seq, 0, 0, |_| Some(()));
        self.send(&request)?;
        let mut answer = [0u8; 1024];
        loop {
            let got = self.recv(&mut answer)?;
            // An answer to an earlier request that timed out is skipped.
            if let Some(found) = parse(&answer[..got], self.seq) {
                return found;
            }
        }
    }

    /// Sends these messages to the kernel, whole.
    fn send(&self, bytes: &[u8]) -> io::Result<()> {
        // SAFETY: the buffer is valid for its length; an unconnected netlink socket sends to the
        // kernel.
        let sent = unsafe { libc::send(self.socket.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), 0) };
        match sent {
            n if n < 0 => Err(io::Error::last_os_error()),
            n if n as usize != bytes.len() => Err(io::Error::other("the netlink messages were not sent whole")),
            _ => Ok(()),
        }
    }

    /// Receives the kernel's next datagram into `buf` (within the socket's one-second timeout);
    /// its length.
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: the buffer is valid for its length.
        let got = unsafe { libc::recv(self.socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(got as usize)
    }
}

/// Appends one netlink message to `out`: its header (length, type, flags, sequence number, port
/// 0: the kernel fills it in), nfgenmsg (family, version 0, `res_id` big-endian), and what `body`
/// writes; `None` when `body` gives none.
fn message(
    out: &mut Vec<u8>,
    kind: u16,
    flags: u16,
    seq: u32,
    family: u8,
    res_id: u16,
    body: impl FnOnce(&mut Vec<u8>) -> Option<()>,
) -> Option<()> {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(&[family, 0]);
    out.extend_from_slice(&res_id.to_be_bytes());
    body(out)?;
    let len = (out.len() - start) as u32;
    out[start..start + 4].copy_from_slice(&len.to_ne_bytes());
    Some(())
}

/// One netlink message of the kernel's: its type, its sequence number, its bytes.
type Message<'b> = (u16, u32, &'b [u8]);

/// The whole messages of a datagram from the kernel, and whether one was cut short (the rest are
/// not read).
fn messages(mut b: &[u8]) -> (Vec<Message<'_>>, bool) {
    let mut out = Vec::new();
    while b.len() >= NLMSG_HEADER {
        let len = u32::from_ne_bytes(b[0..4].try_into().expect("four bytes")) as usize;
        if len < NLMSG_HEADER || len > b.len() {
            return (out, true);
        }
        let kind = u16::from_ne_bytes(b[4..6].try_into().expect("two bytes"));
        let seq = u32::from_ne_bytes(b[8..12].try_into().expect("four bytes"));
        out.push((kind, seq, &b[..len]));
        // Each message is padded to four bytes.
        b = &b[len.next_multiple_of(4).min(b.len())..];
    }
    (out, false)
}

/// The most bytes one batch of element messages may take: well under a netlink socket's default
/// send buffer. A larger change goes through nft.
const MAX_BATCH: usize = 128 * 1024;

/// nf_tables' attributes of a set's element list (linux/netfilter/nf_tables.h).
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_DATA_VALUE: u16 = 1;
const NLA_F_NESTED: u16 = 0x8000;
const NFPROTO_INET: u8 = 1;

/// A transaction of the kernel's own element messages (`NFT_MSG_DELSETELEM`, then
/// `NFT_MSG_NEWSETELEM` with `NLM_F_EXCL`: each element deleted must be there and each created
/// must not), as `nft` would send for `delete element` and `create element`, without nft reading
/// the set's elements first (libnftables 1.0.6 lists a set of 50,000 sources for either, about
/// 15 ms). Made by [`Generation::batch`].
pub struct ElementBatch {
    bytes: Vec<u8>,
    /// The sequence number of the batch's begin: the kernel answers a commit that failed as a
    /// whole (after every message was taken) under it.
    begin: u32,
    /// The sequence numbers of its messages that the kernel answers (each but the batch's own
    /// begin and end).
    answered: Vec<u32>,
}

impl ElementBatch {
    /// The batch that makes these changes to the sets of `inet trellis`; `None` when an element
    /// is no address (a prefix, which only an interval set holds), or the batch would be large:
    /// then nft makes the change.
    fn of(table: &str, sets: &[trellis_core::ruleset::SetChange], seq: &mut u32) -> Option<ElementBatch> {
        let table = table.strip_prefix("inet ")?;
        let mut next = || {
            *seq = seq.wrapping_add(1);
            *seq
        };
        let mut b = ElementBatch { bytes: Vec::new(), begin: next(), answered: Vec::new() };
        let batch_begin = libc::NLMSG_MIN_TYPE as u16;
        message(&mut b.bytes, batch_begin, libc::NLM_F_REQUEST as u16, b.begin, 0, libc::NFNL_SUBSYS_NFTABLES as u16, |_| Some(()))?;
        for c in sets {
            for (kind, flags, elements) in
                [(libc::NFT_MSG_DELSETELEM, 0, &c.gone), (libc::NFT_MSG_NEWSETELEM, libc::NLM_F_CREATE | libc::NLM_F_EXCL, &c.came)]
            {
                if elements.is_empty() {
                    continue;
                }
                let kind = ((libc::NFNL_SUBSYS_NFTABLES << 8) | kind) as u16;
                let flags = (libc::NLM_F_REQUEST | libc::NLM_F_ACK | flags) as u16;
                let n = next();
                b.answered.push(n);
                message(&mut b.bytes, kind, flags, n, NFPROTO_INET, 0, |out| {
                    attr(out, NFTA_SET_ELEM_LIST_TABLE, &[table.as_bytes(), b"\0"].concat());
                    attr(out, NFTA_SET_ELEM_LIST_SET, &[c.set.as_bytes(), b"\0"].concat());
                    nest(out, NFTA_SET_ELEM_LIST_ELEMENTS, |out| {
                        for e in elements {
                            let key = match e.parse::<std::net::IpAddr>().ok()? {
                                std::net::IpAddr::V4(a) => a.octets().to_vec(),
                                std::net::IpAddr::V6(a) => a.octets().to_vec(),
                            };
                            nest(out, NFTA_LIST_ELEM, |out| {
                                nest(out, NFTA_SET_ELEM_KEY, |out| {
                                    attr(out, NFTA_DATA_VALUE, &key);
                                    Some(())
                                })
                            })?;
                        }
                        Some(())
                    })
                })?;
                if b.bytes.len() > MAX_BATCH {
                    return None;
                }
            }
        }
        message(
            &mut b.bytes,
            (libc::NLMSG_MIN_TYPE + 1) as u16,
            libc::NLM_F_REQUEST as u16,
            next(),
            0,
            libc::NFNL_SUBSYS_NFTABLES as u16,
            |_| Some(()),
        )?;
        Some(b)
    }
}

/// One attribute: its length and type, the value, padded to four bytes.
fn attr(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    out.extend_from_slice(&((4 + value.len()) as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(out.len().next_multiple_of(4), 0);
}

/// A nested attribute holding what `inner` writes.
fn nest(out: &mut Vec<u8>, kind: u16, inner: impl FnOnce(&mut Vec<u8>) -> Option<()>) -> Option<()> {
    let start = out.len();
    out.extend_from_slice(&[0; 2]);
    out.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    inner(out)?;
    // An attribute's length is 16 bits: a longer list (over 2,340 IPv6 elements of one set)
    // would be cut short, and the kernel would take the part it read. nft makes such a change.
    let len = u16::try_from(out.len() - start).ok()?;
    out[start..start + 2].copy_from_slice(&len.to_ne_bytes());
    Some(())
}

impl Generation {
    /// The batch of element messages that makes these changes to `table`'s sets, numbered on
    /// this socket ([`ElementBatch::of`]).
    pub fn batch(&mut self, table: &str, sets: &[trellis_core::ruleset::SetChange]) -> Option<ElementBatch> {
        ElementBatch::of(table, sets, &mut self.seq)
    }

    /// Commits `batch` in one transaction: all of it or, refused, none of it (the kernel's error,
    /// such as `No such file or directory` for an element deleted that is not there).
    pub fn commit(&mut self, batch: &ElementBatch) -> io::Result<()> {
        self.send(&batch.bytes)?;
        // One answer for each element message: an acknowledgement, or the error that refused
        // the transaction.
        let mut waiting: std::collections::HashSet<u32> = batch.answered.iter().copied().collect();
        let mut refused = None;
        // An error carries the message it refuses: room for the largest batch.
        let mut answer = vec![0u8; MAX_BATCH + 4096];
        while !waiting.is_empty() {
            let got = self.recv(&mut answer)?;
            for (kind, seq, m) in messages(&answer[..got]).0 {
                if kind != libc::NLMSG_ERROR as u16 {
                    continue;
                }
                let ours = waiting.remove(&seq) || seq == batch.begin;
                if ours && errno(m) != 0 && refused.is_none() {
                    refused = Some(io::Error::from_raw_os_error(-errno(m)));
                }
            }
        }
        refused.map_or(Ok(()), Err)
    }
}

/// The generation in the kernel's answer to request `seq`; `None` when these messages answer
/// another request.
fn parse(datagram: &[u8], seq: u32) -> Option<io::Result<u32>> {
    let newgen = ((libc::NFNL_SUBSYS_NFTABLES << 8) | libc::NFT_MSG_NEWGEN) as u16;
    let (whole, cut) = messages(datagram);
    for (kind, _, message) in whole.into_iter().filter(|(_, their, _)| *their == seq) {
        if kind == libc::NLMSG_ERROR as u16 {
            return Some(Err(io::Error::from_raw_os_error(-errno(message))));
        }
        if kind != newgen {
            continue;
        }
        let half = |b: &[u8], at: usize| -> Option<u16> { Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?)) };
        let mut attrs = message.get(NLMSG_HEADER + NFGEN_HEADER..).unwrap_or_default();
        while attrs.len() >= 4 {
            let (Some(alen), Some(atype)) = (half(attrs, 0), half(attrs, 2)) else { break };
            let alen = alen as usize;
            if alen < 4 || alen > attrs.len() {
                break;
            }
            if atype & 0x3fff == NFTA_GEN_ID && alen >= 8 {
                return Some(Ok(u32::from_be_bytes(attrs[4..8].try_into().expect("four bytes"))));
            }
            attrs = &attrs[alen.next_multiple_of(4).min(attrs.len())..];
        }
        return Some(Err(io::Error::other("the kernel's answer to NFT_MSG_GETGEN holds no generation")));
    }
    cut.then(|| Err(io::Error::other("the kernel's answer to NFT_MSG_GETGEN is cut short")))
}

/// The error an `NLMSG_ERROR` message carries (0: an acknowledgement).
fn errno(message: &[u8]) -> i32 {
    message.get(NLMSG_HEADER..NLMSG_HEADER + 4).map_or(0, |e| i32::from_ne_bytes(e.try_into().expect("four bytes")))
}

/// The generation the kernel's next commit gives, after `g` (it skips 0).
pub fn following(g: u32) -> u32 {
    match g.wrapping_add(1) {
        0 => 1,
        n => n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A commit moves the generation by exactly one; reading it commits nothing.
    #[test]
    fn a_commit_moves_the_generation_by_one() {
        use trellis_testing::{can_run, Need};
        if !can_run(Need::Root) || !can_run(Need::Program("nft")) {
            return;
        }
        let ns = format!("trellis-gen-{}", std::process::id());
        let ip = |args: &[&str]| std::process::Command::new("ip").args(args).output().unwrap();
        assert!(ip(&["netns", "add", &ns]).status.success());
        struct Gone(String);
        impl Drop for Gone {
            fn drop(&mut self) {
                let _ = std::process::Command::new("ip").args(["netns", "del", &self.0]).output();
            }
        }
        let _gone = Gone(ns.clone());
        let mut g = Generation::in_namespace(&ns).unwrap();
        let before = g.read().unwrap();
        assert_eq!(g.read().unwrap(), before, "reading commits nothing");
        let out = ip(&["netns", "exec", &ns, "nft", "add", "table", "inet", "gen"]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(g.read().unwrap(), following(before));
        assert_eq!(following(u32::MAX), 1);
    }
}

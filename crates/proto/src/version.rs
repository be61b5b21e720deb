//! The node protocol's version (issue 21, item 3). Every node request says the protocol it
//! speaks, `Trellis-Protocol: MAJOR.MINOR`, and the agent's release, `Trellis-Agent: 0.1.0`. A
//! controller refuses a major it does not speak, naming the node and both versions; within a
//! major, either side ignores what it does not know. A request without the header is from an
//! agent older than the header, which spoke 1.0.

/// The protocol this release speaks.
pub const PROTOCOL: Protocol = Protocol { major: 1, minor: 0 };

/// The request header that carries the protocol.
pub const PROTOCOL_HEADER: &str = "trellis-protocol";
/// The request header that carries the agent's release.
pub const AGENT_HEADER: &str = "trellis-agent";
/// The request header that carries the node's clock, in Unix seconds, so that the controller
/// can refuse a node whose clock is too far from its own, saying by how much.
pub const TIME_HEADER: &str = "trellis-time";
/// How far apart, in seconds, a node's clock and the controller's may be: enrolment, renewal
/// and freshness work within it (certificates start this long before they are issued), and
/// further apart is refused, naming the skew.
pub const MAX_SKEW_SECS: i64 = 300;
/// The longest release a node may name.
pub const MAX_RELEASE: usize = 64;

/// A protocol version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Protocol {
    pub major: u16,
    pub minor: u16,
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl std::str::FromStr for Protocol {
    type Err = String;

    fn from_str(s: &str) -> Result<Protocol, String> {
        let number = |n: &str| (!n.is_empty() && n.len() <= 5 && n.bytes().all(|b| b.is_ascii_digit())).then(|| n.parse().ok()).flatten();
        match s.split_once('.') {
            Some((major, minor)) => match (number(major), number(minor)) {
                (Some(major), Some(minor)) => Ok(Protocol { major, minor }),
                _ => Err(format!("`{}` is not a protocol version (MAJOR.MINOR)", crate::text::printable(s))),
            },
            None => Err(format!("`{}` is not a protocol version (MAJOR.MINOR)", crate::text::printable(s))),
        }
    }
}

/// Whether a release names a version plainly: at most [`MAX_RELEASE`] characters of letters,
/// digits and `.-+~_`.
pub fn plain_release(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_RELEASE && s.bytes().all(|b| b.is_ascii_alphanumeric() || b".-+~_".contains(&b))
}

/// How far `theirs` is from `ours`, in words: "7 min 12 s ahead of", "42 s behind".
pub fn skew_words(theirs: i64, ours: i64) -> String {
    let d = theirs.saturating_sub(ours);
    let a = d.unsigned_abs();
    let amount = match (a / 60, a % 60) {
        (0, s) => format!("{s} s"),
        (m, 0) => format!("{m} min"),
        (m, s) => format!("{m} min {s} s"),
    };
    let way = if d >= 0 { "ahead of" } else { "behind" };
    format!("{amount} {way}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_back_and_anything_else_is_refused() {
        assert_eq!("1.0".parse::<Protocol>(), Ok(PROTOCOL));
        assert_eq!("2.17".parse::<Protocol>(), Ok(Protocol { major: 2, minor: 17 }));
        assert_eq!(PROTOCOL.to_string(), "1.0");
        for bad in ["", "1", "1.", ".1", "1.0.0", "a.b", "-1.0", "1.-0", "999999.0", " 1.0"] {
            assert!(bad.parse::<Protocol>().is_err(), "{bad:?}");
        }
        assert!(plain_release("0.1.0") && plain_release("1.2.3-rc.1+g0a1b2c"));
        assert_eq!(skew_words(1_000 + 432, 1_000), "7 min 12 s ahead of");
        assert_eq!(skew_words(1_000 - 42, 1_000), "42 s behind");
        assert_eq!(skew_words(1_000 - 360, 1_000), "6 min behind");
        assert!(!plain_release("") && !plain_release("0.1 0") && !plain_release("0.1\u{1b}[2J") && !plain_release(&"9".repeat(65)));
    }
}

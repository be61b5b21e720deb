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
        assert!(!plain_release("") && !plain_release("0.1 0") && !plain_release("0.1\u{1b}[2J") && !plain_release(&"9".repeat(65)));
    }
}

//! The enrolment token: one line a person pastes on a new node. It carries where the controller
//! is, the SHA-256 fingerprint of the mesh CA, a one-time secret, the node name and the expiry,
//! with a checksum so that a damaged paste is caught before any network traffic (ADR 0002).
//!
//! Text form: `trellis1.` followed by unpadded base64url of
//! `version(1) | count(1) | count × (len(1) | "host:port") | ca_sha256(32) | id(8) |
//!  secret(24) | len(1) | node | expires_unix(8, big endian) | sha256(all before)[..4]`.

use base64::Engine;
use sha2::{Digest, Sha256};

pub const PREFIX: &str = "trellis1.";
pub const MAX_LEN: usize = 400;
const VERSION: u8 = 1;

#[derive(Clone, PartialEq, Eq)]
pub struct EnrolmentToken {
    pub controllers: Vec<String>,
    pub ca_fingerprint: [u8; 32],
    /// Names the token in the controller's records; not secret.
    pub id: [u8; 8],
    /// 192 bits; stored only hashed by the controller.
    pub secret: [u8; 24],
    pub node: String,
    /// Unix seconds.
    pub expires: u64,
}

impl std::fmt::Debug for EnrolmentToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnrolmentToken")
            .field("controllers", &self.controllers)
            .field("id", &hex(&self.id))
            .field("node", &self.node)
            .field("expires", &self.expires)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum TokenError {
    /// Not a trellis token at all.
    NotAToken,
    /// The right shape, but bytes were lost or changed on the way.
    Damaged,
    /// A newer token format than this program knows.
    UnknownVersion(u8),
    /// The token would not fit on one pasteable line.
    TooLong(usize),
    /// A field cannot be encoded (empty or too long).
    Invalid(&'static str),
}

impl std::fmt::Display for TokenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenError::NotAToken => write!(f, "this is not a trellis enrolment token (it should start with `{PREFIX}`)"),
            TokenError::Damaged => f.write_str("token is damaged: its checksum does not match; copy it again, as one line"),
            TokenError::UnknownVersion(v) => {
                write!(f, "token format version {v} is newer than this agent understands; upgrade trellis-agent")
            }
            TokenError::TooLong(n) => {
                write!(f, "token would be {n} characters, over the limit of {MAX_LEN}; advertise fewer or shorter controller addresses")
            }
            TokenError::Invalid(what) => write!(f, "token cannot carry this {what}"),
        }
    }
}

impl std::error::Error for TokenError {}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The text form of a payload (everything before the checksum): the prefix and the base64 of
/// the payload with its checksum. Checks nothing: `encode` checks the fields first, and
/// `decode` reads any text back with every check.
pub fn text(payload: &[u8]) -> String {
    let mut b = payload.to_vec();
    b.extend_from_slice(&Sha256::digest(payload)[..4]);
    format!("{PREFIX}{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&b))
}

impl EnrolmentToken {
    /// The fields as the format lays them out, before the checksum; unchecked (see [`text`]).
    fn payload(&self) -> Vec<u8> {
        let mut b = vec![VERSION, self.controllers.len() as u8];
        for c in &self.controllers {
            b.push(c.len() as u8);
            b.extend_from_slice(c.as_bytes());
        }
        b.extend_from_slice(&self.ca_fingerprint);
        b.extend_from_slice(&self.id);
        b.extend_from_slice(&self.secret);
        b.push(self.node.len() as u8);
        b.extend_from_slice(self.node.as_bytes());
        b.extend_from_slice(&self.expires.to_be_bytes());
        b
    }

    /// Whether the fields fit the format: 1 to 8 controller addresses of 1 to 255 bytes, a node
    /// name of 1 to 63. Checked when encoding and again when decoding, so that a token whose
    /// checksum was made to match (it is no MAC) cannot carry what trellis never issues.
    fn fits(&self) -> Result<(), TokenError> {
        if self.controllers.is_empty() || self.controllers.len() > 8 {
            return Err(TokenError::Invalid("number of controller addresses (1 to 8)"));
        }
        if self.controllers.iter().any(|c| c.is_empty() || c.len() > 255) {
            return Err(TokenError::Invalid("controller address"));
        }
        if self.node.is_empty() || self.node.len() > 63 {
            return Err(TokenError::Invalid("node name"));
        }
        Ok(())
    }

    pub fn encode(&self) -> Result<String, TokenError> {
        self.fits()?;
        let text = text(&self.payload());
        if text.len() > MAX_LEN {
            return Err(TokenError::TooLong(text.len()));
        }
        Ok(text)
    }

    /// Parses a pasted token. Surrounding whitespace is forgiven; anything else that differs from
    /// what was issued is `Damaged`.
    pub fn decode(text: &str) -> Result<EnrolmentToken, TokenError> {
        let text = text.trim();
        let Some(body) = text.strip_prefix(PREFIX) else {
            return Err(if text.starts_with("trellis") { TokenError::Damaged } else { TokenError::NotAToken });
        };
        if text.len() > MAX_LEN {
            return Err(TokenError::Damaged);
        }
        let b = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(body).map_err(|_| TokenError::Damaged)?;
        if b.len() < 5 {
            return Err(TokenError::Damaged);
        }
        let (payload, sum) = b.split_at(b.len() - 4);
        if Sha256::digest(payload)[..4] != *sum {
            return Err(TokenError::Damaged);
        }
        if payload[0] != VERSION {
            return Err(TokenError::UnknownVersion(payload[0]));
        }
        let mut r = Reader { b: &payload[1..] };
        let n = r.u8()?;
        let mut controllers = Vec::new();
        for _ in 0..n {
            let len = r.u8()? as usize;
            controllers.push(String::from_utf8(r.take(len)?.to_vec()).map_err(|_| TokenError::Damaged)?);
        }
        let ca_fingerprint = r.take(32)?.try_into().expect("32");
        let id = r.take(8)?.try_into().expect("8");
        let secret = r.take(24)?.try_into().expect("24");
        let len = r.u8()? as usize;
        let node = String::from_utf8(r.take(len)?.to_vec()).map_err(|_| TokenError::Damaged)?;
        let expires = u64::from_be_bytes(r.take(8)?.try_into().expect("8"));
        if !r.b.is_empty() {
            return Err(TokenError::Damaged);
        }
        let token = EnrolmentToken { controllers, ca_fingerprint, id, secret, node, expires };
        token.fits()?;
        Ok(token)
    }
}

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], TokenError> {
        if self.b.len() < n {
            return Err(TokenError::Damaged);
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }

    fn u8(&mut self) -> Result<u8, TokenError> {
        Ok(self.take(1)?[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> EnrolmentToken {
        EnrolmentToken {
            controllers: vec!["198.51.100.2:8443".into(), "[2001:db8::2]:8443".into()],
            ca_fingerprint: [7; 32],
            id: [1, 2, 3, 4, 5, 6, 7, 8],
            secret: [9; 24],
            node: "db-1".into(),
            expires: 1_900_000_000,
        }
    }

    #[test]
    fn round_trips_on_one_short_line() {
        let t = sample();
        let s = t.encode().unwrap();
        assert!(s.len() <= MAX_LEN && !s.contains(char::is_whitespace), "{s}");
        assert_eq!(EnrolmentToken::decode(&format!("  {s}\n")).unwrap(), t);
    }

    #[test]
    fn any_changed_or_lost_character_is_damage() {
        let s = sample().encode().unwrap();
        for i in PREFIX.len()..s.len() {
            let mut chars: Vec<char> = s.chars().collect();
            chars[i] = if chars[i] == 'A' { 'B' } else { 'A' };
            let changed: String = chars.iter().collect();
            assert_eq!(EnrolmentToken::decode(&changed), Err(TokenError::Damaged), "changed at {i}");
            let mut cut = s.clone();
            cut.remove(i);
            assert!(EnrolmentToken::decode(&cut).is_err(), "cut at {i}");
        }
        assert_eq!(EnrolmentToken::decode(&s[..s.len() - 1]), Err(TokenError::Damaged));
        assert_eq!(EnrolmentToken::decode("hello"), Err(TokenError::NotAToken));
    }

    /// Found by the `token` fuzz target: the checksum is no MAC, so a token with a matching one
    /// can be made by hand; decoding accepted an empty node name (and too many or empty
    /// controller addresses) that `encode` refuses, so a token read could not be written back.
    #[test]
    fn a_token_encode_would_refuse_is_refused_when_read() {
        let cases = [
            (EnrolmentToken { node: String::new(), ..sample() }, "node name"),
            (EnrolmentToken { node: "n".repeat(64), ..sample() }, "node name"),
            (EnrolmentToken { controllers: vec!["c:1".into(); 9], ..sample() }, "number of controller addresses (1 to 8)"),
            (EnrolmentToken { controllers: vec![String::new()], ..sample() }, "controller address"),
        ];
        for (t, what) in cases {
            assert_eq!(t.encode(), Err(TokenError::Invalid(what)));
            assert_eq!(EnrolmentToken::decode(&text(&t.payload())), Err(TokenError::Invalid(what)), "{t:?}");
        }
        assert_eq!(EnrolmentToken::decode(&text(&sample().payload())), Ok(sample()));
    }

    #[test]
    fn the_debug_form_hides_the_secret() {
        assert!(!format!("{:?}", sample()).contains("9, 9"));
    }
}

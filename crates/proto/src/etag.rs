//! A bundle's ETag: its version and the start of its content digest, so that two bundles with
//! the same number and other content (a controller restored from a backup numbers again what it
//! had numbered before) are never taken for each other: `"7.0123456789abcdef"`. A node sends the
//! tag of what it holds as `If-None-Match`; an older agent's `"7"` (the version alone) is read too.

/// The largest version a tag may name: a node that claims to hold more is not believed (a
/// restored controller numbers its bundles past what a node holds, and must not be led to
/// overflow).
pub const MAX_VERSION: i64 = 1 << 53;

/// Bytes of the content digest a tag carries: enough that two contents under one number are
/// told apart, short enough for a header.
const DIGEST_BYTES: usize = 8;

/// What a bundle's ETag names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BundleTag {
    pub version: i64,
    /// The first bytes of the bundle's content digest (`trellis_core::bundle::content_digest`);
    /// `None` in a tag from an agent that sends the version alone.
    pub digest: Option<[u8; DIGEST_BYTES]>,
}

impl BundleTag {
    /// The tag of a bundle of this version and content digest.
    pub fn new(version: i64, content_digest: &[u8; 32]) -> BundleTag {
        let mut d = [0; DIGEST_BYTES];
        d.copy_from_slice(&content_digest[..DIGEST_BYTES]);
        BundleTag { version, digest: Some(d) }
    }

    /// The tag as an ETag header's value, quoted.
    pub fn etag(&self) -> String {
        match &self.digest {
            Some(d) => format!("\"{}.{}\"", self.version, hex::encode(d)),
            None => format!("\"{}\"", self.version),
        }
    }

    /// Reads an ETag (or `If-None-Match`) value written by [`BundleTag::etag`]; anything else,
    /// a version below 1 or above [`MAX_VERSION`] included, is `None`.
    pub fn parse(text: &str) -> Option<BundleTag> {
        let inner = text.trim().strip_prefix('"')?.strip_suffix('"')?;
        let (version, digest) = match inner.split_once('.') {
            Some((v, d)) => (v, Some(d)),
            None => (inner, None),
        };
        if version.is_empty() || !version.bytes().all(|b| b.is_ascii_digit()) || version.len() > 16 {
            return None;
        }
        let version: i64 = version.parse().ok()?;
        if !(1..=MAX_VERSION).contains(&version) {
            return None;
        }
        let digest = match digest {
            None => None,
            Some(d) if d.len() == 2 * DIGEST_BYTES && d.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) => {
                Some(hex::decode(d).ok()?.try_into().ok()?)
            }
            Some(_) => return None,
        };
        Some(BundleTag { version, digest })
    }

    /// Whether this tag names the bundle of `version` with `content_digest`: the same version,
    /// and the same content when the tag says its content.
    pub fn names(&self, version: i64, content_digest: &[u8; 32]) -> bool {
        self.version == version && self.digest.is_none_or(|d| d[..] == content_digest[..DIGEST_BYTES])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tag_reads_back_and_names_its_content() {
        let digest = [0xab; 32];
        let tag = BundleTag::new(7, &digest);
        assert_eq!(tag.etag(), "\"7.abababababababab\"");
        assert_eq!(BundleTag::parse(&tag.etag()), Some(tag));
        assert!(tag.names(7, &digest));
        assert!(!tag.names(7, &[0xac; 32]), "the same number, other content");
        assert!(!tag.names(8, &digest));
        // An older agent's tag: the version alone.
        let old = BundleTag::parse("\"7\"").unwrap();
        assert_eq!(old, BundleTag { version: 7, digest: None });
        assert!(old.names(7, &[0xac; 32]));
    }

    #[test]
    fn anything_else_is_no_tag() {
        for bad in [
            "7",
            "\"\"",
            "\"0\"",
            "\"-3\"",
            "\"+3\"",
            "\"9007199254740993\"",
            "\"99999999999999999999\"",
            "\"7.\"",
            "\"7.ABABABABABABABAB\"",
            "\"7.abab\"",
            "\"7.abababababababab.1\"",
            "W/\"7\"",
        ] {
            assert_eq!(BundleTag::parse(bad), None, "{bad}");
        }
        assert_eq!(BundleTag::parse(&format!("\"{MAX_VERSION}\"")).map(|t| t.version), Some(MAX_VERSION));
    }
}

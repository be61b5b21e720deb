//! An agent's release as a version that orders (`MAJOR.MINOR.PATCH[-PRE][+BUILD]`, Semantic
//! Versioning 2.0's precedence), so that `[mesh] min_agent_version` can refuse older agents.

use std::cmp::Ordering;

/// A release: three numbers, an optional pre-release (which orders before the release itself)
/// and build metadata (which does not order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Release {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
    /// The dot-separated identifiers after `-`; empty for a release.
    pub pre: Vec<String>,
}

impl std::str::FromStr for Release {
    type Err = String;

    fn from_str(s: &str) -> Result<Release, String> {
        let bad = || format!("{s:?} is not a release (MAJOR.MINOR.PATCH, such as \"0.2.0\" or \"1.0.0-rc.1\")");
        let s_core = s.split_once('+').map_or(s, |(c, build)| if build.is_empty() { "" } else { c });
        let (numbers, pre) = match s_core.split_once('-') {
            Some((n, p)) => (n, Some(p)),
            None => (s_core, None),
        };
        let number = |n: &str| {
            (!n.is_empty() && n.len() <= 19 && n.bytes().all(|b| b.is_ascii_digit()) && (n == "0" || !n.starts_with('0')))
                .then(|| n.parse::<u64>().ok())
                .flatten()
        };
        let parts: Vec<&str> = numbers.split('.').collect();
        let [major, minor, patch] = parts.as_slice() else { return Err(bad()) };
        let (Some(major), Some(minor), Some(patch)) = (number(major), number(minor), number(patch)) else { return Err(bad()) };
        let pre = match pre {
            None => Vec::new(),
            Some(p) => {
                let ids: Vec<String> = p.split('.').map(str::to_string).collect();
                if ids.iter().any(|i| i.is_empty() || !i.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')) {
                    return Err(bad());
                }
                ids
            }
        };
        Ok(Release { major, minor, patch, pre })
    }
}

impl std::fmt::Display for Release {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)?;
        if !self.pre.is_empty() {
            write!(f, "-{}", self.pre.join("."))?;
        }
        Ok(())
    }
}

impl Ord for Release {
    fn cmp(&self, other: &Release) -> Ordering {
        (self.major, self.minor, self.patch).cmp(&(other.major, other.minor, other.patch)).then_with(|| {
            match (self.pre.is_empty(), other.pre.is_empty()) {
                (true, true) => Ordering::Equal,
                // A pre-release comes before its release.
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                (false, false) => {
                    for (a, b) in self.pre.iter().zip(&other.pre) {
                        let o = match (a.parse::<u64>(), b.parse::<u64>()) {
                            (Ok(x), Ok(y)) => x.cmp(&y),
                            (Ok(_), Err(_)) => Ordering::Less,
                            (Err(_), Ok(_)) => Ordering::Greater,
                            (Err(_), Err(_)) => a.cmp(b),
                        };
                        if o != Ordering::Equal {
                            return o;
                        }
                    }
                    self.pre.len().cmp(&other.pre.len())
                }
            }
        })
    }
}

impl PartialOrd for Release {
    fn partial_cmp(&self, other: &Release) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

#[cfg(test)]
mod tests {
    use super::Release;

    fn r(s: &str) -> Release {
        s.parse().unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn releases_order_as_semantic_versioning_says() {
        let ordered = [
            "0.1.0",
            "0.1.1",
            "0.2.0-alpha",
            "0.2.0-alpha.1",
            "0.2.0-alpha.beta",
            "0.2.0-beta.2",
            "0.2.0-beta.11",
            "0.2.0",
            "0.10.0",
            "1.0.0",
        ];
        for pair in ordered.windows(2) {
            assert!(r(pair[0]) < r(pair[1]), "{} < {}", pair[0], pair[1]);
        }
        assert_eq!(r("1.2.3+g0a1b2c").cmp(&r("1.2.3")), std::cmp::Ordering::Equal, "build metadata does not order");
        assert_eq!(r("1.2.3-rc.1+g0a1b2c").to_string(), "1.2.3-rc.1");
        for bad in ["", "1", "1.2", "1.2.3.4", "01.2.3", "1.2.x", "1.2.3-", "1.2.3-a..b", "1.2.3+", "unknown", " 1.2.3", "1.2.3-é"] {
            assert!(bad.parse::<Release>().is_err(), "{bad:?}");
        }
    }
}

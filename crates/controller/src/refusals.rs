//! Refused redemptions, counted per source address. Enrolment is the one decision an
//! unauthenticated caller can ask for, and every refusal is audited; so that a caller cannot grow
//! the audit chain (or make the controller read the database) as fast as it can send, each source
//! gets a window: its first refusals are audited one by one, the next ones are only counted, and
//! past a limit it is turned away before anything is looked up. When the window closes, what was
//! counted is written as one record. IPv6 sources count by /64, the block one host usually holds;
//! past a bound on the sources tracked, the rest share one count. A node's refused service
//! certificates are counted the same way, by node (`Refusals<String>`), and `Budget` holds what a
//! node may have done in a window (certificates issued, renewals) to a number.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;

/// How refused redemptions are counted.
#[derive(Clone, Copy, Debug)]
pub struct RefusalLimits {
    /// The length of a source's window, in seconds.
    pub window_secs: i64,
    /// Refusals audited one by one in a window.
    pub audited: u32,
    /// Refusals in a window after which the source is turned away until the window closes.
    pub turn_away_after: u32,
    /// Sources counted apart; the rest share one count.
    pub sources: usize,
}

impl Default for RefusalLimits {
    fn default() -> Self {
        RefusalLimits { window_secs: 60, audited: 5, turn_away_after: 30, sources: 10_000 }
    }
}

/// Who a refusal is counted against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    V4(std::net::Ipv4Addr),
    /// The /64 the address is in.
    V6(u64),
    /// A request that came from no known address (in process), or any source once the table is
    /// full.
    Other,
}

impl Source {
    pub fn of(addr: Option<IpAddr>) -> Source {
        match addr.map(|a| a.to_canonical()) {
            Some(IpAddr::V4(a)) => Source::V4(a),
            Some(IpAddr::V6(a)) => Source::V6((u128::from(a) >> 64) as u64),
            None => Source::Other,
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::V4(a) => write!(f, "{a}"),
            Source::V6(p) => write!(f, "{}/64", std::net::Ipv6Addr::from(u128::from(*p) << 64)),
            Source::Other => f.write_str("other sources"),
        }
    }
}

/// What refusals are counted by: a source address, or a node's name.
pub trait Key: Clone + Eq + std::hash::Hash {
    /// The key every other asker shares once the table is full.
    fn other() -> Self;
}

impl Key for Source {
    fn other() -> Self {
        Source::Other
    }
}

/// A node's name; the empty name is every node the table has no room for.
impl Key for String {
    fn other() -> Self {
        String::new()
    }
}

/// One source's window.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub start: i64,
    /// Every refusal in the window, audited or not.
    pub refused: u32,
    /// Of those, the ones turned away before anything was looked up.
    pub turned_away: u32,
    /// The reason of the newest refusal that was not audited by itself.
    pub last_reason: String,
}

/// What to do with a refusal.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Audit it by itself.
    Audit,
    /// Count it, to be written with the window.
    Count,
}

pub struct Refusals<K = Source> {
    limits: RefusalLimits,
    inner: Mutex<Inner<K>>,
}

struct Inner<K> {
    windows: HashMap<K, Window>,
    /// Closed windows with counted refusals, waiting to be written.
    closed: Vec<(K, Window)>,
}

impl<K: Key> Inner<K> {
    fn key(&self, source: K, bound: usize) -> K {
        if self.windows.contains_key(&source) || self.windows.len() < bound {
            source
        } else {
            K::other()
        }
    }
}

impl<K: Key> Refusals<K> {
    pub fn new(limits: RefusalLimits) -> Refusals<K> {
        Refusals { limits, inner: Mutex::new(Inner { windows: HashMap::new(), closed: Vec::new() }) }
    }

    /// Before a redemption is read: `Err(seconds)` when its source is over the limit and must wait
    /// that long (the turning away is counted).
    pub fn admit(&self, source: K, now: i64) -> Result<(), i64> {
        let mut inner = self.inner.lock().expect("refusals");
        let key = inner.key(source, self.limits.sources);
        match inner.windows.get_mut(&key) {
            Some(w) if now < w.start + self.limits.window_secs && w.refused >= self.limits.turn_away_after => {
                w.refused = w.refused.saturating_add(1);
                w.turned_away = w.turned_away.saturating_add(1);
                Err((w.start + self.limits.window_secs - now).max(1))
            }
            _ => Ok(()),
        }
    }

    /// A refusal from `source`: whether to audit it now or count it with its window. A window
    /// that has closed is left for [`Refusals::closed`] to collect; the refusal opens a new one.
    pub fn refused(&self, source: K, now: i64, reason: &str) -> Verdict {
        let mut inner = self.inner.lock().expect("refusals");
        let key = inner.key(source, self.limits.sources);
        let (span, audited) = (self.limits.window_secs, self.limits.audited);
        let w = inner.windows.entry(key.clone()).or_insert_with(|| Window { start: now, ..Window::default() });
        let mut closed = None;
        if now >= w.start + span {
            let old = std::mem::replace(w, Window { start: now, ..Window::default() });
            closed = (old.refused > audited).then_some(old);
        }
        w.refused = w.refused.saturating_add(1);
        let verdict = if w.refused <= audited {
            Verdict::Audit
        } else {
            w.last_reason = reason.to_string();
            Verdict::Count
        };
        if let Some(old) = closed {
            inner.closed.push((key, old));
        }
        verdict
    }

    /// Windows that closed with refusals that were not audited one by one, taken out to be
    /// written as one record each; closed windows with nothing to write are forgotten.
    pub fn closed(&self, now: i64) -> Vec<(K, Window)> {
        let mut inner = self.inner.lock().expect("refusals");
        let mut out = std::mem::take(&mut inner.closed);
        let (span, audited) = (self.limits.window_secs, self.limits.audited);
        inner.windows.retain(|source, w| {
            if now < w.start + span {
                return true;
            }
            if w.refused > audited {
                out.push((source.clone(), std::mem::take(w)));
            }
            false
        });
        out
    }

    pub fn limits(&self) -> RefusalLimits {
        self.limits
    }
}

/// At most `max` of something per key (a node, a node's module) in each window (of a length
/// each key's asker gives, from the lifetime of what it asks for): what a node may ask of the controller that writes the audit chain when it is
/// granted (a service certificate issued, its own renewed) is held to a rate, so that no node can
/// grow the chain as fast as it can send.
pub struct Budget {
    max: u32,
    /// Per key: when its window started, how long it is, and how many were taken in it.
    used: Mutex<HashMap<String, (i64, i64, u32)>>,
}

impl Budget {
    pub fn new(max: u32) -> Budget {
        Budget { max, used: Mutex::new(HashMap::new()) }
    }

    /// Takes one for `key` at `now`, in a window of `window_secs`, or says in how many seconds
    /// one is free again.
    pub fn take(&self, key: &str, now: i64, window_secs: i64) -> Result<(), i64> {
        let mut used = self.used.lock().expect("budget");
        if used.len() > 100_000 {
            // Only keys whose window is open matter.
            used.retain(|_, (start, span, _)| now < *start + *span);
        }
        let e = used.entry(key.to_string()).or_insert((now, window_secs, 0));
        if now >= e.0 + e.1 {
            *e = (now, window_secs, 0);
        }
        if e.2 >= self.max {
            return Err((e.0 + e.1 - now).max(1));
        }
        e.2 += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 1)));

    #[test]
    fn a_source_is_audited_then_counted_then_turned_away_and_its_window_written_once() {
        let r = Refusals::new(RefusalLimits { window_secs: 60, audited: 2, turn_away_after: 4, sources: 10 });
        let a = Source::of(A);
        let mut verdicts = Vec::new();
        for i in 0..10 {
            match r.admit(a, 100 + i) {
                Ok(()) => verdicts.push(r.refused(a, 100 + i, &format!("reason {i}"))),
                Err(wait) => assert_eq!(wait, 60 - i, "turned away until the window closes"),
            }
        }
        assert_eq!(verdicts, vec![Verdict::Audit, Verdict::Audit, Verdict::Count, Verdict::Count]);
        // Another source is not affected.
        let b = Source::of(Some("2001:db8:1:2::7".parse().unwrap()));
        assert_eq!(b, Source::of(Some("2001:db8:1:2:ffff::1".parse().unwrap())), "one /64, one source");
        assert_eq!(b.to_string(), "2001:db8:1:2::/64");
        assert_eq!(r.refused(b, 105, "x"), Verdict::Audit);
        assert!(r.closed(159).is_empty(), "the window is still open");
        let closed = r.closed(160);
        assert_eq!(closed.len(), 1, "b's window audited everything it refused: nothing to write");
        let (src, w) = &closed[0];
        assert_eq!((*src, w.refused, w.turned_away, w.last_reason.as_str()), (a, 10, 6, "reason 3"));
        assert!(r.closed(1000).is_empty(), "written once");
        assert_eq!(r.admit(a, 161), Ok(()), "a new window");
    }

    #[test]
    fn a_refusal_after_the_window_keeps_the_closed_count_and_opens_a_new_window() {
        let r = Refusals::new(RefusalLimits { window_secs: 10, audited: 1, turn_away_after: 100, sources: 10 });
        let a = Source::of(A);
        assert_eq!(r.refused(a, 0, "x"), Verdict::Audit);
        assert_eq!(r.refused(a, 1, "y"), Verdict::Count);
        assert_eq!(r.refused(a, 11, "z"), Verdict::Audit, "a new window");
        let closed = r.closed(12);
        assert_eq!(closed.len(), 1);
        assert_eq!((closed[0].1.start, closed[0].1.refused), (0, 2));
    }

    #[test]
    fn a_budget_grants_its_number_in_a_window_then_says_when_one_is_free() {
        let b = Budget::new(2);
        assert_eq!((b.take("db-1", 100, 60), b.take("db-1", 101, 60), b.take("db-1", 130, 60)), (Ok(()), Ok(()), Err(30)));
        assert_eq!(b.take("api-1", 130, 60), Ok(()), "another key is not affected");
        assert_eq!(b.take("db-1", 160, 60), Ok(()), "a new window");
    }

    #[test]
    fn nodes_are_counted_by_name() {
        let r: Refusals<String> = Refusals::new(RefusalLimits { window_secs: 60, audited: 1, turn_away_after: 2, sources: 10 });
        assert_eq!(r.refused("db-1".into(), 0, "x"), Verdict::Audit);
        assert_eq!(r.refused("db-1".into(), 1, "y"), Verdict::Count);
        assert_eq!(r.admit("db-1".into(), 2), Err(58));
        assert_eq!(r.admit("api-1".into(), 2), Ok(()));
    }

    #[test]
    fn past_the_bound_on_sources_the_rest_share_one_count() {
        let r = Refusals::new(RefusalLimits { window_secs: 60, audited: 1, turn_away_after: 3, sources: 2 });
        for i in 1..=2u8 {
            r.refused(Source::of(Some(IpAddr::V4([10, 0, 0, i].into()))), 0, "x");
        }
        let mut turned_away = 0;
        for i in 3..=50u8 {
            let s = Source::of(Some(IpAddr::V4([10, 0, 0, i].into())));
            match r.admit(s, 1) {
                Ok(()) => {
                    r.refused(s, 1, "x");
                }
                Err(_) => turned_away += 1,
            }
        }
        assert_eq!(turned_away, 45, "48 new sources share one window: 3 refused, the rest turned away");
        let closed = r.closed(61);
        assert!(closed.iter().any(|(s, w)| *s == Source::Other && w.refused == 48), "{closed:?}");
    }
}

//! The WireGuard public keys the compiler is given, by node name. The set remembers which names
//! it changed, in order, so that a recompile reads only the names changed since the compile
//! before it, not every key of the mesh: what a change costs stays with what it changes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::decl::PublicKey;

/// Numbers each change and each new set, unique in the process: a recompile knows a set's history
/// by them.
static NEXT: AtomicU64 = AtomicU64::new(1);

fn next() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// How many changes a set remembers before it forgets the oldest half; a compile that read the
/// set before the forgotten ones reads every key again.
const REMEMBERED: usize = 4096;

/// Keys by node name, and the names changed since the set was made.
#[derive(Clone, Debug)]
pub struct Keys {
    /// Each name's key, and the number of the last `replace` that gave it.
    map: crate::FastMap<String, (PublicKey, u64)>,
    /// The number of the last `replace`.
    replaced: u64,
    /// The set this one continues: a clone keeps it, a new set takes a new one.
    origin: u64,
    /// The names set or removed, oldest first, each with its number.
    changes: Vec<(u64, Arc<str>)>,
    /// How many changes were forgotten before `changes[0]`.
    forgotten: usize,
    /// The nodes withdrawn from the mesh for good (revoked): their names leave every zone
    /// (ADR 0015). Shared, so that a compile keeps the set it read and compares it cheaply.
    withdrawn: Arc<std::collections::BTreeSet<String>>,
}

/// Where a reader of a set stood: the set it read, and how many of its changes it had seen (the
/// last one's number, to tell a continuation from a clone that changed another way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeysSeen {
    origin: u64,
    count: usize,
    last: u64,
}

impl Default for Keys {
    fn default() -> Keys {
        Keys::from(HashMap::new())
    }
}

impl From<HashMap<String, PublicKey>> for Keys {
    fn from(map: HashMap<String, PublicKey>) -> Keys {
        map.into_iter().collect()
    }
}

impl FromIterator<(String, PublicKey)> for Keys {
    fn from_iter<I: IntoIterator<Item = (String, PublicKey)>>(iter: I) -> Keys {
        Keys {
            map: iter.into_iter().map(|(n, k)| (n, (k, 0))).collect(),
            replaced: 0,
            origin: next(),
            changes: Vec::new(),
            forgotten: 0,
            withdrawn: Arc::default(),
        }
    }
}

impl PartialEq for Keys {
    fn eq(&self, other: &Keys) -> bool {
        self.map.len() == other.map.len()
            && self.map.iter().all(|(n, (k, _))| other.get(n) == Some(*k))
            && self.withdrawn == other.withdrawn
    }
}

impl Eq for Keys {}

impl Keys {
    pub fn get(&self, name: &str) -> Option<PublicKey> {
        self.map.get(name).map(|v| v.0)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &PublicKey)> {
        self.map.iter().map(|(n, (k, _))| (n.as_str(), k))
    }

    /// Whether `name` was withdrawn from the mesh for good (a revoked node).
    pub fn is_withdrawn(&self, name: &str) -> bool {
        self.withdrawn.contains(name)
    }

    /// The names withdrawn from the mesh, shared: equal sets compare equal, the same set by
    /// pointer at once.
    pub fn withdrawn(&self) -> &Arc<std::collections::BTreeSet<String>> {
        &self.withdrawn
    }

    /// Makes the withdrawn names exactly these (a revoked node's names leave every zone); the
    /// set is replaced only when it changed, so a compile that read it sees it as the same.
    pub fn withdraw_only<'a>(&mut self, names: impl IntoIterator<Item = &'a str>) {
        let now: std::collections::BTreeSet<String> = names.into_iter().map(str::to_string).collect();
        if *self.withdrawn != now {
            self.withdrawn = Arc::new(now);
        }
    }

    /// Gives `name` this key, or none; whether that changed the set.
    pub fn set(&mut self, name: &str, key: Option<PublicKey>) -> bool {
        let changed = match key {
            Some(k) => match self.map.get_mut(name) {
                Some(old) => {
                    old.1 = self.replaced;
                    std::mem::replace(&mut old.0, k) != k
                }
                None => {
                    self.map.insert(name.to_string(), (k, self.replaced));
                    true
                }
            },
            None => self.map.remove(name).is_some(),
        };
        if changed {
            self.note(name);
        }
        changed
    }

    /// Makes the set exactly these keys, noting only what changed (a name given twice keeps
    /// the last key given).
    /// Returns the names that had a key and are not given one now.
    pub fn replace<'a>(&mut self, keys: impl IntoIterator<Item = (&'a str, PublicKey)>) -> Vec<String> {
        self.replaced += 1;
        for (name, key) in keys {
            self.set(name, Some(key));
        }
        // Every name given carries this replace's number: the others are gone.
        let now = self.replaced;
        let gone: Vec<String> = self.map.iter().filter(|(_, v)| v.1 != now).map(|(n, _)| n.clone()).collect();
        for name in &gone {
            self.set(name, None);
        }
        gone
    }

    fn note(&mut self, name: &str) {
        if self.changes.len() == REMEMBERED {
            let half = REMEMBERED / 2;
            self.changes.drain(..half);
            self.forgotten += half;
        }
        self.changes.push((next(), Arc::from(name)));
    }

    /// Where a reader stands after reading the set as it is now.
    pub fn seen(&self) -> KeysSeen {
        KeysSeen { origin: self.origin, count: self.forgotten + self.changes.len(), last: self.changes.last().map_or(0, |c| c.0) }
    }

    /// The names whose key may have changed since a reader stood at `seen` (a name may come more
    /// than once), or `None` when this set does not continue what that reader read (another
    /// set, a clone changed another way, or changes forgotten since): then every key is to be
    /// read.
    pub fn changed_since(&self, seen: &KeysSeen) -> Option<impl Iterator<Item = &str>> {
        if seen.origin != self.origin || seen.count < self.forgotten || seen.count > self.forgotten + self.changes.len() {
            return None;
        }
        let at = seen.count - self.forgotten;
        let continues = match at {
            // Read before any change: known to continue only if none was forgotten since.
            0 => seen.count == 0,
            _ => self.changes[at - 1].0 == seen.last,
        };
        continues.then(|| self.changes[at..].iter().map(|(_, n)| &**n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> PublicKey {
        PublicKey([b; 32])
    }

    fn changed(keys: &Keys, seen: &KeysSeen) -> Option<Vec<String>> {
        keys.changed_since(seen).map(|names| names.map(str::to_string).collect())
    }

    #[test]
    fn a_reader_sees_the_names_changed_since_it_read_and_only_those() {
        let mut keys: Keys = [("a".to_string(), key(1)), ("b".to_string(), key(2))].into_iter().collect();
        let seen = keys.seen();
        assert_eq!(changed(&keys, &seen), Some(vec![]));
        assert!(!keys.set("a", Some(key(1))), "the same key again is no change");
        assert!(keys.set("a", Some(key(9))));
        assert!(keys.set("c", Some(key(3))));
        assert!(keys.set("b", None));
        assert!(!keys.set("zz", None), "removing what is not there is no change");
        assert_eq!(changed(&keys, &seen), Some(vec!["a".into(), "c".into(), "b".into()]));
        let later = keys.seen();
        assert_eq!(changed(&keys, &later), Some(vec![]));
        assert_eq!((keys.get("a"), keys.get("b"), keys.get("c")), (Some(key(9)), None, Some(key(3))));
    }

    #[test]
    fn another_set_or_a_clone_changed_another_way_is_read_whole() {
        let mut keys: Keys = [("a".to_string(), key(1))].into_iter().collect();
        keys.set("b", Some(key(2)));
        let seen = keys.seen();
        // A set with the same keys but another history.
        let same: Keys = keys.iter().map(|(n, k)| (n.to_string(), *k)).collect();
        assert_eq!(same, keys);
        assert_eq!(changed(&same, &seen), None);
        // Two clones of one set, each changed its own way: a reader of one cannot read the other
        // by its changes.
        let (mut left, mut right) = (keys.clone(), keys.clone());
        left.set("c", Some(key(3)));
        right.set("d", Some(key(4)));
        assert_eq!(changed(&right, &seen), Some(vec!["d".into()]), "a clone continues what its original had");
        assert_eq!(changed(&right, &left.seen()), None);
        assert_eq!(changed(&left, &right.seen()), None);
        // A reader that saw more than the set has (a set read later, then the older one given).
        assert_eq!(changed(&keys, &left.seen()), None);
    }

    #[test]
    fn replace_notes_what_it_sets_and_what_it_removes() {
        let mut keys: Keys = [("a".to_string(), key(1)), ("b".to_string(), key(2)), ("c".to_string(), key(3))].into_iter().collect();
        let seen = keys.seen();
        keys.replace([("a", key(1)), ("c", key(7)), ("d", key(4))]);
        let mut names = changed(&keys, &seen).expect("continues");
        names.sort();
        assert_eq!(names, ["b", "c", "d"]);
        let now: Keys = [("a".to_string(), key(1)), ("c".to_string(), key(7)), ("d".to_string(), key(4))].into_iter().collect();
        assert_eq!(keys, now);
        // A name given twice is one name: the other still goes (two names given, two held).
        keys.set("d", None);
        keys.replace([("a", key(1)), ("a", key(2))]);
        assert_eq!(keys, [("a".to_string(), key(2))].into_iter().collect::<Keys>());
    }

    #[test]
    fn a_reader_from_before_forgotten_changes_reads_every_key() {
        let mut keys = Keys::default();
        let start = keys.seen();
        keys.set("first", Some(key(1)));
        let early = keys.seen();
        for i in 0..REMEMBERED {
            keys.set(&format!("n{i}"), Some(key((i % 250) as u8)));
        }
        assert!(keys.forgotten > 0);
        assert_eq!(changed(&keys, &start), None);
        assert_eq!(changed(&keys, &early), None);
        let recent = keys.seen();
        keys.set("last", Some(key(1)));
        assert_eq!(changed(&keys, &recent), Some(vec!["last".into()]));
    }
}

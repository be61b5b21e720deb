//! Reading back the `nftables.conf` that `render` writes (one `table inet trellis`), for the
//! agent that loads it: its named sets' elements apart from everything else, and what changed
//! between two such rulesets as nft commands. When they differ only in the elements of named sets
//! (a node came, went or was renumbered: the sources of the rules that admit it), the change is
//! those elements, deleted and created in one transaction, instead of the whole table loaded again
//! (ADR 0031). With ten thousand sources a one-source change then costs what the change costs, not
//! what the table does. Pure.

use std::collections::HashSet;

/// The table every trellis ruleset holds (`render::nftables`).
pub const TABLE: &str = "inet trellis";

/// A ruleset read back: the lines that are not set elements, each named set's elements and each
/// chain's rules, as written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ruleset<'a> {
    /// Every line but the lines of sets' elements, in order: two rulesets with the same `rest`
    /// and the same sets' names differ only in elements.
    pub rest: Vec<&'a str>,
    /// Each named set and its elements, in the order written.
    pub sets: Vec<(&'a str, Vec<&'a str>)>,
    pub chains: Vec<Chain<'a>>,
}

/// A chain of the table: its base specification (`type ... policy ...;`) and its rules, as
/// written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain<'a> {
    pub name: &'a str,
    pub spec: Option<&'a str>,
    pub rules: Vec<&'a str>,
}

/// Reads a ruleset trellis wrote; `None` for a text trellis does not write (a set's name or an
/// element that is no address or prefix, a rule with a `;`), which is then loaded whole, never
/// pasted into commands.
pub fn read(text: &str) -> Option<Ruleset<'_>> {
    let (ruleset, valid) = shape(text);
    valid.then_some(ruleset)
}

/// A name trellis gives a set or a chain: lower-case letters, digits, `_` and the `-` of a
/// module's or route's name (a DNS label).
fn plain(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

/// The ruleset `text` holds, and whether it is one trellis writes: each line is a set or chain
/// opening, a closing, a set's element list, a chain's line, or anything else, kept as it is.
fn shape(text: &str) -> (Ruleset<'_>, bool) {
    let mut r = Ruleset { rest: Vec::new(), sets: Vec::new(), chains: Vec::new() };
    // Lines end with a newline alone: a carriage return, which this reader drops, nft reads.
    let mut valid = !text.contains('\r');
    // Inside a set's or a chain's braces.
    let mut inside = Inside::Neither;
    for line in text.lines() {
        match (Line::of(line), inside) {
            (Line::Set(name), _) => {
                valid &= plain(name);
                r.sets.push((name, Vec::new()));
                inside = Inside::Set;
            }
            (Line::Chain(name), _) => {
                valid &= plain(name);
                r.chains.push(Chain { name, spec: None, rules: Vec::new() });
                inside = Inside::Chain;
            }
            (Line::Close, _) => inside = Inside::Neither,
            (Line::Other, Inside::Set) => {
                let (_, list) = r.sets.last_mut().expect("a set is open");
                if let Some(ok) = set_elements(line, list) {
                    // Left out of the shape, so that a set gaining its first element or losing
                    // its last (nft declares no empty list) changes its elements, not its shape.
                    valid &= ok;
                    continue;
                }
            }
            (Line::Other, Inside::Chain) => valid &= chain_line(line, r.chains.last_mut().expect("a chain is open")),
            (Line::Other, Inside::Neither) => {
                // A set's elements added after the table (a ruleset in parts, ADR 0044): the set's
                // elements as if listed in it, left out of the shape as they are.
                if let Some((name, list)) = added(line) {
                    match r.sets.iter_mut().find(|(n, _)| *n == name) {
                        Some((_, elements)) => valid &= set_elements_listed(list, elements),
                        None => valid = false,
                    }
                    continue;
                }
            }
        }
        r.rest.push(line);
    }
    (r, valid)
}

/// Whose braces a line of the table is inside.
#[derive(Clone, Copy)]
enum Inside {
    Neither,
    Set,
    Chain,
}

/// What a line of the table opens or closes.
enum Line<'a> {
    /// `\tset NAME {`
    Set(&'a str),
    /// `\tchain NAME {`
    Chain(&'a str),
    /// `\t}`
    Close,
    Other,
}

impl<'a> Line<'a> {
    fn of(line: &'a str) -> Line<'a> {
        let opening = |keyword: &str| line.strip_prefix(keyword).and_then(|l| l.strip_suffix(" {"));
        if let Some(name) = opening("\tset ") {
            Line::Set(name)
        } else if let Some(name) = opening("\tchain ") {
            Line::Chain(name)
        } else if line == "\t}" {
            Line::Close
        } else {
            Line::Other
        }
    }
}

/// A set's element list (`\t\telements = { a, b }`) taken into `list`: `None` when the line is
/// none, else whether every element is an address or a prefix.
fn set_elements<'a>(line: &'a str, list: &mut Vec<&'a str>) -> Option<bool> {
    let elements = line.strip_prefix(LIST_OPEN)?.strip_suffix(" }")?;
    Some(set_elements_listed(elements, list))
}

/// The elements `a, b` taken into `list`: whether every one is an address or a prefix, written
/// as trellis writes it.
fn set_elements_listed<'a>(elements: &'a str, list: &mut Vec<&'a str>) -> bool {
    let mut ok = true;
    for e in elements.split(", ") {
        ok &= element(e);
        list.push(e);
    }
    ok
}

/// Whether `e` is an address or a prefix written one way only, as trellis writes it: nft holds
/// `FD00::1` and `fd00::1` as one element, which two strings would take for two (a review found
/// one deleted that another part still listed).
fn element(e: &str) -> bool {
    e.parse::<std::net::IpAddr>().is_ok_and(|a| a.to_string() == e) || e.parse::<ipnet::IpNet>().is_ok_and(|n| n.to_string() == e)
}

/// How a part of a ruleset adds elements to a set of the table (ADR 0044).
const ADD_OPEN: &str = "add element inet trellis ";

/// A line that adds elements to a set of the table (`add element inet trellis NAME { a, b }`):
/// the set's name and the elements as listed.
fn added(line: &str) -> Option<(&str, &str)> {
    let (name, list) = line.strip_prefix(ADD_OPEN)?.split_once(" { ")?;
    Some((name, list.strip_suffix(" }")?)).filter(|(name, _)| plain(name))
}

/// Checks a part of a ruleset (ADR 0044) as `render::nftables_files` writes it: comments and
/// lines that add addresses to a set of the table (`add element inet trellis NAME { a, b }`)
/// only, each line ended. The ruleset loaded is `nftables.conf` and its parts one after the
/// other, so anything else in a part (a rule, a table, a flush) would change the table beyond
/// its sets' elements: refused, naming the part's path and line.
pub fn check_part(text: &str, path: &str) -> Result<(), String> {
    if !text.is_empty() && !text.ends_with('\n') {
        return Err(format!("{path} line {}: a part of the ruleset ends with its last line ended (a newline)", text.lines().count()));
    }
    for (n, line) in text.split_terminator('\n').enumerate() {
        // nft and this reader must read the same lines: no carriage return, no other control.
        if let Some(c) = line.chars().find(|c| c.is_control()) {
            return Err(format!("{path} line {}: a part of the ruleset holds the control character {c:?}", n + 1));
        }
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let ok =
            added(line).is_some_and(|(_, list)| list.split(", ").all(|e| e.parse::<std::net::IpAddr>().is_ok_and(|a| a.to_string() == e)));
        if !ok {
            return Err(format!(
                "{path} line {}: a part of the ruleset adds addresses to the table's sets only (add element inet trellis SET {{ ADDRESS, .. }}), not `{line}`",
                n + 1
            ));
        }
    }
    Ok(())
}

/// A line inside a chain, taken into `chain` (its base specification, or a rule; comments and
/// blank lines are neither): whether it is one trellis writes.
fn chain_line<'a>(line: &'a str, chain: &mut Chain<'a>) -> bool {
    match line.strip_prefix("\t\t") {
        Some(spec) if spec.starts_with("type ") => {
            chain.spec = Some(spec);
            !spec.contains(['{', '}', '"', '#'])
        }
        Some(comment) if comment.starts_with('#') => true,
        Some(rule) if !rule.trim().is_empty() => {
            chain.rules.push(rule);
            !rule.contains(';')
        }
        _ => true,
    }
}

/// The nft commands that take a table loaded from `old` to `new`, if the two differ only in
/// sets' elements: each removed element deleted and each new one created (`create`, not `add`,
/// so that an element already there, like one deleted and not there, fails the transaction: a
/// table that is not what `old` says is loaded whole, never patched), then every chain put back
/// as `new` writes it (declared again, flushed, its rules added), so that rules taken out behind
/// the agent's back (`nft flush chain`, `flush ruleset`) are back after any apply, as after a
/// whole load; a table or set that is gone fails the transaction, and the file is loaded whole.
/// `None` when anything else differs, or when `new` is no text trellis writes.
pub fn delta(old: &str, new: &str) -> Option<String> {
    let (sets, chains) = changes(old, new)?;
    Some(commands(&sets) + &chains)
}

/// What [`delta`] says, apart: the changes of the sets' elements, and the commands that put every
/// chain back as `new` writes it.
pub fn changes(old: &str, new: &str) -> Option<(Vec<SetChange>, String)> {
    let (Some(before), Some(after)) = (read(old), read(new)) else { return None };
    let same_shape = before.rest == after.rest
        && before.sets.len() == after.sets.len()
        && before.sets.iter().zip(&after.sets).all(|((a, _), (b, _))| a == b);
    if !same_shape {
        return None;
    }
    let sets = before.sets.iter().zip(&after.sets).filter_map(|((name, was), (_, now))| SetChange::of(name, was, now)).collect();
    Some((sets, chain_commands(&after)))
}

/// The elements of one named set of the table that change: each gone deleted, each new created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetChange {
    pub set: String,
    pub gone: Vec<String>,
    pub came: Vec<String>,
}

impl SetChange {
    /// The change of the set `name` from the elements `was` to `now`; `None` when none change.
    fn of(name: &str, was: &[&str], now: &[&str]) -> Option<SetChange> {
        let was_set: HashSet<&str> = was.iter().copied().collect();
        let now_set: HashSet<&str> = now.iter().copied().collect();
        let owned = |v: Vec<&str>| v.into_iter().map(str::to_string).collect();
        let gone: Vec<&str> = was.iter().copied().filter(|e| !now_set.contains(e)).collect();
        let came: Vec<&str> = now.iter().copied().filter(|e| !was_set.contains(e)).collect();
        (!gone.is_empty() || !came.is_empty()).then(|| SetChange { set: name.to_string(), gone: owned(gone), came: owned(came) })
    }
}

/// The nft commands of these changes of elements, in order.
pub fn commands(sets: &[SetChange]) -> String {
    let mut commands = String::new();
    for c in sets {
        let name = &c.set;
        if !c.gone.is_empty() {
            commands.push_str(&format!("delete element {TABLE} {name} {{ {} }}\n", c.gone.join(", ")));
        }
        if !c.came.is_empty() {
            commands.push_str(&format!("create element {TABLE} {name} {{ {} }}\n", c.came.join(", ")));
        }
    }
    commands
}

/// What [`delta_in`] needs of the ruleset loaded: the commands that put its chains back, when
/// it is a text trellis writes and no set lists an element twice; `None` otherwise (then every
/// change is read whole).
pub fn chains(text: &str) -> Option<String> {
    let read = read(text)?;
    for (_, elements) in &read.sets {
        let mut seen = HashSet::with_capacity(elements.len());
        if !elements.iter().all(|e| seen.insert(*e)) {
            return None;
        }
    }
    Some(chain_commands(&read))
}

/// As [`delta`], read from the regions where the two texts differ (ADR 0035) instead of from
/// both texts whole: when every region lies inside one set's element list, in both texts, the
/// commands are its elements gone deleted and its new ones created, then `chains` (from
/// [`chains`] of `old`: outside the regions the texts are the same, so the chains are). A cost
/// that follows the change, not the sets' sizes. `None` when a region is anything else (a set
/// gaining its first element or losing its last, a rule, a set's type): read them whole.
///
/// The same commands as [`delta`] for a text `chains` accepted: an element of a region in both
/// texts is listed once in each (an element twice in the new one fails `create`, which the
/// caller answers by loading the file whole).
pub fn delta_in(old: &str, new: &str, hunks: &[crate::delta::Hunk], chains: &str) -> Option<String> {
    Some(commands(&changes_in(old, new, hunks)?) + chains)
}

/// The changes of elements [`delta_in`] makes its commands of, without the chains.
pub fn changes_in(old: &str, new: &str, hunks: &[crate::delta::Hunk]) -> Option<Vec<SetChange>> {
    let regions = crate::delta::widen(old.as_bytes(), new.as_bytes(), hunks, b",\n", |_, _| true)?;
    // Each set's elements in the regions, before and after, in the order the sets come.
    let mut sets: Vec<(&str, Vec<&str>, Vec<&str>)> = Vec::new();
    // A region the same in both (lines the edits sent again) changes nothing.
    let (mut old_line, mut new_line) = (None, None);
    for r in regions.iter().filter(|r| old.as_bytes()[r.old.clone()] != new.as_bytes()[r.new.clone()]) {
        // A region may run over several lists' lines (a part of a ruleset adds a node's v4 and
        // v6 addresses on lines one after the other, ADR 0044): each set's elements in it,
        // before and after. Outside the regions the texts are the same.
        let (was, was_open) = in_lists(old, r.old.clone(), &mut old_line)?;
        let (now, now_open) = in_lists(new, r.new.clone(), &mut new_line)?;
        // The rest of the line a region ends inside is the same bytes in both texts, and the
        // elements of the set its line names: the same set in both, or they moved without being
        // read (a part's line that names another set, ADR 0044).
        if was_open != now_open {
            return None;
        }
        let mut pieces: Vec<(&str, Vec<&str>, bool)> = was.into_iter().map(|(n, e)| (n, e, false)).collect();
        pieces.extend(now.into_iter().map(|(n, e)| (n, e, true)));
        for (name, elements, after) in pieces {
            let at = match sets.iter().position(|(n, ..)| *n == name) {
                Some(at) => at,
                None => {
                    sets.push((name, Vec::new(), Vec::new()));
                    sets.len() - 1
                }
            };
            match after {
                false => sets[at].1.extend(elements),
                true => sets[at].2.extend(elements),
            }
        }
    }
    Some(sets.iter().filter_map(|(name, was, now)| SetChange::of(name, was, now)).collect())
}

/// The sets' elements the bytes `range` of `text` hold, line by line (`in_elements` of each
/// line's piece), and the set of the line the range ends inside, if it ends inside one (the rest
/// of that line, after the range, is that set's); `None` when a piece is not inside one list.
type Pieces<'a> = (Vec<(&'a str, Vec<&'a str>)>, Option<&'a str>);
fn in_lists<'a>(text: &'a str, range: std::ops::Range<usize>, line: &mut Option<ListLine<'a>>) -> Option<Pieces<'a>> {
    let mut out = Vec::new();
    let mut at = range.start;
    loop {
        let end = text.get(at..range.end)?.find('\n').map_or(range.end, |i| at + i + 1);
        let (name, elements, closes) = in_elements(text, at..end, line)?;
        out.push((name, elements));
        if end >= range.end {
            return Some((out, (!closes).then_some(name)));
        }
        at = end;
    }
}

/// An element list's line, found once for the regions on it: its start and end in the text and
/// its set's name. A set of 100,000 sources is one line; finding it again for each of thousands
/// of regions on it would cost the line's length each time.
#[derive(Clone, Copy)]
struct ListLine<'a> {
    start: usize,
    end: usize,
    name: &'a str,
    /// How many bytes its opening takes (`\t\telements = { `, or `add element inet trellis
    /// NAME { ` in a part, ADR 0044).
    open: usize,
}

/// The set whose element list holds the bytes `range` of `text` (one line, `\t\telements = { a,
/// b }`), and the elements they list, read as [`read`] reads a list (elements between `, `, the
/// first right after the opening, the last right before the closing); `None` when they are not
/// all inside one such list, or it is not written so, or an element is no address or prefix.
/// `line`: the list line found last, taken again when the range is on it.
fn in_elements<'a>(text: &'a str, range: std::ops::Range<usize>, line: &mut Option<ListLine<'a>>) -> Option<(&'a str, Vec<&'a str>, bool)> {
    let on_line = line.filter(|l| l.start <= range.start && range.end <= l.end && (range.end < l.end || range.end > range.start));
    let l = match on_line {
        Some(l) => l,
        None => *line.insert(list_line(text, &range)?),
    };
    // The region's bytes without the list's opening and closing (when it takes them in); no line
    // ends inside it.
    let (opens, closes) = (range.start == l.start, range.end == l.end);
    // A region starting inside the opening is none of the list's.
    if range.start > l.start && range.start < l.start + l.open {
        return None;
    }
    let mut part = &text[range];
    if opens {
        part = part.get(l.open..)?;
    }
    if closes {
        part = part.strip_suffix(LIST_CLOSE)?;
    }
    Some((l.name, listed(part, opens, closes)?, closes))
}

/// How an element list's line opens and closes.
const LIST_OPEN: &str = "\t\telements = { ";
const LIST_CLOSE: &str = " }\n";

/// The element list's line around the bytes `range` of `text`, with its set's name; `None` when
/// the line is no list or its set is not written as trellis writes one.
fn list_line<'a>(text: &'a str, range: &std::ops::Range<usize>) -> Option<ListLine<'a>> {
    let start = text[..range.start].rfind('\n').map_or(0, |i| i + 1);
    let end = if range.end > range.start && text[..range.end].ends_with('\n') {
        range.end
    } else {
        text[range.end..].find('\n').map_or(text.len(), |i| range.end + i + 1)
    };
    let whole = &text[start..end];
    if !whole.ends_with(LIST_CLOSE) {
        return None;
    }
    // A part's line that adds elements names its set itself (ADR 0044).
    if let Some((name, _)) = added(whole.strip_suffix('\n')?) {
        return Some(ListLine { start, end, name, open: ADD_OPEN.len() + name.len() + " { ".len() });
    }
    if !whole.starts_with(LIST_OPEN) {
        return None;
    }
    // The set this list belongs to: two lines up, `\tset NAME {`, its `type` line between.
    let (above, type_line) = text[..start].strip_suffix('\n')?.rsplit_once('\n')?;
    if !type_line.starts_with("\t\ttype ") {
        return None;
    }
    let set_line = above.rsplit_once('\n').map_or(above, |(_, l)| l);
    let name = set_line.strip_prefix("\tset ")?.strip_suffix(" {")?;
    plain(name).then_some(ListLine { start, end, name, open: LIST_OPEN.len() })
}

/// The elements `part` of a list lists (`opens`: it starts right after the opening; `closes`: it
/// ends right before the closing), read as [`read`] reads a list; `None` for anything else.
fn listed(part: &str, opens: bool, closes: bool) -> Option<Vec<&str>> {
    // A list is never empty and ends with an element (`{ }`, `a, }` are not lists `read` reads).
    if part.contains('\n') || (closes && (part.is_empty() || part.ends_with(','))) {
        return None;
    }
    let mut elements = Vec::new();
    let mut rest = part;
    let mut first = opens;
    while !rest.is_empty() {
        // After a comma, one space; right after the opening, none.
        if !first {
            rest = rest.strip_prefix(' ')?;
        }
        first = false;
        let (e, after, comma) = match rest.split_once(',') {
            Some((e, after)) => (e, after, true),
            None => (rest, "", false),
        };
        // The parsers take no space: an element with any around it is refused.
        if !element(e) {
            return None;
        }
        elements.push(e);
        if !comma {
            if !closes {
                return None;
            }
            break;
        }
        rest = after;
    }
    if opens && elements.is_empty() {
        return None;
    }
    Some(elements)
}

/// The commands that put every chain of `ruleset` back as it writes it.
fn chain_commands(ruleset: &Ruleset<'_>) -> String {
    let mut commands = String::new();
    for chain in &ruleset.chains {
        let name = chain.name;
        match chain.spec {
            Some(spec) => commands.push_str(&format!("add chain {TABLE} {name} {{ {spec} }}\n")),
            None => commands.push_str(&format!("add chain {TABLE} {name}\n")),
        }
        commands.push_str(&format!("flush chain {TABLE} {name}\n"));
        for rule in &chain.rules {
            commands.push_str(&format!("add rule {TABLE} {name} {rule}\n"));
        }
    }
    commands
}

#[cfg(test)]
mod tests {
    use super::{delta, read, Chain};

    fn ruleset(v4: &[&str], v6: &[&str], port: u16) -> String {
        let set = |name: &str, kind: &str, e: &[&str]| {
            let elements = if e.is_empty() { String::new() } else { format!("\t\telements = {{ {} }}\n", e.join(", ")) };
            format!("\tset {name} {{\n\t\ttype {kind}\n{elements}\t}}\n")
        };
        format!(
            "# trellis\ntable inet trellis {{\n}}\ndelete table inet trellis\n\ntable inet trellis {{\n{}{}\n\tchain input {{\n\t\ttype filter hook input priority filter; policy accept;\n\t\tiifname \"trellis0\" ip saddr @src_ssh_1_v4 tcp dport {{ {port} }} accept\n\t\tiifname \"trellis0\" ip6 saddr @src_ssh_1_v6 tcp dport {{ {port} }} accept\n\t}}\n}}\n",
            set("src_ssh_1_v4", "ipv4_addr", v4),
            set("src_ssh_1_v6", "ipv6_addr", v6)
        )
    }

    /// The element commands of a delta, without the chains it puts back.
    fn elements(commands: &str) -> String {
        commands.lines().filter(|l| l.contains(" element ")).map(|l| format!("{l}\n")).collect()
    }

    /// The chains put back after the elements, as the new text writes them.
    const CHAINS_22: &str = "add chain inet trellis input { type filter hook input priority filter; policy accept; }\n\
        flush chain inet trellis input\n\
        add rule inet trellis input iifname \"trellis0\" ip saddr @src_ssh_1_v4 tcp dport { 22 } accept\n\
        add rule inet trellis input iifname \"trellis0\" ip6 saddr @src_ssh_1_v6 tcp dport { 22 } accept\n";

    #[test]
    fn reads_the_sets_elements_apart_from_the_rest() {
        let text = ruleset(&["10.0.0.1", "10.0.0.0/24"], &[], 22);
        let read = read(&text).expect("a ruleset trellis writes");
        assert_eq!(read.sets, [("src_ssh_1_v4", vec!["10.0.0.1", "10.0.0.0/24"]), ("src_ssh_1_v6", vec![])]);
        assert!(!read.rest.iter().any(|l| l.contains("elements")), "{:?}", read.rest);
        assert_eq!(
            read.chains,
            [Chain {
                name: "input",
                spec: Some("type filter hook input priority filter; policy accept;"),
                rules: vec![
                    "iifname \"trellis0\" ip saddr @src_ssh_1_v4 tcp dport { 22 } accept",
                    "iifname \"trellis0\" ip6 saddr @src_ssh_1_v6 tcp dport { 22 } accept"
                ],
            }]
        );
        assert_eq!(super::read(&text.replace("10.0.0.1", "10.0.0.1 } ; flush ruleset ; {")), None, "an element that is no address");
    }

    #[test]
    fn a_change_of_sources_only_is_the_elements_deleted_and_created() {
        let old = ruleset(&["10.0.0.1", "10.0.0.2", "10.0.0.3"], &["fd00::1"], 22);
        let new = ruleset(&["10.0.0.1", "10.0.0.3", "10.0.0.4"], &["fd00::1"], 22);
        assert_eq!(
            delta(&old, &new).unwrap(),
            format!("delete element inet trellis src_ssh_1_v4 {{ 10.0.0.2 }}\ncreate element inet trellis src_ssh_1_v4 {{ 10.0.0.4 }}\n{CHAINS_22}")
        );
        // Nothing changed: the chains are put back all the same (rules flushed behind the
        // agent's back come back with any apply).
        assert_eq!(delta(&old, &old).unwrap(), CHAINS_22);
    }

    #[test]
    fn a_text_trellis_does_not_write_is_loaded_whole_never_pasted_into_commands() {
        let old = ruleset(&["10.0.0.1"], &["fd00::1"], 22);
        let injected =
            ruleset(&["10.0.0.1 } ; delete table inet other ; create element inet trellis src_ssh_1_v4 { 10.0.0.2"], &["fd00::1"], 22);
        assert_eq!(delta(&old, &injected), None, "an element that is no address");
        let rule = old.replace("tcp dport { 22 } accept\n\t\tiifname", "tcp dport { 22 } accept; delete table inet other\n\t\tiifname");
        assert_eq!(delta(&old, &rule), None, "a rule with a ;");
        let spec = old.replace("policy accept;", "policy accept; } ; delete table inet other ; add chain inet trellis input {");
        assert_eq!(delta(&old, &spec), None, "a chain's specification with braces");
        assert_eq!(delta(&old, &old.replace("src_ssh_1_v4", "src ssh")), None, "a set's name");
        assert!(delta(&old, &ruleset(&["10.0.0.0/24"], &["fd00::/64"], 22)).is_some(), "prefixes are elements");
        let hyphen = old.replace("src_ssh_1", "src_web-app_1");
        assert!(delta(&hyphen, &hyphen.replace("10.0.0.1", "10.0.0.2")).is_some(), "a module named with a hyphen");
    }

    #[test]
    fn a_set_losing_its_last_element_or_gaining_its_first_is_still_a_change_of_elements() {
        let old = ruleset(&["10.0.0.1"], &[], 22);
        let new = ruleset(&[], &["fd00::9"], 22);
        assert_eq!(
            elements(&delta(&old, &new).unwrap()),
            "delete element inet trellis src_ssh_1_v4 { 10.0.0.1 }\ncreate element inet trellis src_ssh_1_v6 { fd00::9 }\n"
        );
    }

    #[test]
    fn any_other_difference_loads_the_whole_table() {
        let old = ruleset(&["10.0.0.1"], &["fd00::1"], 22);
        assert_eq!(delta(&old, &ruleset(&["10.0.0.1"], &["fd00::1"], 2222)), None, "a port");
        assert_eq!(delta(&old, &old.replace("src_ssh_1_v6", "src_ssh_2_v6")), None, "a set's name");
        assert_eq!(delta(&old, &old.replace("ipv4_addr", "ipv6_addr")), None, "a set's type");
        assert_eq!(delta(&old, &format!("{old}table inet other {{\n}}\n")), None, "another line");
    }

    proptest::proptest! {
        /// Whatever the sources before and after, the commands take the old sets to the new
        /// ones: each deletion names an element the old set holds, each creation one it does
        /// not, and applying them gives exactly the new elements.
        #[test]
        fn the_commands_take_the_old_sets_to_the_new(
            old4 in proptest::collection::btree_set(0u16..300, 0..40),
            new4 in proptest::collection::btree_set(0u16..300, 0..40),
            old6 in proptest::collection::btree_set(0u16..300, 0..10),
            new6 in proptest::collection::btree_set(0u16..300, 0..10),
        ) {
            use std::collections::BTreeSet;
            let v4 = |s: &BTreeSet<u16>| s.iter().map(|i| format!("10.0.{}.{}", i / 256, i % 256)).collect::<Vec<_>>();
            let v6 = |s: &BTreeSet<u16>| s.iter().map(|i| std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, *i).to_string()).collect::<Vec<_>>();
            let (o4, n4, o6, n6) = (v4(&old4), v4(&new4), v6(&old6), v6(&new6));
            fn refs(v: &[String]) -> Vec<&str> {
                v.iter().map(String::as_str).collect()
            }
            let old = ruleset(&refs(&o4), &refs(&o6), 22);
            let new = ruleset(&refs(&n4), &refs(&n6), 22);
            let commands = delta(&old, &new).expect("only elements differ");
            let mut sets: std::collections::HashMap<&str, BTreeSet<String>> =
                [("src_ssh_1_v4", o4.iter().cloned().collect()), ("src_ssh_1_v6", o6.iter().cloned().collect())].into();
            for line in elements(&commands).lines() {
                let (verb, rest) = line.split_once(" element inet trellis ").expect("an element command");
                let (name, elements) = rest.split_once(" { ").expect("a set and its elements");
                let set = sets.get_mut(name).expect("a declared set");
                for e in elements.strip_suffix(" }").expect("closed").split(", ") {
                    match verb {
                        "delete" => proptest::prop_assert!(set.remove(e), "{} deletes {} it does not hold", name, e),
                        "create" => proptest::prop_assert!(set.insert(e.to_string()), "{} creates {} it holds", name, e),
                        other => proptest::prop_assert!(false, "unknown command {}", other),
                    }
                }
            }
            proptest::prop_assert_eq!(&sets["src_ssh_1_v4"], &n4.iter().cloned().collect::<BTreeSet<_>>());
            proptest::prop_assert_eq!(&sets["src_ssh_1_v6"], &n6.iter().cloned().collect::<BTreeSet<_>>());
        }
    }

    /// What the read of the regions (ADR 0035) answers, for texts trellis writes: the commands
    /// of the whole read, or `None` (then the caller reads whole). Sets of hundreds of sources,
    /// as a node that sees the mesh holds, changed in a few places.
    #[test]
    fn the_regions_give_the_commands_of_the_whole_read() {
        let list = |n: u16, skip: &[u16], extra: &[u16]| -> Vec<String> {
            (0..n).filter(|i| !skip.contains(i)).chain(extra.iter().copied()).map(|i| format!("10.0.{}.{}", i / 256, i % 256)).collect()
        };
        fn refs(v: &[String]) -> Vec<&str> {
            v.iter().map(String::as_str).collect()
        }
        let old4 = list(600, &[], &[]);
        let old = ruleset(&refs(&old4), &["fd00::1", "fd00::2"], 22);
        let chains = super::chains(&old).expect("a text trellis writes");
        assert_eq!(chains, CHAINS_22);
        let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
            (list(600, &[1, 300], &[]), vec!["fd00::1", "fd00::2"]),
            (list(600, &[0], &[700]), vec!["fd00::1", "fd00::2"]),
            (list(600, &[599], &[]), vec!["fd00::1", "fd00::2", "fd00::3"]),
            (list(600, &[], &[]), vec!["fd00::2"]),
        ];
        for (v4, v6) in cases {
            let new = ruleset(&refs(&v4), &v6, 22);
            let (built, hunks) =
                crate::delta::rebuild_with_hunks(old.as_bytes(), &crate::delta::edits(old.as_bytes(), new.as_bytes()), new.len(), "f")
                    .unwrap();
            assert_eq!(built, new.as_bytes());
            let by_regions = super::delta_in(&old, &new, &hunks.unwrap(), &chains);
            assert_eq!(by_regions, delta(&old, &new), "{v6:?}");
            assert!(by_regions.is_some(), "a change of elements inside non-empty lists is read from its regions");
        }
        // A set losing its last element, a rule or a type changed: not a change inside lists.
        for new in [
            ruleset(&refs(&old4), &[], 22),
            ruleset(&refs(&old4), &["fd00::1", "fd00::2"], 23),
            old.replace("type ipv6_addr", "type ipv4_addr"),
        ] {
            let (_, hunks) =
                crate::delta::rebuild_with_hunks(old.as_bytes(), &crate::delta::edits(old.as_bytes(), new.as_bytes()), new.len(), "f")
                    .unwrap();
            assert_eq!(super::delta_in(&old, &new, &hunks.unwrap(), &chains), None);
        }
        // An element that is no address, in a region: read whole (and refused there).
        let bad = old.replace("10.0.1.7,", "10.0.1.7 } ; flush ruleset ; {,");
        let (_, hunks) =
            crate::delta::rebuild_with_hunks(old.as_bytes(), &crate::delta::edits(old.as_bytes(), bad.as_bytes()), bad.len(), "f").unwrap();
        assert_eq!(super::delta_in(&old, &bad, &hunks.unwrap(), &chains), None);
        // A list `read` does not read (two commas, no element, space that is not ASCII): by
        // regions as whole, refused (a review found these committed by regions).
        for bad in [
            old.replace("10.0.1.7, ", "10.0.1.7,, "),
            old.replace("{ fd00::1, fd00::2 }", "{  }"),
            old.replace(" 10.0.1.7,", " \u{3000}10.0.1.7,"),
            old.replace("10.0.1.7, ", "10.0.1.7,"),
        ] {
            let (_, hunks) =
                crate::delta::rebuild_with_hunks(old.as_bytes(), &crate::delta::edits(old.as_bytes(), bad.as_bytes()), bad.len(), "f")
                    .unwrap();
            assert_eq!(super::delta_in(&old, &bad, &hunks.unwrap(), &chains), None, "{bad}");
            assert_eq!(delta(&old, &bad), None);
        }
        // A set listing an element twice is never read by regions.
        assert_eq!(super::chains(&old.replace("10.0.0.2,", "10.0.0.1,")), None);
    }

    proptest::proptest! {
        /// Any change of two large sets' elements: the regions give the whole read's commands
        /// whenever they give any.
        #[test]
        fn the_regions_never_say_other_than_the_whole_read(
            old4 in proptest::collection::btree_set(0u16..2000, 0..400),
            new4 in proptest::collection::btree_set(0u16..2000, 0..400),
            cut in 0usize..400,
            old6 in proptest::collection::btree_set(0u16..300, 0..100),
            new6 in proptest::collection::btree_set(0u16..300, 0..100),
        ) {
            // Mostly the same: the new set is the old one with a run of the other's elements.
            let new4: std::collections::BTreeSet<u16> = old4.iter().copied().skip(cut).chain(new4.into_iter().take(cut / 8)).collect();
            let new6: std::collections::BTreeSet<u16> = old6.iter().copied().take(old6.len().saturating_sub(2)).chain(new6.into_iter().take(2)).collect();
            let v4 = |s: &std::collections::BTreeSet<u16>| s.iter().map(|i| format!("10.0.{}.{}", i / 256, i % 256)).collect::<Vec<_>>();
            let v6 = |s: &std::collections::BTreeSet<u16>| s.iter().map(|i| std::net::Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, *i).to_string()).collect::<Vec<_>>();
            fn refs(v: &[String]) -> Vec<&str> {
                v.iter().map(String::as_str).collect()
            }
            let old = ruleset(&refs(&v4(&old4)), &refs(&v6(&old6)), 22);
            let new = ruleset(&refs(&v4(&new4)), &refs(&v6(&new6)), 22);
            let (_, hunks) = crate::delta::rebuild_with_hunks(old.as_bytes(), &crate::delta::edits(old.as_bytes(), new.as_bytes()), new.len(), "f").unwrap();
            let chains = super::chains(&old).expect("a text trellis writes");
            if let Some(commands) = super::delta_in(&old, &new, &hunks.unwrap(), &chains) {
                proptest::prop_assert_eq!(Some(commands), delta(&old, &new));
            }
        }
    }

    /// ADR 0044: a ruleset in parts reads as the one file does, its sets' elements added after
    /// the table by `add element` lines; a change in a part's lines, even over a v4 and a v6
    /// line one after the other, is read from its regions as elements; a part is lines that add
    /// elements, and comments, each ended.
    #[test]
    fn a_ruleset_in_parts_reads_as_one_file_and_a_part_changes_by_its_regions() {
        let one = ruleset(&["10.0.0.1", "10.0.0.2", "10.0.0.3"], &["fd00::1", "fd00::2"], 22);
        let main = ruleset(&[], &[], 22);
        let part = |v4: &str, v6: &str| {
            format!("# part\nadd element inet trellis src_ssh_1_v4 {{ {v4} }}\nadd element inet trellis src_ssh_1_v6 {{ {v6} }}\n")
        };
        let (a, b) = (part("10.0.0.1, 10.0.0.2", "fd00::1"), part("10.0.0.3", "fd00::2"));
        let parted = format!("{main}{a}{b}");
        let sets = |r: super::Ruleset| {
            r.sets
                .iter()
                .map(|(n, e)| {
                    (n.to_string(), {
                        let mut e: Vec<&str> = e.clone();
                        e.sort();
                        e.iter().map(|e| e.to_string()).collect::<Vec<_>>()
                    })
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(sets(read(&parted).unwrap()), sets(read(&one).unwrap()));
        assert_eq!(read(&parted).unwrap().chains, read(&one).unwrap().chains);
        // An element added to a set the table does not declare, an address spelled otherwise than
        // trellis spells it, a carriage return: not a ruleset trellis writes.
        assert!(read(&format!("{main}add element inet trellis src_other_v4 {{ 10.0.0.9 }}\n")).is_none());
        assert!(read(&format!("{main}add element inet trellis src_ssh_1_v6 {{ FD00::1 }}\n")).is_none());
        assert!(read(&format!("{main}add element inet trellis src_ssh_1_v4 {{ 10.0.0.9 }}\r\n")).is_none());
        // 10.0.0.2 and fd00::1 gone from the first part, on two lines one after the other.
        let a2 = part("10.0.0.1", "fd00::7");
        let edits = crate::delta::edits(a.as_bytes(), a2.as_bytes());
        let (_, hunks) = crate::delta::rebuild_with_hunks(a.as_bytes(), &edits, a2.len(), "p").unwrap();
        let changes = super::changes_in(&a, &a2, &hunks.unwrap()).expect("elements only");
        let by_set: Vec<(String, Vec<String>, Vec<String>)> = changes.into_iter().map(|c| (c.set, c.gone, c.came)).collect();
        assert_eq!(
            by_set,
            [
                ("src_ssh_1_v4".to_string(), vec!["10.0.0.2".to_string()], vec![]),
                ("src_ssh_1_v6".to_string(), vec!["fd00::1".to_string()], vec!["fd00::7".to_string()]),
            ]
        );
        assert_eq!(super::check_part(&a, "p"), Ok(()));
        for (bad, line) in [
            (format!("{a}flush ruleset\n"), 4),
            ("add element inet trellis src_ssh_1_v4 { 10.0.0.1 }".to_string(), 1),
            ("add element inet other src_ssh_1_v4 { 10.0.0.1 }\n".to_string(), 1),
            ("add element inet trellis src_ssh_1_v4 { 10.0.0.1; flush ruleset }\n".to_string(), 1),
            ("table inet trellis {\n".to_string(), 1),
            ("# part\r\nadd element inet trellis src_ssh_1_v4 { 10.0.0.1 }\r\n".to_string(), 1),
            ("# a \u{0} in a comment\n".to_string(), 1),
            ("\u{b}\n".to_string(), 1),
            ("add element inet trellis src_ssh_1_v4 { 10.0.0.0/24 }\n".to_string(), 1),
            ("add element inet trellis src_ssh_1_v6 { FD00::1 }\n".to_string(), 1),
            ("add element inet trellis src_ssh_1_v6 { fd00:0:0:0:0:0:0:1 }\n".to_string(), 1),
        ] {
            let e = super::check_part(&bad, "p").expect_err(&bad);
            assert!(e.starts_with(&format!("p line {line}:")), "{bad:?}: {e}");
        }
    }
}

//! `mesh.toml` cut into its `[[node]]` tables and the rest, so that a load can take the nodes
//! whose text did not change from the load before instead of parsing them again (ADR 0034).
//!
//! The cut reads just enough TOML to find the top-level table headers: strings (basic,
//! literal, multi-line), comments, and brackets left open across lines. Whatever it does not
//! understand, it gives up on (`None`), and the caller parses the whole file as ever: the cut
//! is an optimisation that must never change what a file means.

/// A `mesh.toml` cut: the text of every `[[node]]` table (with its `[[node.endpoint]]` and other
/// `node.` sub-tables) and the line it starts on (0-based), in order; the lines of `[groups]`
/// that each give a group's members whole (`name = ["a", "b"]`, the name a bare key), with their
/// lines; and the rest of the file with those lines left out, with where and how many (`gaps`:
/// an offset of `rest` and the lines left out there), so that its places can be numbered as in
/// the file. (Left empty instead, a mesh of 100,000 nodes left a million empty lines to parse.)
pub(super) struct Cut<'a> {
    pub(super) nodes: Vec<(u32, &'a str)>,
    pub(super) groups: Vec<(u32, &'a str)>,
    pub(super) rest: String,
    pub(super) gaps: Vec<(usize, u32)>,
    /// For each node table, the one of the text cut before with the same text, where the cut
    /// knows it ([`cut_again`]: every table outside the part re-read); empty from [`cut`].
    pub(super) before: Vec<Option<usize>>,
    /// Where each part is, kept with the text for the next [`cut_again`].
    pub(super) places: Places,
}

/// Where a cut found each node table and one-line group of its text, in order.
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Places {
    nodes: Vec<Part>,
    groups: Vec<Part>,
}

/// One part cut out: the line it starts on, its byte range and how many lines it spans.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Part {
    line: u32,
    from: usize,
    to: usize,
    lines: u32,
}

impl Part {
    fn shifted(self, bytes: isize, lines: i64) -> Part {
        Part {
            line: (i64::from(self.line) + lines) as u32,
            from: self.from.wrapping_add_signed(bytes),
            to: self.to.wrapping_add_signed(bytes),
            lines: self.lines,
        }
    }
}

/// What a line at the top level of the document starts.
enum Header {
    None,
    Node,
    NodePart,
    Groups,
    Other,
}

/// Whether a line starts with a bare key (no dots, no quotes) and its `=`.
fn bare_key_line(line: &str) -> bool {
    let t = line.trim_start_matches([' ', '\t']);
    let key = t.bytes().take_while(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'-').count();
    key > 0 && t[key..].trim_start_matches([' ', '\t']).starts_with('=')
}

/// Cuts `text`, or `None` when it holds something the cut does not read with certainty.
pub(super) fn cut(text: &str) -> Option<Cut<'_>> {
    let (places, _) = read(text, 0, 0, false, |_, _| None::<()>)?;
    Some(assemble(text, places, Vec::new()))
}

/// Cuts `text` knowing that `before` was cut into `places`: only from the last part (a node
/// table or a group's line) that starts in the common start, to the first part in the common
/// end that was one in `before` too, read from the same state. What lies outside is the same
/// text read from the same state, so it is cut as it was (moved by what the middle gained or
/// lost). Gives exactly what [`cut`] gives.
pub(super) fn cut_again<'a>(before: &str, places: &Places, text: &'a str) -> Option<Cut<'a>> {
    let (old, new) = (before.as_bytes(), text.as_bytes());
    let prefix = common(old, new, false);
    let room = old.len().min(new.len()) - prefix;
    let suffix = common(&old[old.len() - room..], &new[new.len() - room..], true);
    // The restart: the last part whose first line lies whole in the common start (the state
    // there is what the same text before it left: the top level, in a node or in `[groups]`).
    let line_end = |from: usize| old[from..].iter().position(|&b| b == b'\n').map_or(old.len(), |e| from + e + 1);
    let last_in = |parts: &[Part]| parts.partition_point(|p| line_end(p.from) <= prefix).checked_sub(1).map(|i| parts[i]);
    let restart = match (last_in(&places.nodes), last_in(&places.groups)) {
        (Some(n), Some(g)) if g.from > n.from => (g, true),
        (Some(n), _) => (n, false),
        (None, Some(g)) => (g, true),
        (None, None) => return cut(text),
    };
    let (part, in_groups) = restart;
    let (bytes, same_from) = (new.len() as isize - old.len() as isize, new.len() - suffix);
    // Stops at a line in the common end where a part started before that starts one of the
    // same kind now (so read from the same state), and gives where it was.
    let stop = |at: usize, group: bool| {
        let was = at.checked_add_signed(-bytes).filter(|_| at >= same_from)?;
        let parts = if group { &places.groups } else { &places.nodes };
        parts.binary_search_by_key(&was, |p| p.from).ok().map(|_| was)
    };
    let (middle, stopped) = read(text, part.from, part.line, in_groups, stop)?;
    let kept = |parts: &[Part]| parts.iter().take_while(|p| p.from < part.from).copied().collect::<Vec<Part>>();
    let (mut nodes, mut groups) = (kept(&places.nodes), kept(&places.groups));
    let mut held: Vec<Option<usize>> = (0..nodes.len()).map(Some).collect();
    held.extend(middle.nodes.iter().map(|_| None));
    nodes.extend(middle.nodes);
    groups.extend(middle.groups);
    if let Some((was, line)) = stopped {
        let lines = i64::from(line) - i64::from(places.line_at(was));
        let m = places.nodes.partition_point(|n| n.from < was);
        nodes.extend(places.nodes[m..].iter().map(|n| n.shifted(bytes, lines)));
        held.extend((m..places.nodes.len()).map(Some));
        groups.extend(places.groups.iter().filter(|g| g.from >= was).map(|g| g.shifted(bytes, lines)));
    }
    Some(assemble(text, Places { nodes, groups }, held))
}

/// How many bytes `a` and `b` start with in common (`from_end`: end with), compared a block at
/// a time, then byte by byte in the block that differs.
fn common(a: &[u8], b: &[u8], from_end: bool) -> usize {
    const BLOCK: usize = 4096;
    let n = a.len().min(b.len());
    let (a, b) = if from_end { (&a[a.len() - n..], &b[b.len() - n..]) } else { (&a[..n], &b[..n]) };
    // The range of the `len` bytes `i` in from the chosen side.
    let span = |i: usize, len: usize| if from_end { n - i - len..n - i } else { i..i + len };
    let mut i = 0;
    while i + BLOCK <= n && a[span(i, BLOCK)] == b[span(i, BLOCK)] {
        i += BLOCK;
    }
    while i < n && a[span(i, 1)] == b[span(i, 1)] {
        i += 1;
    }
    i
}

impl Places {
    /// The line of the part that starts at `at`.
    fn line_at(&self, at: usize) -> u32 {
        let find = |parts: &[Part]| parts.binary_search_by_key(&at, |p| p.from).ok().map(|i| parts[i].line);
        find(&self.nodes).or_else(|| find(&self.groups)).expect("a part starts there")
    }
}

/// Reads `text` from `from`, a line numbered `line` that starts at the top level (the file's
/// start, a node table's header, or a group's line when `in_groups`), to its end or to a line
/// that `stop` takes (told whether it reads `[groups]` there or the line is a node table's
/// header; giving what it says of it, with the line's number): the parts found up to there.
fn read<T>(
    text: &str,
    from: usize,
    line: u32,
    in_groups: bool,
    stop: impl Fn(usize, bool) -> Option<T>,
) -> Option<(Places, Option<(T, u32)>)> {
    let mut places = Places::default();
    let mut state = State::Top;
    let mut depth = 0usize;
    let (mut in_node, mut in_groups) = (false, in_groups);
    let mut offset = from;
    for (number, line_text) in text[from..].split_inclusive('\n').enumerate() {
        let number = line + number as u32;
        let start = offset;
        offset += line_text.len();
        let at_top = state == State::Top && depth == 0;
        if at_top {
            let header = header(line_text)?;
            let node = matches!(header, Header::Node);
            if start > from && (node || (in_groups && matches!(header, Header::None))) {
                if let Some(found) = stop(start, !node) {
                    return Some((places, Some((found, number))));
                }
            }
            match header {
                Header::Node => {
                    places.nodes.push(Part { line: number, from: start, to: offset, lines: 1 });
                    (in_node, in_groups) = (true, false);
                }
                Header::NodePart if in_node => {}
                // A `node.` table after something else: read whole.
                Header::NodePart => return None,
                Header::Groups => (in_node, in_groups) = (false, true),
                Header::Other => (in_node, in_groups) = (false, false),
                Header::None => {}
            }
        }
        if in_node {
            let node = places.nodes.last_mut().expect("in a node");
            // A last line without its newline adds no line to number the rest by.
            (node.to, node.lines) = (offset, number + u32::from(line_text.ends_with('\n')) - node.line);
        }
        scan(line_text, &mut state, &mut depth)?;
        // A group's members on one line, closed on it: cut. One spread over lines stays.
        if at_top && in_groups && state == State::Top && depth == 0 && bare_key_line(line_text) {
            places.groups.push(Part { line: number, from: start, to: offset, lines: u32::from(line_text.ends_with('\n')) });
        }
    }
    if state != State::Top || depth != 0 {
        return None;
    }
    Some((places, None))
}

/// The cut of `text` at `places`: the parts' texts, and the rest with its gaps.
fn assemble(text: &str, places: Places, before: Vec<Option<usize>>) -> Cut<'_> {
    let mut cuts: Vec<(usize, usize, u32)> = places.nodes.iter().chain(&places.groups).map(|p| (p.from, p.to, p.lines)).collect();
    cuts.sort_unstable();
    let mut rest = String::new();
    let mut gaps: Vec<(usize, u32)> = Vec::new();
    let mut last = 0;
    for (from, to, lines) in cuts {
        rest.push_str(&text[last..from]);
        match gaps.last_mut() {
            // Cuts that meet are one gap.
            Some((at, n)) if *at == rest.len() => *n += lines,
            _ => gaps.push((rest.len(), lines)),
        }
        last = to;
    }
    rest.push_str(&text[last..]);
    let texts = |parts: &[Part]| parts.iter().map(|p| (p.line, &text[p.from..p.to])).collect();
    Cut { nodes: texts(&places.nodes), groups: texts(&places.groups), rest, gaps, before, places }
}

/// The header a line at the top level starts, if any; `None` (the cut gives up) for a header it
/// cannot name with certainty.
fn header(line: &str) -> Option<Header> {
    let t = line.trim_start_matches([' ', '\t']);
    if !t.starts_with('[') {
        return Some(Header::None);
    }
    let t = t.trim_end_matches(['\n', '\r']);
    // The header itself, before any comment: `[[node]]`, `[[node.endpoint]]`, `[node.x]`.
    let head = t.split('#').next().unwrap_or("").trim_end_matches([' ', '\t']);
    if head == "[[node]]" {
        return Some(Header::Node);
    }
    if head == "[groups]" {
        return Some(Header::Groups);
    }
    let name = head.trim_start_matches('[').trim_end_matches(']');
    let plain = |s: &str| s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
    if !plain(name) {
        // Quoted keys, spaces inside the brackets, comments that hold a `#` in a key...: the cut
        // does not guess (`["node"]` is `[node]`).
        return None;
    }
    if name == "node" {
        return None;
    }
    Some(if name.starts_with("node.") { Header::NodePart } else { Header::Other })
}

#[derive(Clone, Copy, PartialEq)]
enum State {
    Top,
    /// Inside a multi-line string opened by three of this quote (`"""` or `'''`).
    Multi(u8),
}

/// Follows one line: strings, comments and brackets; `None` when a single-line string does not
/// close on its line (not TOML: the whole parse reports it).
fn scan(line: &str, state: &mut State, depth: &mut usize) -> Option<()> {
    let b = line.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match *state {
            State::Multi(quote) => {
                // Escapes only in basic strings (`"""`); a literal one takes `\` as it is.
                if quote == b'"' && b[i] == b'\\' {
                    i += 2;
                    continue;
                }
                if b[i..].starts_with(&[quote; 3]) {
                    // Up to two more quotes close with it (`""""` ends in a quote).
                    i += 3;
                    while i < b.len() && b[i] == quote {
                        i += 1;
                    }
                    *state = State::Top;
                    continue;
                }
                i += 1;
            }
            State::Top => match b[i] {
                b'#' => return Some(()),
                b'[' | b'{' => {
                    *depth += 1;
                    i += 1;
                }
                b']' | b'}' => {
                    *depth = depth.checked_sub(1)?;
                    i += 1;
                }
                q @ (b'"' | b'\'') if b[i..].starts_with(&[q; 3]) => {
                    *state = State::Multi(q);
                    i += 3;
                }
                b'"' => {
                    i += 1;
                    loop {
                        match b.get(i)? {
                            b'\\' => i += 2,
                            b'"' => break,
                            b'\n' => return None,
                            _ => i += 1,
                        }
                    }
                    i += 1;
                }
                b'\'' => {
                    i += 1;
                    loop {
                        match b.get(i)? {
                            b'\'' => break,
                            b'\n' => return None,
                            _ => i += 1,
                        }
                    }
                    i += 1;
                }
                _ => i += 1,
            },
        }
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every line of the rest, numbered through its gaps, is the file's line of that number.
    fn numbered_as_in_the_file(c: &Cut, text: &str) {
        let index = crate::diag::LineIndex::with_gaps("f".into(), &c.rest, c.gaps.clone());
        let file: Vec<&str> = text.lines().collect();
        let mut at = 0;
        for line in c.rest.lines() {
            let loc = index.loc(&c.rest, at);
            assert_eq!(file[loc.line as usize - 1], line, "rest offset {at} numbered line {}", loc.line);
            at += line.len() + 1;
        }
    }

    #[test]
    fn nodes_are_cut_with_their_parts_and_the_rest_keeps_its_lines() {
        let text = "[mesh]\nname = \"m\"\n\n[[node]]\nname = \"a\"\n[[node.endpoint]]\naddress = \"x\"\n\n[groups]\ng = [\n  \"a\",\n]\n[[node]] # b\nname = \"b\"\n";
        let c = cut(text).unwrap();
        assert_eq!(
            c.nodes,
            vec![(3, "[[node]]\nname = \"a\"\n[[node.endpoint]]\naddress = \"x\"\n\n"), (12, "[[node]] # b\nname = \"b\"\n")]
        );
        assert_eq!(c.rest, "[mesh]\nname = \"m\"\n\n[groups]\ng = [\n  \"a\",\n]\n");
        assert_eq!(c.gaps, vec![(19, 5), (c.rest.len(), 2)]);
        numbered_as_in_the_file(&c, text);
    }

    #[test]
    fn groups_given_on_one_line_are_cut_and_the_others_stay() {
        let text = "[groups]\ng = [\"a\"] # g\n  h-1 = [\"b\", \"c\"]\nj = [\n\"d\"]\n\"k\" = []\nl.m = []\n[[node]]\nname = \"a\"\n[mesh]\nn = [\"e\"]\n";
        let c = cut(text).unwrap();
        assert_eq!(c.groups, vec![(1, "g = [\"a\"] # g\n"), (2, "  h-1 = [\"b\", \"c\"]\n")]);
        assert_eq!(c.rest, "[groups]\nj = [\n\"d\"]\n\"k\" = []\nl.m = []\n[mesh]\nn = [\"e\"]\n");
        // The two group lines, and the node table: two gaps.
        assert_eq!(c.gaps, vec![(9, 2), (38, 2)]);
        numbered_as_in_the_file(&c, text);
    }

    #[test]
    fn headers_inside_strings_and_arrays_are_not_headers() {
        let text =
            "[[node]]\nname = \"a\"\nx = \"\"\"\n[[node]]\n\"\"\"\ny = [\n[1],\n]\nz = '''\n[groups]\n'''\n[[node]]\nname = 'b # c'\n";
        let c = cut(text).unwrap();
        assert_eq!(c.nodes.len(), 2);
        assert_eq!(c.nodes[1].0, 11);
        // A literal string takes a backslash as it is: `'''a\'''` closes.
        let c = cut("x = '''a\\'''\n[[node]]\nname = \"a\"\n").unwrap();
        assert_eq!(c.nodes, vec![(1, "[[node]]\nname = \"a\"\n")]);
    }

    #[test]
    fn what_the_cut_cannot_name_is_left_to_the_whole_parse() {
        for text in [
            "[ [node] ]\nname = \"a\"\n",
            "[\"node\"]\nname = \"a\"\n",
            "[[\"node\"]]\nname = \"a\"\n",
            "[node]\nname = \"a\"\n",
            "[groups]\n[node.endpoint]\n",
            "x = \"open\n[[node]]\n",
            "x = [\n[[node]]\n",
            "x = \"\"\"\n[[node]]\n",
        ] {
            assert!(cut(text).is_none(), "{text:?}");
        }
    }

    /// The same cut either way, and every table `cut_again` names as one of the text before has
    /// that table's text.
    fn cut_again_is_cut(before: &str, text: &str) -> Result<(), proptest::test_runner::TestCaseError> {
        let Some(first) = cut(before) else { return Ok(()) };
        let whole = cut(text);
        let again = cut_again(before, &first.places, text);
        proptest::prop_assert_eq!(whole.is_some(), again.is_some(), "{:?} -> {:?}", before, text);
        let (Some(whole), Some(again)) = (whole, again) else { return Ok(()) };
        proptest::prop_assert_eq!(&whole.nodes, &again.nodes);
        proptest::prop_assert_eq!(&whole.groups, &again.groups);
        proptest::prop_assert_eq!(&whole.rest, &again.rest);
        proptest::prop_assert_eq!(&whole.gaps, &again.gaps);
        proptest::prop_assert_eq!(&whole.places, &again.places);
        // Empty when it read the whole text again.
        proptest::prop_assert!(again.before.is_empty() || again.before.len() == again.nodes.len());
        for (i, j) in again.before.iter().enumerate() {
            if let Some(j) = j {
                proptest::prop_assert_eq!(again.nodes[i].1, first.nodes[*j].1, "table {} named as {} before", i, j);
            }
        }
        Ok(())
    }

    #[test]
    fn a_cut_again_reads_only_around_the_change_and_finds_every_table_as_before() {
        let before = "[mesh]\nname = \"m\"\n[[node]]\nname = \"a\"\n[[node]]\nname = \"b\"\n[[node.endpoint]]\naddress = \"x\"\n[groups]\ng = [\"a\"]\n[[node]]\nname = \"c\"\n[[node]]\nname = \"d\"\n";
        let text = before.replace("name = \"b\"\n", "name = \"b\"\nhub = true\n\n");
        let first = cut(before).unwrap();
        let again = cut_again(before, &first.places, &text).unwrap();
        // a before the change, c and d after it: known; b re-read.
        assert_eq!(again.before, vec![Some(0), None, Some(2), Some(3)]);
        assert_eq!(again.nodes[3], (14, "[[node]]\nname = \"d\"\n"));
        cut_again_is_cut(before, &text).unwrap();
        // A change that opens a string across the rest: the whole is read again.
        cut_again_is_cut(before, &before.replace("[groups]", "x = \"\"\"\n[groups]")).unwrap();
        cut_again_is_cut(before, "").unwrap();
        cut_again_is_cut(before, before).unwrap();
        // The same line after `[groups]` and after another table is no group's.
        cut_again_is_cut("[groups]\ng = []\nh = []\n", "[mesh]\ng = []\nh = []\n").unwrap();
    }

    #[test]
    fn the_common_start_and_end_are_counted_across_blocks() {
        let (a, b) = ("x".repeat(10_000) + "a" + &"y".repeat(9_000), "x".repeat(10_000) + "bc" + &"y".repeat(9_000));
        assert_eq!(common(a.as_bytes(), b.as_bytes(), false), 10_000);
        assert_eq!(common(a.as_bytes(), b.as_bytes(), true), 9_000);
        assert_eq!(common(a.as_bytes(), a.as_bytes(), true), a.len());
        assert_eq!(common(b"", a.as_bytes(), false), 0);
    }

    proptest::proptest! {
        #[test]
        fn a_cut_again_after_any_edit_is_the_cut(
            blocks in proptest::collection::vec(proptest::sample::select(BLOCKS.to_vec()), 0..30),
            edits in proptest::collection::vec((0usize..30, 0usize..3, proptest::sample::select(BLOCKS.iter().chain(LINES).copied().collect::<Vec<_>>())), 1..4),
        ) {
            let before: String = blocks.concat();
            let mut after = blocks.clone();
            for (at, how, part) in edits {
                let at = at.min(after.len());
                match how {
                    0 => after.insert(at, part),
                    1 if at < after.len() => { after.remove(at); }
                    _ if at < after.len() => after[at] = part,
                    _ => after.push(part),
                }
            }
            cut_again_is_cut(&before, &after.concat())?;
        }
    }

    /// Parts of a `mesh.toml` the cut reads.
    const BLOCKS: &[&str] = &[
        "[[node]]\nname = \"a\"\n",
        "[[node]] # n\nname = \"b\"\n[[node.endpoint]]\naddress = \"x\"\n\n",
        "[[node]]\nname = \"a\"\n",
        "[[node]]\ny = '''[[node]]\n'''\n",
        "[groups]\ng = [\"a\", \"b\"]\nh = [\n\"a\"]\nj = []\n",
        "[mesh]\nname = \"m\"\n",
        "\n",
        "# [[node]]\n",
        "[[route]]\nz = [\"[\"]\n",
    ];

    /// Lines a `mesh.toml` may hold, some of them ones that make the cut give up or read on.
    const LINES: &[&str] = &[
        "[[node]]\n",
        "[[node]] # n\n",
        "name = \"a\"\n",
        "name = \"b\"\n",
        "[[node.endpoint]]\n",
        "address = \"x\"\n",
        "[groups]\n",
        "g = [\"a\", \"b\"]\n",
        "h = [\n",
        "\"a\"]\n",
        "[mesh]\n",
        "[[route]]\n",
        "x = \"\"\"\n",
        "\"\"\"\n",
        "\n",
        "# [[node]]\n",
        "y = '''[[node]]\n",
        "'''\n",
        "z = [\"[\"]\n",
        "[node.x]\n",
        "name = \"c\"",
    ];
}

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
    let mut nodes: Vec<(u32, usize, usize)> = Vec::new();
    let mut groups: Vec<(u32, usize, usize)> = Vec::new();
    let mut state = State::Top;
    let mut depth = 0usize;
    let (mut in_node, mut in_groups) = (false, false);
    let mut offset = 0usize;
    for (number, line) in text.split_inclusive('\n').enumerate() {
        let start = offset;
        offset += line.len();
        let at_top = state == State::Top && depth == 0;
        if at_top {
            match header(line)? {
                Header::Node => {
                    nodes.push((number as u32, start, offset));
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
            nodes.last_mut().expect("in a node").2 = offset;
        }
        scan(line, &mut state, &mut depth)?;
        // A group's members on one line, closed on it: cut. One spread over lines stays.
        if at_top && in_groups && state == State::Top && depth == 0 && bare_key_line(line) {
            groups.push((number as u32, start, offset));
        }
    }
    if state != State::Top || depth != 0 {
        return None;
    }
    let mut cuts: Vec<(usize, usize)> = nodes.iter().chain(&groups).map(|&(_, from, to)| (from, to)).collect();
    cuts.sort_unstable();
    let mut rest = String::new();
    let mut gaps: Vec<(usize, u32)> = Vec::new();
    let mut last = 0;
    for (from, to) in cuts {
        rest.push_str(&text[last..from]);
        let lines = text.as_bytes()[from..to].iter().filter(|&&b| b == b'\n').count() as u32;
        match gaps.last_mut() {
            // Cuts that meet are one gap.
            Some((at, n)) if *at == rest.len() => *n += lines,
            _ => gaps.push((rest.len(), lines)),
        }
        last = to;
    }
    rest.push_str(&text[last..]);
    let texts = |cut: Vec<(u32, usize, usize)>| cut.into_iter().map(|(line, from, to)| (line, &text[from..to])).collect();
    Some(Cut { nodes: texts(nodes), groups: texts(groups), rest, gaps })
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
}

//! `mesh.toml` through the load cache (ADR 0034): the file cut into its node tables and one-line
//! groups, each taken from the cache by its text or parsed alone, and the rest parsed.

use super::super::schema::{parse_document, root, strings_of, Doc, Table};
use super::super::SourceFile;
use super::*;
use crate::diag::Diagnostic;
use crate::load::HeldNode;

/// `mesh.toml` from its cut (ADR 0034): the rest parsed, and each `[[node]]` table taken from
/// `cache` when its text is one parsed before, else parsed alone. `None` when the cut does not
/// read the file, or any part of it has anything to say (a diagnostic): then the whole file is
/// parsed, so that what it says is said exactly as ever.
pub(in crate::load) fn parse_mesh_cut(file: &SourceFile, cache: &mut crate::load::LoadCache) -> Option<Parsed> {
    if cache.file.as_deref() != Some(file.path.as_str()) {
        cache.nodes.clear();
        cache.groups.clear();
        cache.rest = None;
        cache.cut = None;
        cache.names = None;
        cache.file = Some(file.path.clone());
    }
    let cut = match &cache.cut {
        Some((before, places)) => crate::load::segments::cut_again(before, places, &file.text)?,
        None => crate::load::segments::cut(&file.text)?,
    };
    // The rest as parsed before when it is the same text with the same gaps (its places are
    // numbered through them): only a rest that parsed without a word is kept.
    let mut out = match cache.rest.as_ref().filter(|(text, gaps, _)| *text == cut.rest && *gaps == cut.gaps) {
        Some((_, _, parsed)) => parsed.clone(),
        None => {
            let mut diags = Vec::new();
            let rest = SourceFile { path: file.path.clone(), text: cut.rest };
            let (out, has_nodes) = parse_mesh_parts(&rest, cut.gaps.clone(), &mut diags);
            if has_nodes || !diags.is_empty() {
                cache.rest = None;
                return None;
            }
            cache.rest = Some((rest.text, cut.gaps, out.clone()));
            out
        }
    };
    let mut diags = Vec::new();
    // Which table of the load before each one is: the one at the same place when its text is
    // the same (a change of groups or of one node moves no table), else the one with its text.
    let held = &cache.nodes;
    let mut by_text: Option<crate::FastMap<&str, usize>> = None;
    let found: Vec<Option<usize>> = cut
        .nodes
        .iter()
        .enumerate()
        .map(|(i, (_, text))| {
            // Known to the cut (a table outside what it read again), or compared.
            if let Some(j) = cut.before.get(i).copied().flatten() {
                return Some(j);
            }
            if held.get(i).is_some_and(|h| h.text == *text) {
                return Some(i);
            }
            let by_text = by_text.get_or_insert_with(|| held.iter().enumerate().map(|(j, h)| (h.text.as_str(), j)).collect());
            by_text.get(text).copied()
        })
        .collect();
    drop(by_text);
    let mut held = std::mem::take(&mut cache.nodes);
    let mut kept = Vec::with_capacity(cut.nodes.len());
    out.nodes.reserve(cut.nodes.len());
    for ((line, text), found) in cut.nodes.into_iter().zip(found.iter().copied()) {
        let node = match found {
            // Shared as it was placed, or a copy moved to where it now stands.
            Some(j) => {
                cache.hits += 1;
                let HeldNode { line: was, node, .. } = &held[j];
                if *was == line {
                    node.clone()
                } else {
                    let mut moved = crate::decl::Node::clone(node);
                    moved.shift_lines(i64::from(line) - i64::from(*was));
                    std::sync::Arc::new(moved)
                }
            }
            None => {
                let parsed = parse_node_alone(&SourceFile { path: file.path.clone(), text: text.to_string() }, &mut diags);
                let Some(mut node) = parsed.filter(|_| diags.is_empty()) else {
                    // The whole parse says what is wrong; the tables held stay for the next load.
                    cache.nodes = held;
                    return None;
                };
                cache.parsed += 1;
                node.shift_lines(i64::from(line));
                std::sync::Arc::new(node)
            }
        };
        // The text kept is the held one when it is this table's (not copied again).
        let key = match found {
            Some(j) if !held[j].text.is_empty() => std::mem::take(&mut held[j].text),
            _ => text.to_string(),
        };
        // A table of the same text says what it said, wherever it stands.
        let quiet = found.is_some_and(|j| held[j].quiet);
        out.nodes.push(node.clone());
        kept.push(HeldNode { text: key, line, node, quiet });
    }
    if let Some(names) = &mut cache.names {
        if !rename(names, &held, &out.nodes, &found) {
            cache.names = None;
        }
    }
    cache.nodes = kept;
    // The text kept in the buffer of the one before (a fresh 12 MB is as many page faults).
    let mut text = cache.cut.take().map(|(t, _)| t).unwrap_or_default();
    text.clear();
    text.push_str(&file.text);
    cache.cut = Some((text, cut.places));
    if !cut.groups.is_empty() {
        let mut kept = crate::FastMap::with_capacity_and_hasher(cut.groups.len(), Default::default());
        for (line, text) in cut.groups {
            let (key, group) = match cache.groups.remove_entry(text) {
                Some(hit) => hit,
                None => {
                    let group = parse_group_alone(&SourceFile { path: file.path.clone(), text: text.to_string() }, &mut diags)?;
                    if !diags.is_empty() {
                        return None;
                    }
                    (text.to_string(), group)
                }
            };
            let mut placed = group.clone();
            placed.loc.line += line;
            out.groups.push(placed);
            kept.insert(key, group);
        }
        cache.groups = kept;
        // In the order of the table's keys, as the whole parse gives them; a name given twice
        // is the whole parse's to report.
        out.groups.sort_by(|a, b| a.name.cmp(&b.name));
        if out.groups.windows(2).any(|w| w[0].name == w[1].name) {
            return None;
        }
    }
    Some(out)
}

/// The names of `held` (the nodes of the load before) made those of `now`: each table gone takes
/// its name away and each new one adds its own. `false` when the set cannot say what this load's
/// names are without validation looking at them all (a table taken twice, a name given twice or
/// one that is no DNS label).
fn rename(names: &mut crate::FastSet<String>, held: &[HeldNode], now: &[std::sync::Arc<Node>], found: &[Option<usize>]) -> bool {
    let mut used = vec![false; held.len()];
    for &j in found.iter().flatten() {
        if std::mem::replace(&mut used[j], true) {
            return false;
        }
    }
    for (h, _) in held.iter().zip(&used).filter(|(_, used)| !**used) {
        names.remove(h.node.name.as_str());
    }
    for (n, _) in now.iter().zip(found).filter(|(_, found)| found.is_none()) {
        if !crate::load::is_dns_label(&n.name) || !names.insert(n.name.clone()) {
            return false;
        }
    }
    true
}

/// One line of `[groups]` (`name = ["a", "b"]`) as a file of its own: the group, its line 1.
pub(super) fn parse_group_alone(file: &SourceFile, diags: &mut Vec<Diagnostic>) -> Option<Group> {
    let doc = Doc::new(file);
    let table = parse_document(&doc, &file.text, diags)?;
    let [(key, value)] = table.get_ref().iter().collect::<Vec<_>>()[..] else { return None };
    let name = key.get_ref().to_string();
    let members = strings_of(&doc, value, &format!("group `{name}` in [groups]"), diags)?;
    Some(Group { name, members: members.into_iter().map(|(m, _)| m).collect(), loc: doc.loc(&key.span()) })
}

/// One `[[node]]` table (with its parts) as a file of its own: the node, its lines counted from
/// the table's; `None` if the file holds anything else.
pub(super) fn parse_node_alone(file: &SourceFile, diags: &mut Vec<Diagnostic>) -> Option<Node> {
    let doc = Doc::new(file);
    let table = parse_document(&doc, &file.text, diags)?;
    if table.get_ref().len() != 1 {
        return None;
    }
    let top = root(&doc, &table, file.path.as_str(), MESH_FILE_KEYS, diags);
    let [v] = top.tables(&doc, "node", diags)[..] else { return None };
    let t = Table::new(&doc, "[[node]]", v, NODE_KEYS, diags)?;
    parse_node(&doc, &t, diags)
}

//! Reading declarations: TOML text to a validated [`Declaration`], reporting every problem at
//! once with its file, line and column. Unknown keys are refused in every table.
//!
//! Three phases, one file each: the schema walker (`schema`) reads spanned tables and refuses
//! unknown keys; parsing (`parse`) turns each file's tables into the declaration's parts; then
//! the cross-references and the rules that span the whole mesh are checked (`validate`). A
//! `Declaration` comes out only when no phase reported an error.

mod parse;
mod schema;
mod segments;
mod validate;

use crate::decl::Declaration;
use crate::diag::{self, Diagnostic};
use parse::{parse_mesh, parse_module};
use validate::validate;

pub use parse::{MAX_POOL_SIZE, SCHEMA};
pub use validate::{is_dns_label, names_node};

/// One declaration file as text. `path` is how diagnostics name it.
#[derive(Clone, Debug)]
pub struct SourceFile {
    pub path: String,
    pub text: String,
}

/// The result of loading: the declaration when there was no error, and every diagnostic
/// (errors and warnings) sorted by file and line.
#[derive(Debug)]
pub struct Loaded {
    pub declaration: Option<Declaration>,
    pub diagnostics: Vec<Diagnostic>,
}

impl Loaded {
    pub fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.diagnostics.iter().filter(|d| d.is_error())
    }
}

/// Loads a mesh from `mesh.toml` and the module manifests.
pub fn load(mesh: &SourceFile, modules: &[SourceFile]) -> Loaded {
    let mut diags = Vec::new();
    let parsed = parse_mesh(mesh, &mut diags);
    load_parsed(parsed, diags, modules, None, None).0
}

/// The `[[node]]` tables of the `mesh.toml` loaded last, parsed, by their text, and the lines of
/// its `[groups]`: a load through the cache parses only the node tables and group lines whose
/// text it has not seen (and the rest of the file),
/// and gives exactly what [`load`] gives (ADR 0034). It keeps the nodes of the last load only.
#[derive(Default)]
pub struct LoadCache {
    file: Option<String>,
    /// The node tables of the last load, in order. A load takes those the cut knows, compares
    /// each other table with the one at the same place, and looks the rest up by their text.
    nodes: Vec<HeldNode>,
    /// The one-line groups of `[groups]`, by their line's text (lines counted from it).
    groups: crate::FastMap<String, crate::decl::Group>,
    /// The rest of the file (without its node tables and one-line groups) as cut last, with its
    /// gaps, and what it parsed to: a change of nodes or groups leaves it as it was, and it is
    /// not parsed again.
    rest: Option<ParsedRest>,
    /// The text of the last load's `mesh.toml` and where its cut found its parts, so that the
    /// next cut re-reads only around what changed (`segments::cut_again`). It describes the
    /// tables of `nodes`, and is replaced with them.
    cut: Option<(String, segments::Places)>,
    /// What the checks of each node alone read besides the node, when the `quiet` of `nodes`
    /// was found: a node whose table is one of those, under the same, is not checked again.
    checked: Option<validate::NodeContext>,
    /// The names of the nodes of `nodes`, when they are all DNS labels and none is given twice:
    /// edited by the parse as tables come and go, and then not made again by validation.
    names: Option<crate::FastSet<String>>,
    /// Node tables taken from the cache, parsed, and whole-file parses (the cut did not read
    /// the file, or it had something to say), since the cache was made.
    pub hits: usize,
    pub parsed: usize,
    pub whole: usize,
}

/// A node table of the last load: its text, the line it started on, the node as placed there,
/// and whether the checks of the node alone said nothing of it (ADR 0034).
struct HeldNode {
    text: String,
    line: u32,
    node: std::sync::Arc<crate::decl::Node>,
    quiet: bool,
}

/// The rest of `mesh.toml` as cut (its text and gaps) and what it parsed to.
type ParsedRest = (String, Vec<(usize, u32)>, parse::Parsed);

/// [`load`], with `mesh.toml`'s node tables taken from `cache` where their text is unchanged.
pub fn load_cached(mesh: &SourceFile, modules: &[SourceFile], cache: &mut LoadCache) -> Loaded {
    let mut diags = Vec::new();
    // Through the cut, the nodes parsed are those the cache holds, in order.
    let (parsed, cut) = match parse::parse_mesh_cut(mesh, cache) {
        Some(p) => (p, true),
        None => {
            cache.whole += 1;
            (parse_mesh(mesh, &mut diags), false)
        }
    };
    let quiet: Vec<bool> = if cut { cache.nodes.iter().map(|h| h.quiet).collect() } else { Vec::new() };
    let before = cache.checked.as_ref().filter(|_| cut).map(|c| (c, &quiet[..]));
    let names = cache.names.as_ref().filter(|_| cut);
    let (r, checked) = load_parsed(parsed, diags, modules, before, names);
    if let Some(checked) = checked.filter(|_| cut) {
        for (held, quiet) in cache.nodes.iter_mut().zip(checked.quiet) {
            held.quiet = quiet;
        }
        cache.checked = Some(checked.context);
        if cache.names.is_none() && checked.names_quiet {
            cache.names = Some(cache.nodes.iter().map(|h| h.node.name.clone()).collect());
        }
    }
    r
}

fn load_parsed(
    mut parsed: parse::Parsed,
    mut diags: Vec<Diagnostic>,
    modules: &[SourceFile],
    before: Option<(&validate::NodeContext, &[bool])>,
    names: Option<&crate::FastSet<String>>,
) -> (Loaded, Option<validate::Checked>) {
    for file in modules {
        if let Some(m) = parse_module(file, &mut diags) {
            parsed.modules.push(m);
        }
    }
    if let Some(decl) = parsed.finish() {
        let checked = validate(&decl, &mut diags, before, names);
        let has_errors = diags.iter().any(Diagnostic::is_error);
        diag::sort(&mut diags);
        return (Loaded { declaration: (!has_errors).then_some(decl), diagnostics: diags }, Some(checked));
    }
    diag::sort(&mut diags);
    (Loaded { declaration: None, diagnostics: diags }, None)
}

/// The file of a declaration directory that holds the mesh; the others are `modules/NAME.toml`.
pub const MESH_FILE: &str = "mesh.toml";

/// Loads a declaration given as its files, each named relative to the declaration directory
/// (`mesh.toml`, `modules/NAME.toml`), in any order: the modules are read in name order, and a
/// missing `mesh.toml` loads as an empty one (which reports what it lacks). `display` names a
/// file in diagnostics (the directory it was read from, or nothing).
pub fn load_relative(files: &[(String, String)], display: impl Fn(&str) -> String) -> Loaded {
    let (mesh, modules) = relative(files, display);
    load(&mesh, &modules)
}

/// [`load_relative`] through a [`LoadCache`].
pub fn load_relative_cached(files: &[(String, String)], display: impl Fn(&str) -> String, cache: &mut LoadCache) -> Loaded {
    let (mesh, modules) = relative(files, display);
    load_cached(&mesh, &modules, cache)
}

fn relative(files: &[(String, String)], display: impl Fn(&str) -> String) -> (SourceFile, Vec<SourceFile>) {
    let file = |(p, t): &(String, String)| SourceFile { path: display(p), text: t.clone() };
    let mesh = files.iter().find(|(p, _)| p == MESH_FILE).map(file).unwrap_or(SourceFile { path: display(MESH_FILE), text: String::new() });
    let mut modules: Vec<&(String, String)> = files.iter().filter(|(p, _)| p != MESH_FILE).collect();
    modules.sort_by(|a, b| a.0.cmp(&b.0));
    (mesh, modules.into_iter().map(file).collect())
}

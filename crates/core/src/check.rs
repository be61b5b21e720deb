//! What `trellis check` reports of a declaration given as its files: every diagnostic of loading
//! it and, once it loads, those of the mesh it declares (`explain::check`: failing policy tests,
//! pairs that may talk but have no path, rules that admit nothing), in the one order. The offline
//! `trellis check DIR` and the controller's apply both take it from here, so what one refuses the
//! other refuses.

use crate::decl::Declaration;
use crate::diag::{self, Diagnostic};
use crate::{explain, load};

/// What `check` found: the declaration when it loaded, whose mesh may still have errors among the
/// diagnostics, and every diagnostic (errors and warnings) sorted by file and line.
#[derive(Debug)]
pub struct Checked {
    pub declaration: Option<Declaration>,
    pub diagnostics: Vec<Diagnostic>,
}

impl Checked {
    /// How many of the diagnostics are errors: none, and the declaration may be applied.
    pub fn errors(&self) -> usize {
        self.diagnostics.iter().filter(|d| d.is_error()).count()
    }
}

/// Loads the files as `load::load_relative` does (`display` names a file in diagnostics) and
/// checks the mesh they declare.
pub fn check(files: &[(String, String)], display: impl Fn(&str) -> String) -> Checked {
    let load::Loaded { declaration, mut diagnostics } = load::load_relative(files, display);
    if let Some(decl) = &declaration {
        diagnostics.extend(explain::check(decl));
        diag::sort(&mut diagnostics);
    }
    Checked { declaration, diagnostics }
}

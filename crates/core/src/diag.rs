//! Diagnostics: one clear sentence about one thing at one place in a declaration file.

use std::fmt;
use std::sync::Arc;

/// Where something was declared: a file and a 1-based line and column.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Loc {
    pub file: Arc<str>,
    pub line: u32,
    pub col: u32,
}

impl fmt::Display for Loc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file, self.line, self.col)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Severity {
    Error,
    Warning,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
        }
    }
}

/// One problem found in a declaration. Displayed as `FILE:LINE:COL: error: message`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    pub severity: Severity,
    pub loc: Loc,
    pub message: String,
}

impl Diagnostic {
    pub fn error(loc: &Loc, message: impl Into<String>) -> Self {
        Diagnostic { severity: Severity::Error, loc: loc.clone(), message: message.into() }
    }

    pub fn warning(loc: &Loc, message: impl Into<String>) -> Self {
        Diagnostic { severity: Severity::Warning, loc: loc.clone(), message: message.into() }
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.loc, self.severity.as_str(), self.message)
    }
}

/// Sorts diagnostics by file, line and column, errors before warnings at the same place,
/// and drops exact repeats.
pub fn sort(diags: &mut Vec<Diagnostic>) {
    diags.sort_by(|a, b| (&a.loc, a.severity, &a.message).cmp(&(&b.loc, b.severity, &b.message)));
    diags.dedup();
}

/// Turns byte offsets of one source text into line and column numbers.
pub(crate) struct LineIndex {
    file: Arc<str>,
    starts: Vec<usize>,
    text_len: usize,
}

impl LineIndex {
    pub(crate) fn new(file: Arc<str>, text: &str) -> Self {
        let mut starts = vec![0];
        starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        LineIndex { file, starts, text_len: text.len() }
    }

    pub(crate) fn loc(&self, text: &str, offset: usize) -> Loc {
        let offset = offset.min(self.text_len);
        let line = self.starts.partition_point(|&s| s <= offset) - 1;
        let start = self.starts[line];
        let col = text.get(start..offset).map_or(offset - start, |s| s.chars().count()) + 1;
        Loc { file: self.file.clone(), line: line as u32 + 1, col: col as u32 }
    }
}

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
    /// Lines taken out of the text, for a text that is a file with whole lines left out: at
    /// each offset (a line start), how many lines were left out before it, counted from the
    /// file's start. Empty for a whole file.
    gaps: Vec<(usize, u32)>,
}

impl LineIndex {
    pub(crate) fn new(file: Arc<str>, text: &str) -> Self {
        Self::with_gaps(file, text, Vec::new())
    }

    /// The index of a file from which whole lines were left out: `gaps` gives, in order, each
    /// offset of `text` where lines were left out and how many, so that places are numbered as
    /// in the file.
    pub(crate) fn with_gaps(file: Arc<str>, text: &str, gaps: Vec<(usize, u32)>) -> Self {
        let mut starts = vec![0];
        starts.extend(text.match_indices('\n').map(|(i, _)| i + 1));
        let mut before = 0;
        let gaps = gaps
            .into_iter()
            .map(|(at, lines)| {
                before += lines;
                (at, before)
            })
            .collect();
        LineIndex { file, starts, text_len: text.len(), gaps }
    }

    pub(crate) fn loc(&self, text: &str, offset: usize) -> Loc {
        let offset = offset.min(self.text_len);
        let line = self.starts.partition_point(|&s| s <= offset) - 1;
        let start = self.starts[line];
        let col = text.get(start..offset).map_or(offset - start, |s| s.chars().count()) + 1;
        let left_out = self.gaps.partition_point(|&(at, _)| at <= start).checked_sub(1).map_or(0, |g| self.gaps[g].1);
        Loc { file: self.file.clone(), line: line as u32 + 1 + left_out, col: col as u32 }
    }
}

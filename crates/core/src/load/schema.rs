//! The schema walker over `toml`'s spanned tables: a table hands out the keys the schema knows,
//! typed, and refuses every other key, each problem reported with its file, line and column.

use std::ops::Range;
use std::sync::Arc;

use toml::de::{DeTable, DeValue};
use toml::Spanned;

use super::SourceFile;
use crate::diag::{Diagnostic, LineIndex, Loc};

/// One file being read: its name for diagnostics, its text, and where its lines start.
pub(super) struct Doc<'a> {
    file: Arc<str>,
    text: &'a str,
    lines: LineIndex,
}

impl<'a> Doc<'a> {
    pub(super) fn new(file: &'a SourceFile) -> Self {
        let name: Arc<str> = Arc::from(file.path.as_str());
        Doc { lines: LineIndex::new(name.clone(), &file.text), file: name, text: &file.text }
    }

    /// A file from which whole lines were left out, its places numbered as in the file (see
    /// `LineIndex::with_gaps`).
    pub(super) fn with_gaps(file: &'a SourceFile, gaps: Vec<(usize, u32)>) -> Self {
        let name: Arc<str> = Arc::from(file.path.as_str());
        Doc { lines: LineIndex::with_gaps(name.clone(), &file.text, gaps), file: name, text: &file.text }
    }

    pub(super) fn loc(&self, span: &Range<usize>) -> Loc {
        self.lines.loc(self.text, span.start)
    }

    /// The whole file, for problems that belong to no one line.
    pub(super) fn start(&self) -> Loc {
        Loc { file: self.file.clone(), line: 1, col: 1 }
    }
}

pub(super) type Value<'i> = Spanned<DeValue<'i>>;

/// Reads one table: hands out the keys the schema knows and, in `finish`, refuses the rest.
pub(super) struct Table<'t, 'i> {
    pub(super) what: String,
    table: &'t DeTable<'i>,
    pub(super) loc: Loc,
    allowed: &'static [&'static str],
}

impl<'t, 'i> Table<'t, 'i> {
    pub(super) fn new(
        doc: &Doc,
        what: impl Into<String>,
        value: &'t Value<'i>,
        allowed: &'static [&'static str],
        diags: &mut Vec<Diagnostic>,
    ) -> Option<Self> {
        let what = what.into();
        match value.get_ref() {
            DeValue::Table(table) => {
                let t = Table { what, table, loc: doc.loc(&value.span()), allowed };
                t.refuse_unknown(doc, diags);
                Some(t)
            }
            other => {
                diags.push(Diagnostic::error(&doc.loc(&value.span()), format!("{what} must be a table, found {}", other.type_str())));
                None
            }
        }
    }

    fn refuse_unknown(&self, doc: &Doc, diags: &mut Vec<Diagnostic>) {
        for key in self.table.keys() {
            if !self.allowed.contains(&key.get_ref().as_ref()) {
                let allowed = if self.allowed.is_empty() {
                    "no keys are allowed there".to_string()
                } else {
                    format!("allowed keys: {}", self.allowed.join(", "))
                };
                diags
                    .push(Diagnostic::error(&doc.loc(&key.span()), format!("unknown key `{}` in {}; {allowed}", key.get_ref(), self.what)));
            }
        }
    }

    pub(super) fn get(&self, key: &str) -> Option<&'t Value<'i>> {
        debug_assert!(self.allowed.contains(&key), "schema does not list {key}");
        self.table.get(key)
    }

    pub(super) fn missing(&self, key: &str, diags: &mut Vec<Diagnostic>) {
        diags.push(Diagnostic::error(&self.loc, format!("{} is missing the required key `{key}`", self.what)));
    }

    pub(super) fn str(&self, doc: &Doc, key: &str, diags: &mut Vec<Diagnostic>) -> Option<(String, Loc)> {
        let v = self.get(key)?;
        match v.get_ref() {
            DeValue::String(s) => Some((s.to_string(), doc.loc(&v.span()))),
            other => {
                diags.push(type_error(doc, v, key, &self.what, "a string", other));
                None
            }
        }
    }

    pub(super) fn required_str(&self, doc: &Doc, key: &str, diags: &mut Vec<Diagnostic>) -> Option<(String, Loc)> {
        if self.get(key).is_none() {
            self.missing(key, diags);
            return None;
        }
        self.str(doc, key, diags)
    }

    pub(super) fn bool(&self, doc: &Doc, key: &str, diags: &mut Vec<Diagnostic>) -> Option<bool> {
        let v = self.get(key)?;
        match v.get_ref() {
            DeValue::Boolean(b) => Some(*b),
            other => {
                diags.push(type_error(doc, v, key, &self.what, "true or false", other));
                None
            }
        }
    }

    pub(super) fn int(&self, doc: &Doc, key: &str, diags: &mut Vec<Diagnostic>) -> Option<(i64, Loc)> {
        let v = self.get(key)?;
        let loc = doc.loc(&v.span());
        match v.get_ref() {
            DeValue::Integer(i) => match i64::from_str_radix(&i.as_str().replace('_', ""), i.radix()) {
                Ok(n) => Some((n, loc)),
                Err(_) => {
                    diags.push(Diagnostic::error(&loc, format!("`{key}` in {} is out of range", self.what)));
                    None
                }
            },
            other => {
                diags.push(type_error(doc, v, key, &self.what, "an integer", other));
                None
            }
        }
    }

    /// An array of strings, each with its location. Absent means empty.
    pub(super) fn strings(&self, doc: &Doc, key: &str, diags: &mut Vec<Diagnostic>) -> Option<Vec<(String, Loc)>> {
        let v = self.get(key)?;
        strings_of(doc, v, &format!("`{key}` in {}", self.what), diags)
    }

    /// An array of tables (`[[key]]`), or nothing.
    pub(super) fn tables(&self, doc: &Doc, key: &str, diags: &mut Vec<Diagnostic>) -> Vec<&'t Value<'i>> {
        let Some(v) = self.get(key) else {
            return Vec::new();
        };
        match v.get_ref() {
            DeValue::Array(items) => items.iter().collect(),
            other => {
                diags.push(type_error(doc, v, key, &self.what, "an array of tables", other));
                Vec::new()
            }
        }
    }
}

/// An array of strings, each with its location; `what` names it in diagnostics.
pub(super) fn strings_of(doc: &Doc, v: &Value, what: &str, diags: &mut Vec<Diagnostic>) -> Option<Vec<(String, Loc)>> {
    match v.get_ref() {
        DeValue::Array(items) => {
            let mut out = Vec::new();
            for item in items.iter() {
                match item.get_ref() {
                    DeValue::String(s) => out.push((s.to_string(), doc.loc(&item.span()))),
                    other => diags.push(Diagnostic::error(
                        &doc.loc(&item.span()),
                        format!("{what} must hold only strings, found {}", other.type_str()),
                    )),
                }
            }
            Some(out)
        }
        other => {
            diags.push(Diagnostic::error(&doc.loc(&v.span()), format!("{what} must be an array of strings, found {}", other.type_str())));
            None
        }
    }
}

/// A table whose keys are names the operator chooses, such as `[networks]`.
pub(super) fn map_of<'t, 'i>(doc: &Doc, what: &str, v: &'t Value<'i>, diags: &mut Vec<Diagnostic>) -> Option<&'t DeTable<'i>> {
    match v.get_ref() {
        DeValue::Table(t) => Some(t),
        other => {
            diags.push(Diagnostic::error(&doc.loc(&v.span()), format!("{what} must be a table, found {}", other.type_str())));
            None
        }
    }
}

/// The error for a key whose value has the wrong type.
fn type_error(doc: &Doc, v: &Value, key: &str, what: &str, want: &str, found: &DeValue) -> Diagnostic {
    Diagnostic::error(&doc.loc(&v.span()), format!("`{key}` in {what} must be {want}, found {}", found.type_str()))
}

/// A file's text as a spanned table, or the TOML error where it is.
pub(super) fn parse_document<'i>(doc: &Doc, text: &'i str, diags: &mut Vec<Diagnostic>) -> Option<Spanned<DeTable<'i>>> {
    match DeTable::parse(text) {
        Ok(t) => Some(t),
        Err(e) => {
            let loc = e.span().map_or_else(|| doc.start(), |s| doc.loc(&s));
            diags.push(Diagnostic::error(&loc, format!("invalid TOML: {}", e.message().trim_end_matches('\n'))));
            None
        }
    }
}

/// A file's top-level table, its unknown keys refused.
pub(super) fn root<'t, 'i>(
    doc: &Doc,
    table: &'t Spanned<DeTable<'i>>,
    what: &str,
    allowed: &'static [&'static str],
    diags: &mut Vec<Diagnostic>,
) -> Table<'t, 'i> {
    let t = Table { what: what.to_string(), table: table.get_ref(), loc: doc.start(), allowed };
    t.refuse_unknown(doc, diags);
    t
}

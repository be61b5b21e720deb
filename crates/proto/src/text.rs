//! Showing stored strings to people. A node name, an audit detail or an agent's error comes from
//! the network; printed raw, a newline or an escape sequence in it could forge a row of a table
//! ("node approved db-1 admin") or rewrite the terminal. Every human-readable output passes such
//! strings through [`printable`] (JSON output stays exact: serde escapes control characters).

use std::borrow::Cow;

/// Characters that would move the cursor, end the line or reorder text on a terminal.
fn unsafe_char(c: char) -> bool {
    c.is_control() || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with every control character (C0, DEL, C1) and bidirectional override written as an
/// escape (`\n`, `\t`, `\r`, `\u{1b}`), so that it stays on its line and means what it shows.
pub fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(unsafe_char) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if unsafe_char(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn control_characters_and_bidi_overrides_are_escaped_and_the_rest_is_kept() {
        assert_eq!(printable("db-1 ok"), "db-1 ok");
        assert_eq!(printable("héllo ✓"), "héllo ✓");
        assert_eq!(printable("x\n    7  node approved db-1\u{1b}[2K"), "x\\n    7  node approved db-1\\u{1b}[2K");
        assert_eq!(printable("a\tb\rc\u{7f}\u{9b}"), "a\\tb\\rc\\u{7f}\\u{9b}");
        assert_eq!(printable("evil\u{202e}txt.exe"), "evil\\u{202e}txt.exe");
    }
}

//! Showing stored strings to people. A node name, an audit detail or an agent's error comes from
//! the network; printed raw, a newline or an escape sequence in it could forge a row of a table
//! ("node approved db-1 admin") or rewrite the terminal. Every human-readable output passes such
//! strings through [`printable`] (JSON output stays exact: serde escapes control characters).
//! Times are shown to people as [`date`]s, never as Unix seconds.

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

/// Unix seconds as an RFC 3339 date in UTC (`2026-12-01T10:00:00Z`), for what people read: the
/// same form in tables, in the CLI's sentences and in the agent's.
pub fn date(unix: i64) -> String {
    let days = unix.div_euclid(86400);
    let secs = unix.rem_euclid(86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs % 3600 / 60, secs % 60)
}

/// Seconds as people say them: `45 s`, `12 min`, `3 h`, `2 d` (rounded down).
pub fn duration(secs: i64) -> String {
    let s = secs.max(0);
    match s {
        0..120 => format!("{s} s"),
        120..7200 => format!("{} min", s / 60),
        7200..172_800 => format!("{} h", s / 3600),
        _ => format!("{} d", s / 86400),
    }
}

#[cfg(test)]
mod tests {
    use super::{date, duration, printable};

    #[test]
    fn durations_are_said_in_the_largest_unit_that_keeps_two_figures() {
        assert_eq!(duration(-3), "0 s");
        assert_eq!(duration(45), "45 s");
        assert_eq!(duration(119), "119 s");
        assert_eq!(duration(720), "12 min");
        assert_eq!(duration(3 * 3600 + 59), "3 h");
        assert_eq!(duration(2 * 86400 + 1), "2 d");
    }

    #[test]
    fn dates_are_rfc3339_in_utc() {
        assert_eq!(date(0), "1970-01-01T00:00:00Z");
        assert_eq!(date(1_796_000_000), "2026-11-30T00:53:20Z");
        assert_eq!(date(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(date(1_796_194_702), "2026-12-02T06:58:22Z");
        assert_eq!(date(-1), "1969-12-31T23:59:59Z");
    }

    #[test]
    fn control_characters_and_bidi_overrides_are_escaped_and_the_rest_is_kept() {
        assert_eq!(printable("db-1 ok"), "db-1 ok");
        assert_eq!(printable("héllo ✓"), "héllo ✓");
        assert_eq!(printable("x\n    7  node approved db-1\u{1b}[2K"), "x\\n    7  node approved db-1\\u{1b}[2K");
        assert_eq!(printable("a\tb\rc\u{7f}\u{9b}"), "a\\tb\\rc\\u{7f}\\u{9b}");
        assert_eq!(printable("evil\u{202e}txt.exe"), "evil\\u{202e}txt.exe");
    }
}

//! The two text formats both `/metrics` endpoints answer in, chosen from the scraper's `Accept`
//! header: OpenMetrics 1.0.0 when it asks for it, the classic Prometheus text format 0.0.4
//! otherwise (what `promtool check metrics`, older Prometheus servers and a plain `curl` read).
//! The registries encode OpenMetrics only (prometheus-client); [`classic`] rewrites that text.

/// A media type `/metrics` answers in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `application/openmetrics-text; version=1.0.0`, as the registries encode it.
    OpenMetrics,
    /// `text/plain; version=0.0.4`, the classic Prometheus text format.
    Prometheus,
}

pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const PROMETHEUS: &str = "text/plain; version=0.0.4; charset=utf-8";

impl Format {
    /// OpenMetrics when `accept` names it (version 1.0.0 or none) with a quality at least that of
    /// the classic format (`text/plain` of version 0.0.4 or none, `text/*`, `*/*`); the classic
    /// format otherwise, also without the header. Prometheus asks for OpenMetrics first.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let (mut openmetrics, mut text) = (0.0f32, 0.0f32);
        for range in accept.unwrap_or_default().split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
            let (mut q, mut version) = (1.0f32, None);
            for p in parts {
                let Some((k, v)) = p.split_once('=') else { continue };
                let v = v.trim().trim_matches('"');
                match k.trim().to_ascii_lowercase().as_str() {
                    "q" => q = v.parse().ok().filter(|q: &f32| (0.0..=1.0).contains(q)).unwrap_or(0.0),
                    "version" => version = Some(v.to_string()),
                    _ => {}
                }
            }
            let version = version.as_deref();
            match media.as_str() {
                "application/openmetrics-text" if matches!(version, None | Some("1.0.0")) => openmetrics = openmetrics.max(q),
                "text/plain" if matches!(version, None | Some("0.0.4")) => text = text.max(q),
                "text/*" | "*/*" => text = text.max(q),
                _ => {}
            }
        }
        if openmetrics > 0.0 && openmetrics >= text {
            Format::OpenMetrics
        } else {
            Format::Prometheus
        }
    }

    /// The `Content-Type` of an answer in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => OPENMETRICS,
            Format::Prometheus => PROMETHEUS,
        }
    }

    /// A registry's OpenMetrics text in this format.
    pub fn render(self, openmetrics: String) -> String {
        match self {
            Format::OpenMetrics => openmetrics,
            Format::Prometheus => classic(&openmetrics),
        }
    }
}

/// OpenMetrics text rewritten in the classic Prometheus text format: a counter family is named
/// as its `_total` samples are, an info family as its `_info` sample (typed gauge), `unknown` is
/// `untyped`, a stateset a gauge, a gauge histogram a histogram (`_gcount`, `_gsum` as `_count`,
/// `_sum`); `_created` samples, `# UNIT`, `# EOF` and exemplars are dropped (the classic format
/// has none of them), timestamps turn from seconds into milliseconds, and `HELP` text keeps only
/// the escapes the classic format knows (`\\`, `\n`).
pub fn classic(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    // The family being read: its OpenMetrics name and type.
    let mut family: Option<(String, String)> = None;
    let mut help: Option<(String, String)> = None;
    let flush_help = |out: &mut String, help: &mut Option<(String, String)>| {
        if let Some((name, text)) = help.take() {
            out.push_str(&format!("# HELP {name} {}\n", classic_help(&text)));
        }
    };
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            flush_help(&mut out, &mut help);
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name.to_string(), text.to_string()));
            family = None;
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (classic_name, classic_kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "gauge" | "stateset" => (name.to_string(), "gauge"),
                "histogram" | "gaugehistogram" => (name.to_string(), "histogram"),
                "summary" => (name.to_string(), "summary"),
                _ => (name.to_string(), "untyped"),
            };
            match help.take() {
                Some((n, text)) if n == name => out.push_str(&format!("# HELP {classic_name} {}\n", classic_help(&text))),
                other => {
                    help = other;
                    flush_help(&mut out, &mut help);
                }
            }
            out.push_str(&format!("# TYPE {classic_name} {classic_kind}\n"));
            family = Some((name.to_string(), kind.to_string()));
        } else if line.starts_with('#') || line.trim().is_empty() {
            // `# UNIT`, `# EOF`: not in the classic format.
        } else {
            flush_help(&mut out, &mut help);
            if let Some(sample) = classic_sample(line, family.as_ref()) {
                out.push_str(&sample);
                out.push('\n');
            }
        }
    }
    flush_help(&mut out, &mut help);
    out
}

/// OpenMetrics escapes `"` in HELP text; the classic format knows only `\\` and `\n`.
fn classic_help(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match (c, c == '\\') {
            (_, true) => match chars.next() {
                Some('"') => out.push('"'),
                Some(n) => {
                    out.push('\\');
                    out.push(n);
                }
                None => out.push_str("\\\\"),
            },
            (c, false) => out.push(c),
        }
    }
    out
}

/// One sample line: `name{labels} value [timestamp] [# exemplar]`, or `None` when the classic
/// format has no such sample (`_created`).
fn classic_sample(line: &str, family: Option<&(String, String)>) -> Option<String> {
    let name_end = line.find(['{', ' ']).unwrap_or(line.len());
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    let mut labels = "";
    if rest.starts_with('{') {
        // The closing brace outside every quoted label value (which may hold `}` or `#`).
        let (mut quoted, mut escaped, mut end) = (false, false, None);
        for (i, c) in rest.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' if quoted => escaped = true,
                '"' => quoted = !quoted,
                '}' if !quoted => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let end = end.unwrap_or(rest.len() - 1);
        labels = &rest[..=end];
        rest = &rest[end + 1..];
    }
    let mut fields = rest.split_whitespace();
    let value = fields.next().unwrap_or_default();
    let timestamp = fields.next().filter(|t| *t != "#");
    let mut name = name.to_string();
    if let Some((family, kind)) = family {
        if let Some(suffix) = name.strip_prefix(family.as_str()) {
            match (kind.as_str(), suffix) {
                ("counter" | "histogram" | "gaugehistogram" | "summary", "_created") => return None,
                ("gaugehistogram", "_gcount") => name = format!("{family}_count"),
                ("gaugehistogram", "_gsum") => name = format!("{family}_sum"),
                _ => {}
            }
        }
    }
    let mut out = format!("{name}{labels} {value}");
    if let Some(ms) = timestamp.and_then(|t| t.parse::<f64>().ok()) {
        out.push_str(&format!(" {}", (ms * 1000.0).round() as i64));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::{classic, Format};

    #[test]
    fn openmetrics_only_when_the_scraper_asks_for_it() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        for (accept, expect) in [
            (Some(prometheus), Format::OpenMetrics),
            (Some("application/openmetrics-text; version=1.0.0; charset=utf-8"), Format::OpenMetrics),
            (Some("Application/OpenMetrics-Text"), Format::OpenMetrics),
            (Some("text/plain;version=0.0.4;q=0.5,application/openmetrics-text;q=0.9"), Format::OpenMetrics),
            (None, Format::Prometheus),
            (Some(""), Format::Prometheus),
            (Some("*/*"), Format::Prometheus),
            (Some("text/plain; version=0.0.4"), Format::Prometheus),
            (Some("text/plain;version=0.0.4;q=1,application/openmetrics-text;q=0.5"), Format::Prometheus),
            (Some("application/openmetrics-text;q=0.3,*/*"), Format::Prometheus),
            (Some("application/openmetrics-text;q=0"), Format::Prometheus),
            (Some("application/openmetrics-text;version=0.0.1"), Format::Prometheus),
            (Some("application/json"), Format::Prometheus),
        ] {
            assert_eq!(Format::negotiate(accept), expect, "{accept:?}");
        }
        assert_eq!(Format::OpenMetrics.content_type(), "application/openmetrics-text; version=1.0.0; charset=utf-8");
        assert_eq!(Format::Prometheus.content_type(), "text/plain; version=0.0.4; charset=utf-8");
    }

    #[test]
    fn openmetrics_text_becomes_the_classic_format() {
        let om = concat!(
            "# HELP t_enrolments Enrolments by \\\"result\\\" \\\\ code.\n",
            "# TYPE t_enrolments counter\n",
            "t_enrolments_total{result=\"a} # \\\"b\"} 2 # {trace=\"x\"} 1.0\n",
            "t_enrolments_created{result=\"a\"} 1700000000.5\n",
            "# HELP t_sent_bytes Bytes sent.\n",
            "# TYPE t_sent_bytes counter\n",
            "# UNIT t_sent_bytes bytes\n",
            "t_sent_bytes_total 7\n",
            "# HELP t_run_seconds Run time.\n",
            "# TYPE t_run_seconds histogram\n",
            "# UNIT t_run_seconds seconds\n",
            "t_run_seconds_sum 0.5\n",
            "t_run_seconds_count 1\n",
            "t_run_seconds_bucket{le=\"+Inf\"} 1\n",
            "# HELP t_up Up.\n",
            "# TYPE t_up gauge\n",
            "t_up 1 1700000000.25\n",
            "# HELP t_build Build.\n",
            "# TYPE t_build info\n",
            "t_build_info{version=\"1\"} 1\n",
            "# HELP t_odd Odd.\n",
            "# TYPE t_odd unknown\n",
            "t_odd NaN\n",
            "# EOF\n",
        );
        let expect = concat!(
            "# HELP t_enrolments_total Enrolments by \"result\" \\\\ code.\n",
            "# TYPE t_enrolments_total counter\n",
            "t_enrolments_total{result=\"a} # \\\"b\"} 2\n",
            "# HELP t_sent_bytes_total Bytes sent.\n",
            "# TYPE t_sent_bytes_total counter\n",
            "t_sent_bytes_total 7\n",
            "# HELP t_run_seconds Run time.\n",
            "# TYPE t_run_seconds histogram\n",
            "t_run_seconds_sum 0.5\n",
            "t_run_seconds_count 1\n",
            "t_run_seconds_bucket{le=\"+Inf\"} 1\n",
            "# HELP t_up Up.\n",
            "# TYPE t_up gauge\n",
            "t_up 1 1700000000250\n",
            "# HELP t_build_info Build.\n",
            "# TYPE t_build_info gauge\n",
            "t_build_info{version=\"1\"} 1\n",
            "# HELP t_odd Odd.\n",
            "# TYPE t_odd untyped\n",
            "t_odd NaN\n",
        );
        assert_eq!(classic(om), expect);
        assert_eq!(Format::OpenMetrics.render(om.to_string()), om, "OpenMetrics is answered as encoded");
    }
}

//! The agent's log: `tracing` events to standard error, as text or one JSON object a line,
//! filtered by `RUST_LOG` (tracing-subscriber's `EnvFilter` syntax; `default` when unset).

use anyhow::{Context, Result};
use tracing_subscriber::EnvFilter;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line an event, with its spans' fields
    #[default]
    Text,
    /// One JSON object a line, with the current span and its parents
    Json,
}

/// Installs the subscriber for this process; a `RUST_LOG` that does not parse is refused,
/// naming it.
pub fn init(format: LogFormat, default: &str) -> Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => EnvFilter::try_new(&v).with_context(|| format!("RUST_LOG={v:?} is not a log filter"))?,
        _ => EnvFilter::new(default),
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(true).init(),
    }
    Ok(())
}

//! The daemons' log (`trellis serve`, `trellis-agent run`): `tracing` events to standard error,
//! as text or one JSON object a line, filtered by `RUST_LOG` (tracing-subscriber's `EnvFilter`
//! syntax; the daemon's default when unset). Only with the `log` feature, which both binaries
//! take.

use tracing_subscriber::filter::ParseError;
use tracing_subscriber::EnvFilter;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One human-readable line an event, with its spans' fields
    #[default]
    Text,
    /// One JSON object a line, with the current span and its parents
    Json,
}

/// Why the log cannot be installed. The filter's own sentence is part of the message (and so no
/// `source`), as the daemons print it before they have a log.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("RUST_LOG={value:?} is not a log filter: {error}")]
    Filter { value: String, error: ParseError },
}

/// Installs the subscriber for this process, filtering by `RUST_LOG` or else by `default`; a
/// `RUST_LOG` that does not parse is refused, naming it.
pub fn init(format: LogFormat, default: &str) -> Result<(), LogError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => EnvFilter::try_new(&v).map_err(|error| LogError::Filter { value: v.clone(), error })?,
        _ => EnvFilter::new(default),
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(true).init(),
    }
    Ok(())
}

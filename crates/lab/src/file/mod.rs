//! The lab file (`lab/NAME.toml`): nets, hosts, expectations and the steps taken after them,
//! and its validation against itself and against the declarations it runs.
//!
//! Three phases, one file each, as `trellis_core::load` reads declarations: the tables serde
//! reads and what the lab asks of them (`schema`); the text read into them, every error at
//! file:line:col, and pools' hosts expanded (`parse`); then what they say of each other, and
//! later of the declarations, checked (`validate`). A `LabFile` comes out of `load` only when
//! every check passed.

mod parse;
mod schema;
mod validate;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

pub use parse::MAX_POOL_HOSTS;
pub use schema::{Action, Expect, Host, LabFile, LabHead, Mapping, Net, Outcome, Proto, Role, Step};
pub use validate::{check_endpoints, check_pools, check_renewal, MAX_RENEW_LIFETIME_SECS};

/// Reads and validates a lab file; returns it with the declaration directory it names (relative
/// to the lab file).
pub fn load(file: &Path) -> Result<(LabFile, PathBuf)> {
    let text = std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    parse(&text, file)
}

/// Validates a lab file's text; `file` names it in errors and is where the declaration
/// directory it names is found from. No IO.
pub fn parse(text: &str, file: &Path) -> Result<(LabFile, PathBuf)> {
    let lab = parse::read(text, file)?;
    let decl = file.parent().unwrap_or(Path::new(".")).join(&lab.lab.declaration);
    validate::validate(file, &lab)?;
    Ok((lab, decl))
}

#[cfg(test)]
mod tests;

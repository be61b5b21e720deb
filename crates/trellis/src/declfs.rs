//! Reading a declaration directory (`mesh.toml` and `modules/*.toml`) from disk: the files as
//! they are sent to the controller, loaded, and checked as `trellis check` and the controller's
//! apply check them (`trellis_core::check`).

use std::path::Path;

use anyhow::Result;
use trellis_core::{Checked, Loaded};

/// `DIR/mesh.toml` and every `DIR/modules/*.toml`, in name order, each named relative to `DIR`.
pub fn files(dir: &Path) -> Result<Vec<(String, String)>> {
    Ok(trellis_client::declaration_files(dir)?)
}

/// Reads and loads a declaration directory; diagnostics name the files under `dir`.
pub fn read(dir: &Path) -> Result<Loaded> {
    let files = files(dir)?;
    Ok(trellis_core::load_relative(&files, under(dir)))
}

/// Reads a declaration directory and checks it as the controller checks what `trellis apply`
/// sends; diagnostics name the files under `dir`.
pub fn check(dir: &Path) -> Result<Checked> {
    let files = files(dir)?;
    Ok(trellis_core::check(&files, under(dir)))
}

/// How diagnostics name a file of the directory: under `dir`.
fn under(dir: &Path) -> impl Fn(&str) -> String + '_ {
    |p| dir.join(p).display().to_string()
}

//! Reading a declaration directory (`mesh.toml` and `modules/*.toml`) from disk: the files as
//! they are sent to the controller, and loaded as `check` loads them.

use std::path::Path;

use anyhow::Result;
use trellis_core::Loaded;

/// `DIR/mesh.toml` and every `DIR/modules/*.toml`, in name order, each named relative to `DIR`.
pub fn files(dir: &Path) -> Result<Vec<(String, String)>> {
    Ok(trellis_client::declaration_files(dir)?)
}

/// Reads and loads a declaration directory; diagnostics name the files under `dir`.
pub fn read(dir: &Path) -> Result<Loaded> {
    let files = files(dir)?;
    Ok(trellis_core::load_relative(&files, |p| dir.join(p).display().to_string()))
}

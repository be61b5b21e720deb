//! Files made from the command line's own definition for packages: shell completions (bash, zsh,
//! fish) and man pages (one for the command and one for each subcommand, `trellis-apply.1`).
//! `scripts/package` calls `trellis assets DIR` and `trellis-agent assets DIR`; the `trellis`
//! binary compiles this same file (`#[path]`), as the two crates share no library.

use std::path::Path;

use anyhow::{Context, Result};

/// Writes `DIR/completions/{NAME.bash,_NAME,NAME.fish}` and `DIR/man/NAME*.1`.
pub fn write(mut cmd: clap::Command, out: &Path) -> Result<()> {
    let name = cmd.get_name().to_string();
    let completions = out.join("completions");
    let man = out.join("man");
    for dir in [&completions, &man] {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    for shell in [clap_complete::Shell::Bash, clap_complete::Shell::Zsh, clap_complete::Shell::Fish] {
        clap_complete::generate_to(shell, &mut cmd, &name, &completions)
            .with_context(|| format!("cannot write the {shell} completions into {}", completions.display()))?;
    }
    cmd.build();
    pages(&cmd, &name, &man)
}

fn pages(cmd: &clap::Command, name: &str, dir: &Path) -> Result<()> {
    let path = dir.join(format!("{name}.1"));
    let mut bytes = Vec::new();
    clap_mangen::Man::new(cmd.clone()).title(name.to_uppercase()).render(&mut bytes)?;
    std::fs::write(&path, bytes).with_context(|| format!("cannot write {}", path.display()))?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set() && s.get_name() != "help") {
        pages(sub, &format!("{name}-{}", sub.get_name()), dir)?;
    }
    Ok(())
}

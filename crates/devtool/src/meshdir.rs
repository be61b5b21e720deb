//! A declaration directory on disk, for the benches that run on a real mesh: read and loaded as
//! the `trellis` CLI reads it, and the changes the delivery bench applies to it (a node moved to
//! another group, a node added), made as edits of the text so that everything else stays as
//! written.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use trellis_core::Declaration;
use trellis_proto as proto;

/// A declaration directory: its files (named relative to it) and the declaration they load to.
pub struct MeshDir {
    pub dir: PathBuf,
    pub files: Vec<(String, String)>,
    pub decl: Arc<Declaration>,
}

impl MeshDir {
    /// Reads `dir` (`mesh.toml` and `modules/*.toml`) and loads it. A mesh whose nodes declare
    /// `public_key` is refused: the benches enrol every node, and a declared key cannot enrol.
    pub fn read(dir: &Path) -> Result<MeshDir> {
        let files = files(dir)?;
        let decl = load(dir, &files)?;
        let declared: Vec<&str> = decl.nodes.iter().filter(|n| n.public_key.is_some()).map(|n| n.name.as_str()).collect();
        if let Some(first) = declared.first() {
            bail!(
                "{}: {} of {} nodes declare public_key (the first is {first}); this bench needs the keys stripped, every node enrols (write one with `trellis-dev mesh --out DIR`, without --declared-keys)",
                dir.display(),
                declared.len(),
                decl.nodes.len()
            );
        }
        Ok(MeshDir { dir: dir.to_path_buf(), files, decl })
    }

    /// The same directory with other files (a change), loaded; refused when they do not load.
    pub fn with_files(&self, files: Vec<(String, String)>) -> Result<MeshDir> {
        let decl = load(&self.dir, &files)?;
        Ok(MeshDir { dir: self.dir.clone(), files, decl })
    }

    /// The files as an apply request sends them.
    pub fn request(&self) -> proto::ApplyRequest {
        proto::ApplyRequest {
            files: self.files.iter().map(|(path, text)| proto::DeclFile { path: path.clone(), text: text.clone() }).collect(),
            expect_revision: None,
        }
    }

    fn mesh_text(&self) -> &str {
        &self.files.iter().find(|(p, _)| p == trellis_core::load::MESH_FILE).expect("read() found mesh.toml").1
    }

    fn with_mesh_text(&self, text: String) -> Result<MeshDir> {
        let files = self
            .files
            .iter()
            .map(|(p, t)| if p == trellis_core::load::MESH_FILE { (p.clone(), text.clone()) } else { (p.clone(), t.clone()) })
            .collect();
        self.with_files(files)
    }

    /// `node` moved from group `from` to group `to`, both written as one-line arrays under
    /// `[groups]` in mesh.toml (as `trellis-dev mesh` writes them).
    pub fn move_node(&self, node: &str, from: &str, to: &str) -> Result<MeshDir> {
        let text = edit_group(self.mesh_text(), from, |m| m.retain(|x| x != node))?;
        let text = edit_group(&text, to, |m| m.push(node.to_string()))?;
        let moved = self.with_mesh_text(text)?;
        let member = |g: &str| moved.decl.groups.iter().any(|grp| grp.name == g && grp.members.iter().any(|m| m == node));
        if member(from) || !member(to) {
            bail!("moving {node} from group {from} to {to} did not take: the groups of mesh.toml are not written as this tool expects");
        }
        Ok(moved)
    }

    /// A new node `name` added to mesh.toml, like `like`: on its networks, running its modules
    /// and in its groups (of `[groups]`), without an endpoint.
    pub fn add_node(&self, name: &str, like: &str) -> Result<MeshDir> {
        let model = self.decl.node(like).with_context(|| format!("no node {like} in the mesh"))?;
        let list = |v: &[String]| v.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(", ");
        let mut text = self.mesh_text().to_string();
        for g in self.decl.groups.iter().filter(|g| g.members.iter().any(|m| m == like)) {
            text = edit_group(&text, &g.name, |m| m.push(name.to_string()))?;
        }
        text.push_str(&format!(
            "\n[[node]]\nname = \"{name}\"\nnetworks = [{}]\nmodules = [{}]\n",
            list(&model.networks),
            list(&model.modules)
        ));
        let added = self.with_mesh_text(text)?;
        if added.decl.node(name).is_none() {
            bail!("adding node {name} to mesh.toml did not take");
        }
        Ok(added)
    }
}

/// `DIR/mesh.toml` and every `DIR/modules/*.toml`, in name order, named relative to `DIR` (what
/// `trellis apply DIR` sends).
fn files(dir: &Path) -> Result<Vec<(String, String)>> {
    Ok(trellis_client::declaration_files(dir)?)
}

fn load(dir: &Path, files: &[(String, String)]) -> Result<Arc<Declaration>> {
    let loaded = trellis_core::load_relative(files, |p| dir.join(p).display().to_string());
    match loaded.declaration {
        Some(d) => Ok(Arc::new(d)),
        None => {
            let shown: Vec<String> = loaded.diagnostics.iter().take(5).map(|d| d.to_string()).collect();
            bail!("{} does not load ({} problems):\n{}", dir.display(), loaded.diagnostics.len(), shown.join("\n"))
        }
    }
}

/// mesh.toml with the members of `group` (a one-line array under `[groups]`) changed by `edit`.
fn edit_group(text: &str, group: &str, edit: impl FnOnce(&mut Vec<String>)) -> Result<String> {
    let mut table = "";
    let mut out = String::with_capacity(text.len() + 64);
    let mut edit = Some(edit);
    for line in text.split_inclusive('\n') {
        let t = line.trim();
        if t.starts_with('[') && !t.contains('=') {
            table = t;
        }
        let members = (table == "[groups]")
            .then(|| t.split_once('='))
            .flatten()
            .filter(|(k, _)| k.trim().trim_matches('"') == group)
            .and_then(|(_, v)| v.trim().strip_prefix('[')?.strip_suffix(']'));
        match (members, edit.take()) {
            (Some(list), Some(f)) => {
                let mut m: Vec<String> =
                    list.split(',').map(|s| s.trim().trim_matches('"').to_string()).filter(|s| !s.is_empty()).collect();
                f(&mut m);
                let quoted: Vec<String> = m.iter().map(|s| format!("\"{s}\"")).collect();
                out.push_str(&format!("{group} = [{}]\n", quoted.join(", ")));
            }
            (_, f) => {
                edit = f;
                out.push_str(line);
            }
        }
    }
    if edit.is_some() {
        bail!("mesh.toml has no group {group} written as a one-line array under [groups]");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::edit_group;

    #[test]
    fn edits_only_the_named_group_of_the_groups_table() {
        let text = "[groups]\nops = [\"a\", \"b\"]\ngrp-1 = [\"c\"]\n\n[[node]]\nname = \"a\"\n";
        let out = edit_group(text, "grp-1", |m| m.push("a".into())).unwrap();
        assert_eq!(out, "[groups]\nops = [\"a\", \"b\"]\ngrp-1 = [\"c\", \"a\"]\n\n[[node]]\nname = \"a\"\n");
        let out = edit_group(&out, "ops", |m| m.retain(|x| x != "a")).unwrap();
        assert!(out.starts_with("[groups]\nops = [\"b\"]\n"), "{out}");
        assert!(edit_group(text, "name", |_| ()).is_err(), "a key outside [groups] is not a group");
    }
}

//! `trellis-agent fetch` and `verify`: save the bundle exactly as received, and check a saved
//! bundle with the same function the agent applies bundles with. For operators who debug.

use std::path::Path;

use anyhow::{Context, Result};
use trellis_core::bundle::Applied;

use crate::identity::{controller_error, node_client};
use crate::state::Identity;

pub async fn fetch(dir: &Path, out: &Path, wait: u64, held: Option<i64>) -> Result<()> {
    let id = Identity::load(dir)?;
    let client = node_client(dir, &id)?;
    let answer = client.bundle(wait, held.map(|version| trellis_proto::etag::BundleTag { version, digest: None })).await?;
    let fresh = match answer.freshness {
        Some(stamp) => match id.signing_keys()?.verify_stamp(&stamp, &id.mesh) {
            Ok(at) => format!("the controller's signed word is {}s old", (crate::unix_now() - at).max(0)),
            Err(e) => format!("freshness stamp refused: {e}"),
        },
        None => "no freshness stamp".to_string(),
    };
    match answer.body.map_err(controller_error)? {
        None => println!("unchanged: version {} is current ({fresh})", held.unwrap_or_default()),
        Some(bytes) => {
            std::fs::write(out, &bytes).with_context(|| format!("cannot write {}", out.display()))?;
            println!(
                "saved the bundle (version {}, {} bytes) to {} ({fresh})",
                answer.tag.map_or_else(|| "unnamed".to_string(), |t| t.version.to_string()),
                bytes.len(),
                out.display()
            );
        }
    }
    Ok(())
}

pub fn verify(file: &Path, dir: &Path, last_version: Option<u64>, last_bundle: Option<&Path>, json: bool) -> Result<()> {
    let id = Identity::load(dir)?;
    let keys = id.signing_keys()?;
    let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let last = match last_bundle {
        Some(p) => {
            let prev = std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?;
            let (prev, _) =
                keys.verify(&prev, &id, None).map_err(|e| anyhow::anyhow!("{}: the last bundle itself is refused: {e}", p.display()))?;
            Some(Applied { version: prev.bundle.version, digest: Some(prev.bundle.content_digest()) })
        }
        None => last_version.map(|version| Applied { version, digest: None }),
    };
    let (v, _) = keys.verify(&bytes, &id, last).map_err(|e| anyhow::anyhow!("{}: refused: {e}", file.display()))?;
    show(&file.display().to_string(), v.bundle, json)
}

/// `trellis-agent verify --held`: the bundle this node holds, as its signed head (kept in the
/// state directory) and the files written under `root` (ADR 0033), checked as any bundle.
pub fn verify_held(dir: &Path, root: &Path, json: bool) -> Result<()> {
    let id = Identity::load(dir)?;
    let keys = id.signing_keys()?;
    let head_path = dir.join(crate::statedir::HELD_HEAD);
    let head = std::fs::read(&head_path).with_context(|| format!("cannot read {}: this node holds no bundle", head_path.display()))?;
    let bytes = trellis_core::bundle::held_bytes(head, |path, mode, len| read_held(root, path, mode, len)).map_err(anyhow::Error::msg)?;
    let (v, _) = keys.verify(&bytes, &id, None).map_err(|e| anyhow::anyhow!("the bundle held under {}: refused: {e}", root.display()))?;
    show(&format!("the bundle held under {}", root.display()), v.bundle, json)
}

fn show(what: &str, b: trellis_core::bundle::Bundle, json: bool) -> Result<()> {
    if json {
        let files: Vec<serde_json::Value> = b
            .files
            .iter()
            .map(|f| serde_json::json!({"path": f.path, "mode": format!("{:o}", f.mode), "sha256": hex::encode(f.sha256), "bytes": f.content.len()}))
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"node": b.node, "mesh": b.mesh, "version": b.version, "issued_at": b.issued_at, "files": files})
            )?
        );
    } else {
        println!("{}: valid bundle for node {} in mesh {}, version {}, issued at {} (unix)", what, b.node, b.mesh, b.version, b.issued_at);
        for f in &b.files {
            println!("  {:o} {:>8} {} {}", f.mode, f.content.len(), hex::encode(&f.sha256[..8]), f.path);
        }
    }
    Ok(())
}

/// `trellis_core::bundle::held_bytes`' reader for files under `root` on this host: a regular file, not through a
/// link, of the mode and length the manifest says, or a sentence naming it.
pub fn read_held(root: &Path, path: &str, mode: u32, len: usize) -> Result<Vec<u8>, String> {
    let (dir, name) = path.rsplit_once('/').unwrap_or(("", path));
    let dir = trellis_files::beneath::Beneath::open(root, dir, false).map_err(|e| format!("{path} of the bundle held: {e}"))?;
    match dir.read_exact_len(name, len) {
        Ok((content, m)) if m == mode => Ok(content),
        Ok((_, m)) => Err(format!("{path} has mode {m:o}, not {mode:o} as the bundle held says")),
        Err(what) => Err(format!("{} is {what}, not the file the bundle held names", root.join(path).display())),
    }
}

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
    let b = v.bundle;
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
        println!(
            "{}: valid bundle for node {} in mesh {}, version {}, issued at {} (unix)",
            file.display(),
            b.node,
            b.mesh,
            b.version,
            b.issued_at
        );
        for f in &b.files {
            println!("  {:o} {:>8} {} {}", f.mode, f.content.len(), hex::encode(&f.sha256[..8]), f.path);
        }
    }
    Ok(())
}

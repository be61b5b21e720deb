//! `trellis-agent fetch` and `verify`: save the bundle exactly as received, and check a saved
//! bundle with the same function the agent applies bundles with. For operators who debug.

use std::path::Path;

use anyhow::{bail, Context, Result};
use base64::Engine;
use trellis_core::bundle::{verify as verify_bundle, Applied};

use crate::identity::{load, node_client, Identity};

pub fn signing_key(id: &Identity) -> Result<ed25519_dalek::VerifyingKey> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(&id.signing_public_key)
        .context("identity.toml: signing_public_key is not base64")?;
    let bytes: [u8; 32] = bytes.try_into().map_err(|_| anyhow::anyhow!("identity.toml: signing_public_key is not 32 bytes"))?;
    ed25519_dalek::VerifyingKey::from_bytes(&bytes).context("identity.toml: signing_public_key is not an ed25519 key")
}

fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

pub async fn fetch(dir: &Path, out: &Path, wait: u64, held: Option<i64>) -> Result<()> {
    let id = load(dir)?;
    let client = node_client(dir)?;
    let mut last = None;
    for controller in &id.controllers {
        let mut req = client.get(format!("https://{controller}/v1/bundle?wait={wait}")).timeout(std::time::Duration::from_secs(wait + 30));
        if let Some(v) = held {
            req = req.header("if-none-match", format!("\"{v}\""));
        }
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                last = Some(format!("{controller}: {e}"));
                continue;
            }
        };
        let status = resp.status();
        let stamp = resp.headers().get("x-trellis-freshness").and_then(|v| v.to_str().ok()).map(str::to_string);
        let fresh = match stamp.as_deref().map(|s| base64::engine::general_purpose::STANDARD.decode(s)) {
            Some(Ok(b)) => match trellis_core::bundle::verify_stamp(&b, &signing_key(&id)?, &id.mesh) {
                Ok(at) => format!("the controller's signed word is {}s old", (unix_now() - at).max(0)),
                Err(e) => format!("freshness stamp refused: {e}"),
            },
            _ => "no freshness stamp".to_string(),
        };
        if status == reqwest::StatusCode::NOT_MODIFIED {
            println!("unchanged: version {} is current ({fresh})", held.unwrap_or_default());
            return Ok(());
        }
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            let msg = serde_json::from_str::<trellis_proto::ErrorBody>(&text).map(|b| b.error).unwrap_or(text);
            bail!("the controller refused: {msg}");
        }
        let etag = resp.headers().get("etag").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
        let bytes = read_bounded(resp).await?;
        std::fs::write(out, &bytes).with_context(|| format!("cannot write {}", out.display()))?;
        println!("saved the bundle (version {}, {} bytes) to {} ({fresh})", etag.trim_matches('"'), bytes.len(), out.display());
        return Ok(());
    }
    bail!("cannot reach the controller: {}", last.unwrap_or_default())
}

pub fn verify(file: &Path, dir: &Path, last_version: Option<u64>, last_bundle: Option<&Path>, json: bool) -> Result<()> {
    let id = load(dir)?;
    let key = signing_key(&id)?;
    let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let last = match last_bundle {
        Some(p) => {
            let prev = std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?;
            let prev = verify_bundle(&prev, &key, &id.mesh, &id.node, None)
                .map_err(|e| anyhow::anyhow!("{}: the last bundle itself is refused: {e}", p.display()))?;
            Some(Applied { version: prev.bundle.version, digest: Some(prev.bundle.content_digest()) })
        }
        None => last_version.map(|version| Applied { version, digest: None }),
    };
    let v = verify_bundle(&bytes, &key, &id.mesh, &id.node, last).map_err(|e| anyhow::anyhow!("{}: refused: {e}", file.display()))?;
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

/// Reads a bundle from the network, refusing one larger than the bound before holding it: the
/// announced length is checked first, then every chunk as it arrives.
pub async fn read_bounded(mut resp: reqwest::Response) -> Result<Vec<u8>> {
    let max = trellis_core::bundle::MAX_BUNDLE;
    if let Some(n) = resp.content_length() {
        if n as usize > max {
            bail!("the bundle is {n} bytes, over the bound of {max}");
        }
    }
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.context("reading the bundle")? {
        if out.len() + chunk.len() > max {
            bail!("the bundle is over the bound of {max} bytes");
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

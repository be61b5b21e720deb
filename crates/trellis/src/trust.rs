//! `trellis controllers` (the controller list nodes are given in their bundles, ADR 0028) and
//! `trellis rotate` (the bundle-signing key, ADR 0027; the mesh CA, ADR 0029).

use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use base64::Engine;
use clap::Subcommand;
use trellis_proto as proto;
use trellis_proto::text::{date, printable};

use crate::conn::{runtime, Conn};

#[derive(Subcommand)]
pub enum ControllersCommand {
    /// The controllers nodes are given, in the order they try them, and the names the server certificate carries
    List {
        #[arg(long)]
        json: bool,
    },
    /// Add HOST:PORT at the end of the list; every node is given it in its next bundle, no node enrols again (audited)
    Add {
        address: String,
        #[arg(long)]
        json: bool,
    },
    /// Remove HOST:PORT from the list; every node stops asking it once it applied its next bundle (audited)
    Remove {
        address: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum RotateCommand {
    /// Make a new bundle-signing key and announce it in bundles signed by the current one; once every active node applied such a bundle (or the overlap passed), bundles are signed with the new key only and agents refuse the old one (audited)
    SigningKey {
        /// How long to wait, at most, for nodes that are away (90s, 30m, 24h, 7d)
        #[arg(long, default_value = "24h", value_parser = crate::admin::parse_duration)]
        overlap: u64,
        #[arg(long)]
        json: bool,
    },
    /// Make a new mesh CA and announce it in signed bundles; node and server certificates are issued under it from now on, agents trust both and renew onto it; once every active node applied such a bundle and holds a certificate of the new CA (or the overlap passed), only the new CA is trusted (audited)
    Ca {
        /// How long to wait, at most, for nodes that are away (90s, 30m, 24h, 7d)
        #[arg(long, default_value = "24h", value_parser = crate::admin::parse_duration)]
        overlap: u64,
        #[arg(long)]
        json: bool,
    },
    /// Per rotation: its key, when it started and completes by, and which active nodes have confirmed it
    Status {
        #[arg(long)]
        json: bool,
    },
}

fn print_list(list: &proto::ControllerList, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(list)?);
        return Ok(());
    }
    for (i, c) in list.controllers.iter().enumerate() {
        println!("{:>2}. {}", i + 1, printable(c));
    }
    println!("server certificate names: {}", list.server_names.iter().map(|n| printable(n).into_owned()).collect::<Vec<_>>().join(", "));
    Ok(())
}

pub fn controllers(cmd: ControllersCommand, conn: &Conn) -> Result<ExitCode> {
    let client = conn.client()?;
    let rt = runtime();
    match cmd {
        ControllersCommand::List { json } => print_list(&rt.block_on(client.controllers())?, json)?,
        ControllersCommand::Add { address, json } => {
            let list = rt.block_on(client.add_controller(&address))?;
            if !json {
                println!("added {}; every node is given the list in its next bundle", printable(&address));
            }
            print_list(&list, json)?;
        }
        ControllersCommand::Remove { address, json } => {
            let list = rt.block_on(client.remove_controller(&address))?;
            if !json {
                println!("removed {}; every node is given the list in its next bundle", printable(&address));
            }
            print_list(&list, json)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn print_rotations(list: &[proto::Rotation], json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(list)?);
        return Ok(());
    }
    if list.is_empty() {
        println!("no rotation yet");
    }
    let names = |n: &[String]| {
        if n.is_empty() {
            "none".to_string()
        } else {
            n.iter().map(|n| printable(n).into_owned()).collect::<Vec<_>>().join(", ")
        }
    };
    for r in list {
        let state = match (&r.completed_at, &r.completed_by) {
            (Some(at), Some(by)) => {
                format!("completed {} ({})", date(*at), if by == "evidence" { "every active node confirmed" } else { "the overlap passed" })
            }
            _ => format!("in progress, completes by {} at the latest", date(r.completes_by)),
        };
        println!("{} to {}: started {}, {state}", r.kind, printable(&r.next_key), date(r.started_at));
        println!("  confirmed ({}): {}", r.confirmed.len(), names(&r.confirmed));
        if r.completed_at.is_none() || !r.waiting.is_empty() {
            println!("  waiting for ({}): {}", r.waiting.len(), names(&r.waiting));
        }
    }
    Ok(())
}

pub fn rotate(cmd: RotateCommand, conn: &Conn) -> Result<ExitCode> {
    let client = conn.client()?;
    let rt = runtime();
    match cmd {
        RotateCommand::Status { json } => print_rotations(&rt.block_on(client.rotations())?, json)?,
        RotateCommand::SigningKey { overlap, json } => {
            let Some(dir) = conn.state_dir() else {
                bail!("rotate signing-key writes the next key into the controller's state directory: give --state-dir DIR on its machine");
            };
            let path = dir.join(trellis_controller::layout::NEXT_SIGNING_KEY);
            // A key written before and not yet announced (the request failed) is announced now;
            // otherwise a new one, 0600 before its first byte.
            let key = if path.exists() {
                let text = trellis_files::read(&path)?;
                let seed: [u8; 32] = base64::engine::general_purpose::STANDARD
                    .decode(text.trim())
                    .ok()
                    .and_then(|b| b.try_into().ok())
                    .with_context(|| format!("{} does not hold a signing key; remove it and run again", path.display()))?;
                ed25519_dalek::SigningKey::from_bytes(&seed)
            } else {
                let mut seed = [0u8; 32];
                trellis_controller::Entropy::fill(&trellis_controller::OsEntropy, &mut seed);
                let key = ed25519_dalek::SigningKey::from_bytes(&seed);
                trellis_files::create_new(&path, base64::engine::general_purpose::STANDARD.encode(seed).as_bytes(), 0o600)?;
                key
            };
            let next_public_key = base64::engine::general_purpose::STANDARD.encode(key.verifying_key().to_bytes());
            let r = rt.block_on(client.rotate_signing_key(&proto::SigningKeyRotation { next_public_key, overlap_secs: overlap }))?;
            if !json {
                println!(
                    "announcing the next signing key {} in every bundle; bundles are signed with it once every active node applied one (at the latest {})",
                    printable(&r.next_key),
                    date(r.completes_by)
                );
                println!(
                    "replicas on other machines need {} in their state directory; follow with `trellis rotate status`",
                    path.display()
                );
            } else {
                println!("{}", serde_json::to_string_pretty(&r)?);
            }
        }
        RotateCommand::Ca { overlap, json } => {
            let Some(dir) = conn.state_dir() else {
                bail!("rotate ca writes the next CA into the controller's state directory: give --state-dir DIR on its machine");
            };
            let (cert, key) = (dir.join(trellis_controller::layout::NEXT_CA_CERT), dir.join(trellis_controller::layout::NEXT_CA_KEY));
            let fingerprint = trellis_controller::authority::prepare_next_ca(dir)?;
            let r = rt.block_on(client.rotate_ca(&proto::CaRotation { next_ca_fingerprint: fingerprint, overlap_secs: overlap }))?;
            if !json {
                println!(
                    "announcing the next mesh CA {} in every bundle; node and server certificates are issued under it, and it is the only CA once every active node holds one (at the latest {})",
                    printable(&r.next_key),
                    date(r.completes_by)
                );
                println!("new tokens carry its fingerprint; replicas on other machines need {} and {} in their state directory; follow with `trellis rotate status`", cert.display(), key.display());
            } else {
                println!("{}", serde_json::to_string_pretty(&r)?);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

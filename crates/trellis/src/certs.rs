//! `trellis certs`: every service certificate (ADR 0023), its node, module, names, serial and
//! expiry; and the notes `trellis status` adds about certificates that expire soon or whose
//! renewal was refused.

use std::process::ExitCode;

use anyhow::Result;
use trellis_proto as proto;
use trellis_proto::text::{date, printable};

use crate::conn::{runtime, Conn};

pub fn certs(conn: &Conn, json: bool) -> Result<ExitCode> {
    let list = runtime().block_on(conn.client()?.certificates())?;
    if json {
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(ExitCode::SUCCESS);
    }
    if list.is_empty() {
        println!("no service certificates: no module of the current declaration has a [module.certificate]");
        return Ok(ExitCode::SUCCESS);
    }
    let now = trellis_files::unix_now();
    println!("{:<20} {:<16} {:<34} {:<22} {:<10}  NAMES", "NODE", "MODULE", "SERIAL", "EXPIRES", "STATE");
    for c in &list {
        println!(
            "{:<20} {:<16} {:<34} {:<22} {:<10}  {}",
            printable(&c.node),
            printable(&c.module),
            c.serial.as_deref().unwrap_or("-"),
            c.not_after.map_or("-".into(), date),
            state(c, now),
            c.names.iter().map(|n| printable(n).into_owned()).collect::<Vec<_>>().join(", ")
        );
        if let Some(r) = &c.refusal {
            println!("{:<20} last refusal: {}", "", printable(r));
        }
        if let (Some(held), Some(issued)) = (&c.held_serial, &c.serial) {
            if held != issued {
                let until = c.held_not_after.map_or(String::new(), |t| format!(", until {}", date(t)));
                println!("{:<20} the node holds {}{until}, not the one last issued", "", printable(held));
            }
        }
        if let Some(e) = &c.node_error {
            println!("{:<20} failing on the node: {}", "", printable(e));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// One word for a certificate: `pending` (declared, none issued yet), `expiring` (within a
/// quarter of its lifetime), `expired`, `valid`, or `undeclared` (the node no longer runs the
/// module: its renewals are refused).
fn state(c: &proto::ServiceCertInfo, now: i64) -> &'static str {
    match (c.declared, c.not_after) {
        (false, _) => "undeclared",
        (true, None) => "pending",
        (true, Some(t)) if t <= now => "expired",
        (true, Some(t)) if c.lifetime_secs.is_some_and(|l| trellis_controller::certs::expiring(t, l, now)) => "expiring",
        _ => "valid",
    }
}

/// What `trellis status` says about certificates: those that expire within a quarter of their
/// lifetime, whose last request was refused, or that fail on the node (as its agent reported),
/// one sentence each. The expiry is that of the certificate the node holds, when it reported
/// one.
pub fn notes(list: &[proto::ServiceCertInfo], now: i64) -> Vec<String> {
    let mut out = Vec::new();
    for c in list.iter().filter(|c| c.declared) {
        let held = proto::ServiceCertInfo { not_after: c.held_not_after.or(c.not_after), ..c.clone() };
        let expiring = matches!(state(&held, now), "expiring" | "expired");
        if !expiring && c.refusal.is_none() && c.node_error.is_none() {
            continue;
        }
        let when = match held.not_after {
            Some(t) if t > now => format!("expires in {}", span(t - now)),
            Some(_) => "has expired".to_string(),
            None => "has not been issued".to_string(),
        };
        // The controller's refusal says why in its own words; the node's error says what else
        // went wrong there (it repeats a refusal it was given).
        let refused = match (&c.refusal, &c.node_error) {
            (Some(r), _) => format!(", renewal refused: {}", printable(r)),
            (None, Some(e)) => format!(", failing on the node: {}", printable(e)),
            (None, None) => String::new(),
        };
        out.push(format!("{}: certificate for {} {when}{refused}", printable(&c.node), printable(&c.module)));
    }
    out
}

fn span(secs: i64) -> String {
    match secs {
        s if s >= 7200 => format!("{} h", s / 3600),
        s if s >= 120 => format!("{} min", s / 60),
        s => format!("{s} s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(not_after: Option<i64>, refusal: Option<&str>) -> proto::ServiceCertInfo {
        proto::ServiceCertInfo {
            node: "db-1".into(),
            module: "postgres".into(),
            declared: true,
            names: vec![],
            serial: Some("01".into()),
            issued_at: Some(0),
            not_after,
            lifetime_secs: Some(86_400),
            refused_at: refusal.map(|_| 10),
            refusal: refusal.map(str::to_string),
            held_serial: None,
            held_not_after: None,
            node_error: None,
            reported_at: None,
        }
    }

    #[test]
    fn status_names_certificates_that_expire_soon_or_were_refused() {
        let now = 100_000;
        assert!(notes(&[info(Some(now + 80_000), None)], now).is_empty(), "a fresh certificate is no news");
        assert_eq!(
            notes(&[info(Some(now + 7_200), Some("node `db-1` does not run module `postgres`"))], now),
            ["db-1: certificate for postgres expires in 2 h, renewal refused: node `db-1` does not run module `postgres`"]
        );
        assert_eq!(notes(&[info(Some(now + 600), None)], now), ["db-1: certificate for postgres expires in 10 min"]);
        let undeclared = proto::ServiceCertInfo { declared: false, ..info(Some(now + 60), Some("x")) };
        assert!(notes(&[undeclared], now).is_empty(), "a certificate no longer declared is `trellis certs`' business");
        // The node says its last attempt failed there; the expiry is that of what it holds.
        let failing = proto::ServiceCertInfo {
            held_serial: Some("00".into()),
            held_not_after: Some(now + 3 * 3600),
            node_error: Some("certificate for postgres: group postgres does not exist on this host".into()),
            reported_at: Some(now),
            ..info(Some(now + 80_000), None)
        };
        assert_eq!(
            notes(std::slice::from_ref(&failing), now),
            ["db-1: certificate for postgres expires in 3 h, failing on the node: certificate for postgres: group postgres does not exist on this host"]
        );
        let refused = proto::ServiceCertInfo { refusal: Some("node `db-1` has been revoked".into()), ..failing };
        assert_eq!(
            notes(&[refused], now),
            ["db-1: certificate for postgres expires in 3 h, renewal refused: node `db-1` has been revoked"]
        );
    }
}

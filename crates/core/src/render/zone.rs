//! `mesh.zone` and the parts of its names (ADR 0043): the address records of the names a node
//! may resolve, the modules' and the routes' hosts'.

use std::fmt::Write;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::ends_run;
use crate::decl::NAMESERVER;
use crate::plan::{zone_part, FileResource, NodePlan, MESH_ZONE, WIREGUARD_PARTS, ZONE_DIR};
use crate::text::{HeldPiece, Runs, Text, TextBuilder};

/// Address records of a route's named hosts.
pub fn host_records(hosts: &[crate::decl::RouteHost]) -> String {
    let mut records = String::new();
    for h in hosts {
        let kind = if h.address.is_ipv4() { "A" } else { "AAAA" };
        let _ = writeln!(records, "{}\tIN\t{kind}\t{}", h.name, h.address);
    }
    records
}

/// Address records, one line each, for names with their addresses.
pub fn zone_records<'n>(names: impl Iterator<Item = (&'n str, Option<Ipv4Addr>, Option<Ipv6Addr>)>) -> String {
    let mut records = String::new();
    for (name, v4, v6) in names {
        if let Some(a) = v4 {
            let _ = writeln!(records, "{name}\tIN\tA\t{a}");
        }
        if let Some(a) = v6 {
            let _ = writeln!(records, "{name}\tIN\tAAAA\t{a}");
        }
    }
    records
}

/// A node's zone: the names it may resolve (see `NodePlan::zone`) and nothing else, with its name
/// server `ns` at the node's own addresses. The serial written here is derived from the records
/// (the module blocks by their digests), so it changes when they do but does not rise: the
/// controller gives each bundle's zone the bundle's version as its serial (`with_serial`), which
/// rises whenever the bundle's content changes (ADR 0010); an offline compile keeps this one.
///
/// The names' records are the nodes' own (`NodeText::records`), held by reference in runs as
/// `wireguard` holds peers' sections: a zone made again with `before`, the node's zone before,
/// takes from it every run of the same names, and the zones of a mesh share the records instead
/// of copying them (at 100,000 nodes they name about 19 million nodes in all).
pub fn zone(plan: &NodePlan, before: Option<&Text>) -> Text {
    let (names, _, hash) = walk(plan);
    zone_of(plan, &names, hash, before)
}

/// [`zone`] of the names as `walk` read them.
fn zone_of(plan: &NodePlan, names: &[Name], hash: Sha256, before: Option<&Text>) -> Text {
    let mut s = zone_head(plan, hash);
    push_names(&mut s, names.iter(), &mut Runs::of(before));
    for m in plan.zone_modules.iter().chain(&plan.zone_routes) {
        s.push_shared(&m.records);
    }
    s.finish()
}

/// A name of a zone as `walk` reads it: its records, whether a run of names ends after it
/// (`ends_run`), and the part of its name.
#[derive(Clone, Copy)]
struct Name<'p> {
    records: HeldPiece<'p>,
    ends: bool,
    part: u8,
}

/// The names of `plan`'s zone read in one walk: each as a `Name`, the bytes their records take,
/// and the hash of their records that the serial starts from (`zone_head`). Each name's text is
/// read once: at 100,000 names, each walk of them reads 100,000 texts far apart in memory.
fn walk(plan: &NodePlan) -> (Vec<Name<'_>>, usize, Sha256) {
    let mut hash = Sha256::new();
    let mut bytes = 0;
    let names = plan
        .zone
        .iter()
        .map(|z| {
            hash.update(z.records_hash);
            bytes += z.records.len();
            Name { records: HeldPiece::of(&z.records), ends: ends_run(z), part: z.part }
        })
        .collect();
    (names, bytes, hash)
}

/// The names' records in runs, each run taken from `before` where it holds the same.
fn push_names<'p>(t: &mut TextBuilder, names: impl Iterator<Item = &'p Name<'p>>, before: &mut Runs) {
    let mut run: Vec<HeldPiece> = Vec::with_capacity(128);
    for n in names {
        run.push(n.records);
        if n.ends {
            t.push_run(&run, before);
            run.clear();
        }
    }
    t.push_run(&run, before);
}

/// Whether `plan`'s zone is in parts (ADR 0043): its records take more than
/// [`crate::plan::ZONE_PARTS_FROM`] bytes.
pub fn zone_parted(plan: &NodePlan) -> bool {
    parted(plan.zone.iter().map(|z| z.records.len()).sum(), plan)
}

/// Whether a zone whose names' records take `names` bytes is in parts, with `plan`'s modules'.
fn parted(names: usize, plan: &NodePlan) -> bool {
    let modules: usize = plan.zone_modules.iter().map(|m| m.records.len()).sum();
    names + modules > crate::plan::ZONE_PARTS_FROM
}

/// A node's zone files: `mesh.zone` as [`zone`] makes it, or, when its records take more than
/// [`crate::plan::ZONE_PARTS_FROM`] bytes, `mesh.zone` with the SOA, the NS and the routes' hosts, and the parts
/// (ADR 0043): each node's records, and a module's records of each node that runs it, in the
/// part the node's name hashes to (its peer's part), each part made again from the same path's
/// text in `before` (its runs taken over). `mesh.zone` and its parts in order, one after the
/// other, are the zone: the same records as the one file would hold, in another order.
pub fn zone_files<'b>(plan: &NodePlan, before: impl Fn(&str) -> Option<&'b Text>) -> Vec<FileResource> {
    let file = |path: &str, content: Text| FileResource { path: path.into(), mode: 0o644, content };
    let (names, bytes, hash) = walk(plan);
    if !parted(bytes, plan) {
        return vec![file(MESH_ZONE, zone_of(plan, &names, hash, before(MESH_ZONE)))];
    }
    let mut s = zone_head(plan, hash);
    let _ = writeln!(
        s,
        "; {} names, in {ZONE_DIR}/names-NN.zone by the part each hashes to: this file and its parts, one after the other, are the zone.",
        plan.zone.len()
    );
    for m in &plan.zone_routes {
        s.push_shared(&m.records);
    }
    let mut files = vec![file(MESH_ZONE, s.finish())];
    let mut by_part: Vec<Vec<&Name>> = vec![Vec::new(); WIREGUARD_PARTS];
    for n in &names {
        by_part[usize::from(n.part)].push(n);
    }
    let mut modules: Vec<Vec<&Arc<str>>> = vec![Vec::new(); WIREGUARD_PARTS];
    for (i, records) in plan.zone_modules.iter().flat_map(|m| m.parts.iter()) {
        modules[usize::from(*i)].push(records);
    }
    for (i, (names, modules)) in by_part.into_iter().zip(modules).enumerate() {
        if names.is_empty() && modules.is_empty() {
            continue;
        }
        let path = zone_part(i);
        let mut t = TextBuilder::with_capacity(names.len() / 32 + modules.len() + 2, 128);
        let _ = writeln!(
            t,
            "; trellis: names of zone {} of mesh {} as node {} sees them, part {i:02}. Generated; do not edit.",
            plan.common.domain, plan.common.mesh, plan.node
        );
        push_names(&mut t, names.into_iter(), &mut Runs::of(before(path)));
        for records in modules {
            t.push_shared(records);
        }
        files.push(file(path, t.finish()));
    }
    files
}

/// The head of a node's zone: its comment, origin and TTL, the SOA with the serial derived from
/// the records, the NS and the name server's own addresses.
fn zone_head(plan: &NodePlan, mut hash: Sha256) -> TextBuilder {
    let domain = &plan.common.domain;
    for m in plan.zone_modules.iter().chain(&plan.zone_routes) {
        hash.update(m.digest);
    }
    let digest = hash.finalize();
    let serial = u32::from_be_bytes(digest[..4].try_into().expect("4 bytes")) & 0x7fff_ffff;
    let mut s = TextBuilder::with_capacity(plan.zone_modules.len() + 2, 512);
    let _ = writeln!(s, "; trellis: zone {domain} of mesh {} as node {} sees it. Generated; do not edit.", plan.common.mesh, plan.node);
    let _ = writeln!(s, "$ORIGIN {domain}.");
    s.push_str("$TTL 60\n");
    // A piece of its own, so that `with_serial` replaces it and shares the rest.
    s.push_shared(&Arc::from(soa(domain, serial)));
    let _ = writeln!(s, "@\tIN\tNS\t{NAMESERVER}.{domain}.");
    // The name server is the node's own resolver, which the agent serves on its overlay addresses.
    s.push_str(&zone_records(std::iter::once((NAMESERVER, plan.ipv4, plan.ipv6))));
    s
}

/// A module's address records, one line for each address of each node that runs it (`runners`:
/// the part of its name, `plan::part_of`, and its addresses), and the same lines by the part of
/// the runner's name (ADR 0043), in part order, only the parts that have lines.
pub fn module_records(
    module: &str,
    runners: impl Iterator<Item = (u8, Option<Ipv4Addr>, Option<Ipv6Addr>)>,
) -> (String, crate::plan::ZoneParts) {
    let mut records = String::new();
    let mut parts: Vec<String> = vec![String::new(); WIREGUARD_PARTS];
    for (part, v4, v6) in runners {
        runner_lines(module, (v4, v6), &mut parts[usize::from(part)], &mut records);
    }
    (records, zone_parts(parts, &[]))
}

/// Lines by part (`WIREGUARD_PARTS` of them, by index) as a block holds them: the parts that have
/// lines, each the same text as `before`'s part of that index taken from it (shared, so that the
/// zones holding it compare it by address).
pub fn zone_parts(parts: Vec<String>, before: &[(u8, Arc<str>)]) -> crate::plan::ZoneParts {
    parts
        .into_iter()
        .enumerate()
        .filter(|(_, t)| !t.is_empty())
        .map(|(i, t)| match before.iter().find(|(k, b)| usize::from(*k) == i && **b == *t) {
            Some((_, b)) => (i as u8, b.clone()),
            None => (i as u8, Arc::from(t)),
        })
        .collect()
}

/// A runner's lines of `module`'s records, written once into its part and copied from there to
/// the records.
fn runner_lines(module: &str, (v4, v6): (Option<Ipv4Addr>, Option<Ipv6Addr>), part: &mut String, records: &mut String) {
    let from = part.len();
    if let Some(a) = v4 {
        let _ = writeln!(part, "{module}\tIN\tA\t{a}");
    }
    if let Some(a) = v6 {
        let _ = writeln!(part, "{module}\tIN\tAAAA\t{a}");
    }
    records.push_str(&part[from..]);
}

/// A runner of a module as its block before holds it, for [`module_records_from`]: where it is
/// now if its lines are the same (it stayed, at the same addresses), how many lines it has there,
/// and the part of its name.
pub struct RunnerBefore {
    pub now: Option<u32>,
    pub lines: u8,
    pub part: u8,
}

/// What [`module_records`] gives for the runners `now` (position, addresses, in order), made from
/// the module's records before (`before`, the lines of the runners `was`, in order): the lines of
/// a runner that stayed are copied from there, only those of a runner new or moved are written
/// (`part_of` gives the part of such a runner's name). A module run by most of 100,000 nodes is
/// one runner's lines more instead of all of them written again. Positions are in name order both
/// times, so the runners that stayed are in the same order. `None` when `before` does not hold
/// the lines `was` says it does.
pub fn module_records_from(
    module: &str,
    before: &str,
    was: impl Iterator<Item = RunnerBefore>,
    now: impl Iterator<Item = (u32, Option<Ipv4Addr>, Option<Ipv6Addr>)>,
    part_of: impl Fn(u32) -> u8,
) -> Option<(String, Vec<String>)> {
    let mut records = String::with_capacity(before.len() + 256);
    let mut parts: Vec<String> = vec![String::new(); WIREGUARD_PARTS];
    let mut was = was.peekable();
    let mut at = 0;
    for (a, v4, v6) in now {
        let mut copied = false;
        while let Some(r) = was.next_if(|r| r.now.is_none_or(|n| n <= a)) {
            let mut end = at;
            for _ in 0..r.lines {
                end += before.get(end..)?.find('\n')? + 1;
            }
            if r.now == Some(a) {
                let lines = &before[at..end];
                parts[usize::from(r.part)].push_str(lines);
                records.push_str(lines);
                copied = true;
            }
            at = end;
            if copied {
                break;
            }
        }
        if !copied {
            runner_lines(module, (v4, v6), &mut parts[usize::from(part_of(a))], &mut records);
        }
    }
    Some((records, parts))
}

/// The SOA record of a zone of `domain` with `serial`.
fn soa(domain: &str, serial: u32) -> String {
    format!("@\tIN\tSOA\t{NAMESERVER}.{domain}. hostmaster.{domain}. {serial} 3600 600 86400 60\n")
}

/// `zone` (as `zone` makes it) with the serial `serial` in its SOA record, sharing the rest.
pub fn with_serial(zone: &Text, serial: u32) -> Text {
    let soa_of = |p: &str| -> Option<String> {
        let rest = p.strip_prefix("@\tIN\tSOA\t")?.strip_suffix('\n')?;
        let f: Vec<&str> = rest.split(' ').collect();
        let domain = f.first()?.strip_prefix(&format!("{NAMESERVER}."))?.strip_suffix('.')?;
        (f.len() == 7 && !rest.contains('\n')).then(|| soa(domain, serial))
    };
    if let Some(text) = zone.replace_first(soa_of) {
        return text;
    }
    // A zone cut another way: line by line.
    let text = zone.to_string();
    let lines: Vec<String> = text.lines().map(|l| soa_of(&format!("{l}\n")).unwrap_or_else(|| format!("{l}\n"))).collect();
    Text::from(lines.concat())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `module_records_from` gives what `module_records` gives for the runners now, whatever came,
    /// went or moved address: runners are (name, v4, v6), in name order.
    #[test]
    fn a_module_s_records_made_from_those_before_are_those_made_whole() {
        type Runner = (String, Option<Ipv4Addr>, Option<Ipv6Addr>);
        let runner = |i: u32, v6: bool, bump: u32| -> Runner {
            let v4 = Ipv4Addr::from(0x0a58_0000 + i + bump);
            (format!("n{i:04}"), Some(v4), v6.then(|| Ipv6Addr::from(0xfd88_u128 << 112 | u128::from(i + bump))))
        };
        let whole = |rs: &[Runner]| module_records("svc", rs.iter().map(|(n, a, b)| (crate::plan::part_of(n), *a, *b)));
        let was: Vec<Runner> = (0..400).map(|i| runner(i * 2, i % 3 != 0, 0)).collect();
        let (before, _) = whole(&was);
        // Some go (every 37th), some come (odd names, between), some move address (every 41st),
        // and one comes before every other name.
        let mut now: Vec<Runner> = Vec::new();
        for (i, r) in was.iter().enumerate() {
            if i % 37 == 5 {
                continue;
            }
            if i % 53 == 7 {
                now.push(runner(i as u32 * 2 + 1, i % 2 == 0, 0));
            }
            now.push(if i % 41 == 3 { runner(i as u32 * 2, i % 3 != 0, 5000) } else { r.clone() });
        }
        now.insert(0, ("a".into(), Some(Ipv4Addr::new(10, 88, 255, 1)), None));
        let at = |name: &str| now.iter().position(|r| r.0 == name).map(|a| a as u32);
        let from = module_records_from(
            "svc",
            &before,
            was.iter().map(|(n, a, b)| RunnerBefore {
                now: at(n).filter(|&k| (now[k as usize].1, now[k as usize].2) == (*a, *b)),
                lines: u8::from(a.is_some()) + u8::from(b.is_some()),
                part: crate::plan::part_of(n),
            }),
            now.iter().enumerate().map(|(k, (_, a, b))| (k as u32, *a, *b)),
            |k| crate::plan::part_of(&now[k as usize].0),
        )
        .expect("the records before hold the runners' lines");
        let (records, parts) = whole(&now);
        assert_eq!(from.0, records);
        assert_eq!(zone_parts(from.1, &[]), parts);
        // Records that do not hold the lines said are refused, not read past.
        let short = &before[..before.len() / 2];
        let was_all =
            was.iter().map(|(n, a, b)| RunnerBefore { now: at(n), lines: u8::from(a.is_some()) + u8::from(b.is_some()), part: 0 });
        assert!(module_records_from("svc", short, was_all, now.iter().enumerate().map(|(k, r)| (k as u32, r.1, r.2)), |_| 0).is_none());
    }
}

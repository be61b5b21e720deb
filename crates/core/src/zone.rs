//! Reading back the `mesh.zone` that `render` writes (a master file for the mesh domain) into
//! its records, for tools that check what a node was given. Pure.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The zone a `mesh.zone` describes: its origin, default TTL, serial, name server and address
/// records.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Zone {
    /// The origin without its final dot (`lab.mesh`).
    pub origin: String,
    pub ttl: Option<u32>,
    /// The serial of the SOA record.
    pub serial: Option<u32>,
    /// The name server the NS record names, as written (`ns.lab.mesh.`).
    pub nameserver: Option<String>,
    /// The name server's addresses (the node's own resolver), in file order: not in `records`,
    /// which are the names the node may reach.
    pub nameserver_addresses: Vec<IpAddr>,
    /// A and AAAA records in file order.
    pub records: Vec<AddressRecord>,
}

/// One A or AAAA record: a name relative to the origin (`web`; `@` for the origin itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddressRecord {
    pub name: String,
    pub address: IpAddr,
}

impl Zone {
    /// Every name with its addresses, in the order the file lists them.
    pub fn addresses(&self) -> BTreeMap<&str, Vec<IpAddr>> {
        let mut out: BTreeMap<&str, Vec<IpAddr>> = BTreeMap::new();
        for r in &self.records {
            out.entry(r.name.as_str()).or_default().push(r.address);
        }
        out
    }
}

/// A line of `mesh.zone` this reader does not understand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZoneError {
    /// 1-based line number.
    pub line: usize,
    pub problem: String,
}

impl fmt::Display for ZoneError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "mesh.zone line {}: {}", self.line, self.problem)
    }
}

impl std::error::Error for ZoneError {}

/// Parses the file. Only what `render::zone` writes is accepted: one `$ORIGIN` before any record,
/// at most one `$TTL`, SOA and NS, and A and AAAA records, all of class IN; anything else is an
/// error naming the line. The name server's own addresses are told from the other records once
/// the whole file is read, so the order of the NS record and theirs does not matter.
pub fn parse(text: &str) -> Result<Zone, ZoneError> {
    let mut zone = Zone::default();
    let mut seen_ttl = false;
    let mut seen_soa = false;
    for (n, raw) in text.lines().enumerate() {
        let at = |problem: String| ZoneError { line: n + 1, problem };
        let line = raw.split(';').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields[..] {
            ["$ORIGIN", origin] => {
                if !zone.origin.is_empty() {
                    return Err(at("a second $ORIGIN (trellis writes one)".into()));
                }
                let Some(origin) = origin.strip_suffix('.') else {
                    return Err(at(format!("$ORIGIN `{origin}` is not a fully qualified name (it must end with a dot)")));
                };
                if origin.is_empty() {
                    return Err(at("$ORIGIN is the root (`.`), not a mesh domain".into()));
                }
                zone.origin = origin.to_string();
            }
            ["$TTL", ttl] => {
                if std::mem::replace(&mut seen_ttl, true) {
                    return Err(at("a second $TTL".into()));
                }
                zone.ttl = Some(ttl.parse().map_err(|_| at(format!("$TTL `{ttl}` is not a number of seconds")))?);
            }
            [name, "IN", kind, ref data @ ..] => {
                if zone.origin.is_empty() {
                    return Err(at("a record comes before $ORIGIN".into()));
                }
                let mut address = |address: IpAddr| zone.records.push(AddressRecord { name: name.to_string(), address });
                match (kind, data) {
                    ("A", [a]) => address(a.parse::<Ipv4Addr>().map_err(|_| at(format!("`{a}` is not an IPv4 address")))?.into()),
                    ("AAAA", [a]) => address(a.parse::<Ipv6Addr>().map_err(|_| at(format!("`{a}` is not an IPv6 address")))?.into()),
                    ("NS", [ns]) => {
                        if zone.nameserver.replace(ns.to_string()).is_some() {
                            return Err(at("a second NS record (trellis writes one)".into()));
                        }
                    }
                    ("SOA", [_mname, _rname, serial, refresh, retry, expire, minimum]) => {
                        if std::mem::replace(&mut seen_soa, true) {
                            return Err(at("a second SOA record".into()));
                        }
                        for v in [refresh, retry, expire, minimum] {
                            v.parse::<u32>().map_err(|_| at(format!("SOA timer `{v}` is not a number")))?;
                        }
                        zone.serial = Some(serial.parse().map_err(|_| at(format!("SOA serial `{serial}` is not a number")))?);
                    }
                    ("A" | "AAAA" | "NS" | "SOA", _) => return Err(at(format!("{kind} record with {} data fields", data.len()))),
                    _ => return Err(at(format!("record type `{kind}` is not one trellis writes"))),
                }
            }
            _ => return Err(at(format!("expected `$ORIGIN`, `$TTL` or `NAME IN TYPE DATA`, found `{line}`"))),
        }
    }
    if zone.origin.is_empty() {
        return Err(ZoneError { line: text.lines().count().max(1), problem: "no $ORIGIN".into() });
    }
    // The name server's own records (`ns`, when the NS record names `ns.ORIGIN.`) are the node's
    // resolver, not a name it may reach.
    if let Some(own) = zone.nameserver_name().map(str::to_string) {
        let (of_nameserver, others) = std::mem::take(&mut zone.records).into_iter().partition(|r| r.name == own);
        zone.records = others;
        zone.nameserver_addresses = of_nameserver.into_iter().map(|r: AddressRecord| r.address).collect();
    }
    Ok(zone)
}

/// Checks a part of a zone (ADR 0043) as `render::zone_files` writes it: comments and address
/// records (`NAME IN A|AAAA ADDRESS`) of the nodes' and modules' names only, each line ended. The
/// zone served is `mesh.zone` and its parts one after the other, so a part that set the origin
/// or the TTL, held an SOA or NS record, named the zone itself (`@`) or its name server, or ran
/// its last line on into the next file, would change what the rest of the zone means: refused,
/// naming the part's path and line.
pub fn check_part(text: &str, path: &str) -> Result<(), String> {
    if !text.is_empty() && !text.ends_with('\n') {
        return Err(format!("{path} line {}: a part of the zone ends with its last line ended (a newline)", text.lines().count()));
    }
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split(';').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let named = |name: &str| !name.starts_with('$') && name != "@" && name != crate::decl::NAMESERVER;
        let record = match line.split_whitespace().collect::<Vec<_>>()[..] {
            [name, "IN", "A", a] => named(name) && a.parse::<Ipv4Addr>().is_ok(),
            [name, "IN", "AAAA", a] => named(name) && a.parse::<Ipv6Addr>().is_ok(),
            _ => false,
        };
        if !record {
            return Err(format!(
                "{path} line {}: a part of the zone holds address records only (NAME IN A|AAAA ADDRESS), not `{line}`",
                n + 1
            ));
        }
    }
    Ok(())
}

impl Zone {
    /// The name server's name relative to the origin (`ns` for `ns.lab.mesh.` in `lab.mesh`), when
    /// the NS record names a name inside the zone.
    pub fn nameserver_name(&self) -> Option<&str> {
        let ns = self.nameserver.as_deref()?.strip_suffix('.')?.strip_suffix(self.origin.as_str())?.strip_suffix('.')?;
        (!ns.is_empty()).then_some(ns)
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use crate::plan::MESH_ZONE;
    use crate::{compile, load, SourceFile};

    const MESH: &str = "[mesh]\nname = \"z\"\ndomain = \"z.mesh\"\noverlay_ipv4 = \"10.7.0.0/16\"\noverlay_ipv6 = \"fd07::/64\"\n\n[networks]\nlan = {}\n\n[[node]]\nname = \"alpha\"\nnetworks = [\"lan\"]\nmodules = [\"web\"]\n\n[[node]]\nname = \"beta\"\nnetworks = [\"lan\"]\nmodules = [\"web\"]\n\n[[node]]\nname = \"gamma\"\nnetworks = [\"lan\"]\n";
    const WEB: &str = "[module]\nname = \"web\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"80\"]\nfrom = [\"node:gamma\"]\n";

    fn zone_of(compiled: &crate::Compiled, node: &str) -> super::Zone {
        let text = &compiled.nodes[node].files.iter().find(|f| f.path == MESH_ZONE).expect("a zone file").content;
        super::parse(&text.to_string()).unwrap()
    }

    #[test]
    fn reads_back_what_render_writes_and_each_node_sees_only_its_business() {
        let loaded = load(
            &SourceFile { path: "mesh.toml".into(), text: MESH.into() },
            &[SourceFile { path: "modules/web.toml".into(), text: WEB.into() }],
        );
        let decl = loaded.declaration.unwrap_or_else(|| panic!("{:?}", loaded.diagnostics));
        let compiled = compile(&std::sync::Arc::new(decl), &Default::default(), &Default::default(), None).expect("compiles");
        // gamma may reach web on alpha and beta: it resolves them and the module.
        let zone = zone_of(&compiled, "gamma");
        assert_eq!(zone.origin, "z.mesh");
        assert_eq!(zone.ttl, Some(60));
        assert!(zone.serial.is_some());
        assert_eq!(zone.nameserver.as_deref(), Some("ns.z.mesh."));
        let own = &compiled.nodes["gamma"].plan;
        assert_eq!(
            zone.nameserver_addresses,
            [IpAddr::from(own.ipv4.unwrap()), IpAddr::from(own.ipv6.unwrap())],
            "ns is gamma's own resolver"
        );
        let by_name = zone.addresses();
        assert_eq!(by_name.keys().copied().collect::<Vec<_>>(), ["alpha", "beta", "gamma", "web"]);
        for (name, node) in &compiled.nodes {
            let want: Vec<IpAddr> = [node.plan.ipv4.map(IpAddr::from), node.plan.ipv6.map(IpAddr::from)].into_iter().flatten().collect();
            assert_eq!(by_name[name.as_str()], want, "{name}");
        }
        let mut web = by_name["web"].clone();
        let mut runners: Vec<IpAddr> = ["alpha", "beta"].iter().flat_map(|n| by_name[n].clone()).collect();
        web.sort();
        runners.sort();
        assert_eq!(web, runners, "a module's name answers with the addresses of the nodes that run it");
        // alpha and beta have traffic with gamma only, and may reach no module.
        for (node, seen) in [("alpha", ["alpha", "gamma"]), ("beta", ["beta", "gamma"])] {
            let zone = zone_of(&compiled, node);
            assert_eq!(zone.addresses().keys().copied().collect::<Vec<_>>(), seen, "the zone of {node}");
            assert_ne!(zone.serial, zone_of(&compiled, "gamma").serial, "the serial follows the records");
        }
    }

    #[test]
    fn refuses_a_line_it_does_not_understand_with_its_number() {
        let head = "; c\n$ORIGIN z.mesh.\n$TTL 60\n";
        let cases = [
            ("alpha\tIN\tMX\t10 mail\n", 4, "record type `MX`"),
            ("alpha\tIN\tA\t10.0.0.300\n", 4, "not an IPv4 address"),
            ("alpha\tIN\tAAAA\t10.0.0.1\n", 4, "not an IPv6 address"),
            ("alpha\tCH\tA\t10.0.0.1\n", 4, "expected"),
            ("\nalpha\tIN\tA\n", 5, "A record with 0 data fields"),
        ];
        for (tail, line, problem) in cases {
            let e = super::parse(&format!("{head}{tail}")).unwrap_err();
            assert_eq!(e.line, line, "{tail:?}: {e}");
            assert!(e.to_string().contains(problem), "{tail:?}: {e}");
        }
        let e = super::parse("a\tIN\tA\t10.0.0.1\n").unwrap_err();
        assert_eq!((e.line, e.problem.as_str()), (1, "a record comes before $ORIGIN"));
        let e = super::parse("$ORIGIN z.mesh\n").unwrap_err();
        assert_eq!(e.line, 1, "{e}");
        for (text, line, problem) in [
            ("$ORIGIN z.mesh.\n$ORIGIN y.mesh.\n", 2, "a second $ORIGIN"),
            ("$ORIGIN .\n", 1, "the root"),
            ("$ORIGIN z.mesh.\n$TTL 60\n$TTL 60\n", 3, "a second $TTL"),
            ("$ORIGIN z.mesh.\n@ IN NS ns.z.mesh.\n@ IN NS ns.y.mesh.\n", 3, "a second NS"),
        ] {
            let e = super::parse(text).unwrap_err();
            assert_eq!(e.line, line, "{text:?}: {e}");
            assert!(e.problem.contains(problem), "{text:?}: {e}");
        }
    }

    #[test]
    fn the_name_servers_records_are_its_own_wherever_the_ns_record_stands() {
        let before = super::parse("$ORIGIN z.mesh.\nns IN A 10.0.0.1\nweb IN A 10.0.0.2\n@ IN NS ns.z.mesh.\n").unwrap();
        let after = super::parse("$ORIGIN z.mesh.\n@ IN NS ns.z.mesh.\nns IN A 10.0.0.1\nweb IN A 10.0.0.2\n").unwrap();
        assert_eq!(before, after);
        assert_eq!(before.nameserver_addresses, ["10.0.0.1".parse::<IpAddr>().unwrap()]);
        assert_eq!(before.addresses().keys().copied().collect::<Vec<_>>(), ["web"]);
        // A name server outside the zone has no records in it: `ns` is then a name like any other.
        let outside = super::parse("$ORIGIN z.mesh.\n@ IN NS ns.y.mesh.\nns IN A 10.0.0.1\n").unwrap();
        assert!(outside.nameserver_addresses.is_empty());
        assert_eq!(outside.records.len(), 1);
    }

    /// ADR 0043: a part of a zone holds ended lines of address records of the nodes' and modules'
    /// names, and comments; anything that would change what the rest of the zone means is
    /// refused, naming the part and the line.
    #[test]
    fn a_part_of_the_zone_is_ended_lines_of_records_and_nothing_else() {
        let path = "etc/trellis/zone.d/names-03.zone";
        let ok = "; part 03\nn-1\tIN\tA\t10.0.0.1\nn-1\tIN\tAAAA\tfd00::1\n; x IN SOA a. b. 7 1 1 1 1\n\nssh IN A 10.0.0.2 ; a comment\n";
        assert_eq!(super::check_part(ok, path), Ok(()));
        assert_eq!(super::check_part("", path), Ok(()));
        for (bad, line) in [
            ("n-1\tIN\tA\t10.0.0.1", 1),
            ("n-1\tIN\tA\t10.0.0.1\n$ORIGIN evil.\n", 2),
            ("$TTL 5\n", 1),
            ("@\tIN\tSOA\tns.t. h.t. 7 1 1 1 1\n", 1),
            ("@\tIN\tNS\tns.t.\n", 1),
            ("@\tIN\tA\t10.0.0.9\n", 1),
            ("ns\tIN\tA\t10.0.0.9\n", 1),
            ("n-1\tIN\tA\tfd00::1\n", 1),
            ("n-1\tIN\tTXT\tx\n", 1),
            ("n-1\tIN\tA\t10.0.0.1 10.0.0.2\n", 1),
        ] {
            let e = super::check_part(bad, path).expect_err(bad);
            assert!(e.starts_with(&format!("{path} line {line}:")), "{bad:?}: {e}");
        }
    }
}

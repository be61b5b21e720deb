//! The lab file reader (`trellis lab up FILE`), and the check of a lab against the declaration
//! it runs (here `lab/basic`, read once).
//!
//! Reading is deterministic; a lab that reads has every host address inside a declared net of
//! its family, every route to a declared net, and every DNS expectation naming its answer or
//! NXDOMAIN; its declaration directory is found beside the file.
#![no_main]

use std::net::IpAddr;
use std::path::Path;
use std::sync::OnceLock;

use ipnet::IpNet;
use libfuzzer_sys::fuzz_target;
use trellis_core::Declaration;

const BASIC_MESH: &str = include_str!("../../lab/basic/mesh.toml");
const BASIC_MODULES: &[(&str, &str)] = &[
    ("modules/api.toml", include_str!("../../lab/basic/modules/api.toml")),
    ("modules/http.toml", include_str!("../../lab/basic/modules/http.toml")),
    ("modules/ping.toml", include_str!("../../lab/basic/modules/ping.toml")),
    ("modules/postgres.toml", include_str!("../../lab/basic/modules/postgres.toml")),
    ("modules/resolver.toml", include_str!("../../lab/basic/modules/resolver.toml")),
    ("modules/ssh.toml", include_str!("../../lab/basic/modules/ssh.toml")),
];

fn basic() -> &'static Declaration {
    static DECL: OnceLock<Declaration> = OnceLock::new();
    DECL.get_or_init(|| {
        let mut files = vec![("mesh.toml".to_string(), BASIC_MESH.to_string())];
        files.extend(BASIC_MODULES.iter().map(|(p, t)| (p.to_string(), t.to_string())));
        trellis_core::load_relative(&files, str::to_string).declaration.expect("lab/basic loads")
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let file = Path::new("lab/fuzz.toml");
    let read = trellis_lab::file::parse(text, file);
    let again = trellis_lab::file::parse(text, file);
    let (lab, decl) = match (read, again) {
        (Ok(a), Ok(_)) => a,
        (Err(a), Err(b)) => {
            assert_eq!(a.to_string(), b.to_string(), "reading is deterministic");
            return;
        }
        (a, b) => panic!("reading is not deterministic: {:?} then {:?}", a.map(|_| ()), b.map(|_| ())),
    };
    assert_eq!(decl, Path::new("lab").join(&lab.lab.declaration));
    for h in &lab.host {
        for (net, addr) in &h.addresses {
            let n = lab.net(net).unwrap_or_else(|| panic!("host {} is on net {net}, which is not declared", h.name));
            let ip: IpAddr = addr.parse().unwrap_or_else(|_| panic!("host {}: {addr:?} is not an address", h.name));
            assert!(
                [&n.ipv4, &n.ipv6].into_iter().flatten().any(|p| p.parse::<IpNet>().is_ok_and(|p| p.contains(&ip))),
                "host {} address {ip} is outside net {net}",
                h.name
            );
        }
    }
    for n in &lab.net {
        for target in [&n.nat, &n.firewall].into_iter().flatten() {
            assert!(lab.net(target).is_some(), "net {} routes to {target}, which is not declared", n.name);
        }
        let _ = (n.prefix(false), n.prefix(true));
    }
    for e in lab.expect.iter().filter(|e| e.dns.is_some()) {
        let answers = e.answer.as_ref().is_some_and(|a| !a.is_empty());
        assert_ne!(answers, e.result == Some(trellis_lab::file::Outcome::Nxdomain), "{e:?}");
    }
    let _ = trellis_lab::file::check_endpoints(&lab, basic());
});

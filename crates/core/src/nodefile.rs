//! `etc/trellis/node.toml`, what the agent needs to know about its own node beyond the other
//! three files: one type, written by `render` and read back by the agent. Pure.

use std::fmt::{self, Write};

use ipnet::IpNet;
use toml::de::{DeTable, DeValue};

/// A node's settings, as `node.toml` holds them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFile {
    pub node: String,
    pub mesh: String,
    /// The WireGuard interface's name.
    pub interface: String,
    /// The DNS zone's name (the mesh domain).
    pub zone: String,
    /// It relays for others: a hub forwards between its overlay peers.
    pub hub: bool,
    /// It forwards from the overlay to routes.
    pub router: bool,
    /// The prefixes this node sends into the overlay.
    pub routes: Vec<IpNet>,
    /// Its internet traffic leaves through an exit.
    pub exit: bool,
}

/// What the comments of a written `node.toml` name, for the person who reads the file; the
/// reader ignores comments.
#[derive(Clone, Debug, Default)]
pub struct Comments<'a> {
    /// The routes a router forwards to.
    pub forwards_to: Vec<&'a str>,
    /// The route whose exit the node's internet traffic leaves through.
    pub exit_through: Option<&'a str>,
}

impl NodeFile {
    /// The file's text: the keys in a fixed order, `router`, `routes` and `exit` only when set.
    pub fn write(&self, comments: &Comments) -> String {
        let mut s = format!("# trellis: settings of node {} in mesh {}. Generated; do not edit.\n", self.node, self.mesh);
        let _ = writeln!(s, "node = {}", quoted(&self.node));
        let _ = writeln!(s, "mesh = {}", quoted(&self.mesh));
        let _ = writeln!(s, "interface = {}", quoted(&self.interface));
        let _ = writeln!(s, "zone = {}", quoted(&self.zone));
        let _ = writeln!(s, "hub = {}", self.hub);
        if self.router {
            if !comments.forwards_to.is_empty() {
                let names: Vec<String> = comments.forwards_to.iter().map(|n| quoted(n)).collect();
                let _ = writeln!(s, "# Routes this node forwards to: {}", names.join(", "));
            }
            s.push_str("router = true\n");
        }
        if !self.routes.is_empty() {
            let prefixes: Vec<String> = self.routes.iter().map(|p| format!("\"{p}\"")).collect();
            let _ = writeln!(s, "routes = [{}]", prefixes.join(", "));
        }
        if self.exit {
            if let Some(route) = comments.exit_through {
                let _ = writeln!(s, "# Internet traffic leaves through route {route}");
            }
            s.push_str("exit = true\n");
        }
        s
    }

    /// Reads the file: `node`, `mesh`, `interface`, `zone` and `hub` are required, `router`,
    /// `routes` and `exit` default to false and none; any other key is an error naming it.
    pub fn parse(text: &str) -> Result<NodeFile, NodeFileError> {
        let table = DeTable::parse(text).map_err(|e| NodeFileError {
            line: e.span().map(|s| line_of(text, s.start)),
            problem: format!("invalid TOML: {}", e.message().trim_end_matches('\n')),
        })?;
        let mut file = NodeFile::default();
        let (mut node, mut mesh, mut interface, mut zone, mut hub) = (None, None, None, None, None);
        for (key, value) in table.get_ref().iter() {
            let at = |problem: String| NodeFileError { line: Some(line_of(text, value.span().start)), problem };
            let string = || value.get_ref().as_str().map(str::to_string).ok_or_else(|| at(wrong(key, "a string", value.get_ref())));
            let boolean = || value.get_ref().as_bool().ok_or_else(|| at(wrong(key, "true or false", value.get_ref())));
            match key.get_ref().as_ref() {
                "node" => node = Some(string()?),
                "mesh" => mesh = Some(string()?),
                "interface" => interface = Some(string()?),
                "zone" => zone = Some(string()?),
                "hub" => hub = Some(boolean()?),
                "router" => file.router = boolean()?,
                "exit" => file.exit = boolean()?,
                "routes" => {
                    let items = value.get_ref().as_array().ok_or_else(|| at(wrong(key, "an array of prefixes", value.get_ref())))?;
                    for item in items.iter() {
                        let prefix = item.get_ref().as_str().and_then(|s| s.parse().ok());
                        file.routes.push(prefix.ok_or_else(|| NodeFileError {
                            line: Some(line_of(text, item.span().start)),
                            problem: "`routes` holds something that is not a prefix (\"192.168.10.0/24\")".into(),
                        })?);
                    }
                }
                other => return Err(at(format!("unknown key `{other}`"))),
            }
        }
        file.node = required(node, "node")?;
        file.mesh = required(mesh, "mesh")?;
        file.interface = required(interface, "interface")?;
        file.zone = required(zone, "zone")?;
        file.hub = required(hub, "hub")?;
        Ok(file)
    }
}

/// A TOML basic string, which is also a JSON string, and so a YAML one (`traefik` writes Traefik's
/// static configuration with it). Names reach here validated (none holds a quote, a backslash or
/// a control character), so this is `"NAME"`; the escapes keep any other value one string in all
/// three, YAML's own line breaks (U+2028, U+2029) included.
pub(crate) fn quoted(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() || c == '\u{2028}' || c == '\u{2029}' => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn required<T>(value: Option<T>, key: &str) -> Result<T, NodeFileError> {
    value.ok_or_else(|| NodeFileError { line: None, problem: format!("no `{key}`") })
}

fn wrong(key: &toml::Spanned<std::borrow::Cow<str>>, want: &str, found: &DeValue) -> String {
    format!("`{}` must be {want}, found {}", key.get_ref(), found.type_str())
}

/// The 1-based line of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// A `node.toml` this reader refuses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeFileError {
    /// 1-based line number, when the problem is on one line.
    pub line: Option<usize>,
    pub problem: String,
}

impl fmt::Display for NodeFileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "node.toml line {line}: {}", self.problem),
            None => write!(f, "node.toml: {}", self.problem),
        }
    }
}

impl std::error::Error for NodeFileError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain() -> NodeFile {
        NodeFile {
            node: "db-1".into(),
            mesh: "acme".into(),
            interface: "trellis0".into(),
            zone: "acme.mesh".into(),
            hub: false,
            router: false,
            routes: Vec::new(),
            exit: false,
        }
    }

    #[test]
    fn reads_back_what_it_writes() {
        let routed = NodeFile {
            hub: true,
            router: true,
            routes: vec!["192.168.10.0/24".parse().unwrap(), "fd10::/64".parse().unwrap()],
            exit: true,
            ..plain()
        };
        let odd = NodeFile { node: "a\"b\\c\td".into(), ..plain() };
        let comments = Comments { forwards_to: vec!["office-lan", "lab"], exit_through: Some("internet") };
        for file in [plain(), routed, odd] {
            for c in [&Comments::default(), &comments] {
                let text = file.write(c);
                assert_eq!(NodeFile::parse(&text).as_ref(), Ok(&file), "{text}");
            }
        }
    }

    #[test]
    fn writes_the_keys_in_order_with_their_comments() {
        let file = NodeFile { router: true, routes: vec!["192.168.10.0/24".parse().unwrap()], exit: true, ..plain() };
        let comments = Comments { forwards_to: vec!["office-lan", "lab"], exit_through: Some("internet") };
        assert_eq!(
            file.write(&comments),
            "# trellis: settings of node db-1 in mesh acme. Generated; do not edit.\nnode = \"db-1\"\nmesh = \"acme\"\n\
             interface = \"trellis0\"\nzone = \"acme.mesh\"\nhub = false\n# Routes this node forwards to: \"office-lan\", \"lab\"\n\
             router = true\nroutes = [\"192.168.10.0/24\"]\n# Internet traffic leaves through route internet\nexit = true\n"
        );
    }

    #[test]
    fn refuses_what_it_does_not_know_naming_the_key_and_line() {
        let base = "node = \"db-1\"\nmesh = \"acme\"\ninterface = \"trellis0\"\nzone = \"acme.mesh\"\n";
        let err = |text: &str| NodeFile::parse(text).unwrap_err().to_string();
        assert_eq!(err(base), "node.toml: no `hub`");
        assert_eq!(err(&format!("{base}hub = \"yes\"\n")), "node.toml line 5: `hub` must be true or false, found string");
        assert_eq!(err(&format!("{base}hub = false\nrelay = true\n")), "node.toml line 6: unknown key `relay`");
        assert_eq!(
            err(&format!("{base}hub = false\nroutes = [\"10.0.0.0/8\", \"lan\"]\n")),
            "node.toml line 6: `routes` holds something that is not a prefix (\"192.168.10.0/24\")"
        );
        assert!(err("node = ").starts_with("node.toml line 1: invalid TOML"), "{}", err("node = "));
    }
}

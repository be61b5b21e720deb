//! The mesh as a picture: every node, who peers with whom directly, which pairs go through which
//! hub, laid out on circles (hubs inside, the others around them) and drawn as Graphviz DOT or as
//! SVG by this module itself (no Graphviz needed). Values in, text out; the states to colour by
//! are an argument (the controller knows them, an offline declaration does not).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use crate::topology::{Path, Topology};

/// One node of the picture, with where it is drawn (a 1000 by 1000 canvas).
#[derive(Clone, Debug, PartialEq)]
pub struct Spot {
    pub name: String,
    pub hub: bool,
    pub networks: Vec<String>,
    pub x: f64,
    pub y: f64,
}

/// How the two nodes of a link reach each other.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reach {
    /// A WireGuard peering: one dials the other.
    Direct,
    /// They have traffic with each other, through this hub (each peers with it).
    Relayed(String),
    /// They have traffic with each other and no path: a diagnostic of `check`.
    None,
}

/// Two nodes with allowed traffic between them (either way), or a node and a hub that relays
/// for it. `a` sorts before `b`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Link {
    pub a: String,
    pub b: String,
    pub reach: Reach,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Graph {
    pub nodes: Vec<Spot>,
    pub links: Vec<Link>,
}

/// The picture of a declared topology. Keys are not considered: it is what the declaration says.
pub fn graph(topo: &Topology) -> Graph {
    let partners = topo.partners();
    let mut links = BTreeSet::new();
    for (a, ps) in partners.iter().enumerate() {
        let a = a as u32;
        for &b in ps.iter().filter(|&&b| b > a) {
            let (x, y) = ordered(topo.name(a), topo.name(b));
            match topo.path(a, b, false) {
                Path::Direct => {
                    links.insert(Link { a: x, b: y, reach: Reach::Direct });
                }
                Path::Relay { hub } => {
                    let h = topo.name(hub).to_string();
                    for n in [a, b] {
                        let (p, q) = ordered(topo.name(n), &h);
                        links.insert(Link { a: p, b: q, reach: Reach::Direct });
                    }
                    links.insert(Link { a: x, b: y, reach: Reach::Relayed(h) });
                }
                Path::None => {
                    links.insert(Link { a: x, b: y, reach: Reach::None });
                }
            }
        }
    }
    let mut names: Vec<(bool, &str)> = topo.nodes.iter().map(|n| (n.hub, n.name.as_str())).collect();
    names.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    let hubs = names.iter().filter(|(h, _)| *h).count();
    let others = names.len() - hubs;
    let nodes = names
        .iter()
        .enumerate()
        .map(|(i, (hub, name))| {
            let (k, n, r) = if *hub { (i, hubs, if hubs == 1 { 0.0 } else { 160.0 }) } else { (i - hubs, others, 400.0) };
            let angle = std::f64::consts::TAU * k as f64 / n.max(1) as f64 - std::f64::consts::FRAC_PI_2;
            let node = topo.decl.node(name).expect("a node of the topology");
            Spot {
                name: name.to_string(),
                hub: *hub,
                networks: node.networks.clone(),
                x: (500.0 + r * angle.cos()).round(),
                y: (500.0 + r * angle.sin()).round(),
            }
        })
        .collect();
    Graph { nodes, links: links.into_iter().collect() }
}

fn ordered(a: &str, b: &str) -> (String, String) {
    if a <= b {
        (a.to_string(), b.to_string())
    } else {
        (b.to_string(), a.to_string())
    }
}

/// SVG path data for a link: a straight line for a peering, a curve for a pair relayed through a
/// hub (or with no path), so that it stays visible beside the peerings with the hub, which often
/// lie along the same line.
pub fn curve(a: &Spot, b: &Spot, reach: &Reach) -> String {
    match reach {
        Reach::Direct => format!("M{} {} L{} {}", a.x, a.y, b.x, b.y),
        _ => {
            let (mx, my) = ((a.x + b.x) / 2.0, (a.y + b.y) / 2.0);
            let (cx, cy) = ((mx - (b.y - a.y) * 0.3).round(), (my + (b.x - a.x) * 0.3).round());
            format!("M{} {} Q{cx} {cy} {} {}", a.x, a.y, b.x, b.y)
        }
    }
}

/// A node's state as the picture draws it. The controller's live page converts the API's
/// `proto::Shown` into it (the core knows no wire format); an offline declaration has none, and
/// its nodes are drawn as declared (a hub as a hub).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    Active,
    Pending,
    /// Revoked, with a node that held its key not having applied a bundle without it.
    Revoking,
    Revoked,
    /// Active, with its desired version not applied.
    Stale,
    /// Active, with its last apply failed.
    Failing,
    Declared,
    External,
    Removed,
}

impl State {
    /// The name the picture labels a node with: the state's name in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Active => "active",
            State::Pending => "pending",
            State::Revoking => "revoking",
            State::Revoked => "revoked",
            State::Stale => "stale",
            State::Failing => "failing",
            State::Declared => "declared",
            State::External => "external",
            State::Removed => "removed",
        }
    }
}

/// The colour a state is drawn in (the live page uses the same ones).
pub fn colour(state: State) -> &'static str {
    match state {
        State::Active => "#2e7d32",
        State::Pending => "#f9a825",
        State::Revoking => "#ad1457",
        State::Revoked => "#c62828",
        State::Stale => "#ef6c00",
        State::Failing => "#6a1b9a",
        State::Declared | State::External | State::Removed => OTHER,
    }
}

/// A hub with no state to show.
const HUB: &str = "#1565c0";

/// The colour of every state not named in [`colour`].
const OTHER: &str = "#78909c";

fn fill(spot: &Spot, states: &BTreeMap<String, State>) -> &'static str {
    match states.get(&spot.name) {
        Some(s) => colour(*s),
        None if spot.hub => HUB,
        None => colour(State::Declared),
    }
}

/// Graphviz DOT: solid edges are peerings, dashed ones pairs relayed through the hub named on
/// them, red dotted ones pairs with no path.
pub fn dot(g: &Graph, states: &BTreeMap<String, State>) -> String {
    let mut s =
        String::from("graph mesh {\n  layout=neato;\n  node [shape=circle style=filled fontcolor=white fontname=\"sans-serif\"];\n");
    for n in &g.nodes {
        let state = states.get(&n.name).map(|s| format!("\\n{}", s.as_str())).unwrap_or_default();
        let _ = writeln!(
            s,
            "  \"{}\" [label=\"{}{}\" fillcolor=\"{}\" pos=\"{},{}!\"{}];",
            n.name,
            n.name,
            state,
            fill(n, states),
            n.x / 72.0,
            (1000.0 - n.y) / 72.0,
            if n.hub { " shape=doublecircle" } else { "" }
        );
    }
    for l in &g.links {
        let style = match &l.reach {
            Reach::Direct => String::new(),
            Reach::Relayed(h) => format!(" [style=dashed label=\"via {h}\"]"),
            Reach::None => " [style=dotted color=red label=\"no path\"]".to_string(),
        };
        let _ = writeln!(s, "  \"{}\" -- \"{}\"{style};", l.a, l.b);
    }
    s.push_str("}\n");
    s
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// SVG, drawn here: the same layout and styles as [`dot`], with a legend.
pub fn svg(g: &Graph, states: &BTreeMap<String, State>) -> String {
    let at: BTreeMap<&str, &Spot> = g.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let mut s = String::from(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 1000 1000\" width=\"1000\" height=\"1000\" font-family=\"sans-serif\">\n\
         <rect width=\"1000\" height=\"1000\" fill=\"white\"/>\n",
    );
    for l in &g.links {
        let (Some(a), Some(b)) = (at.get(l.a.as_str()), at.get(l.b.as_str())) else { continue };
        let (style, title) = match &l.reach {
            Reach::Direct => ("stroke=\"#455a64\" stroke-width=\"2\"".to_string(), format!("{} and {} peer directly", l.a, l.b)),
            Reach::Relayed(h) => (
                "stroke=\"#90a4ae\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"".to_string(),
                format!("{} and {} through hub {h}", l.a, l.b),
            ),
            Reach::None => {
                ("stroke=\"#c62828\" stroke-width=\"1.5\" stroke-dasharray=\"2 4\"".to_string(), format!("{} and {}: no path", l.a, l.b))
            }
        };
        let _ = writeln!(s, "<path d=\"{}\" fill=\"none\" {style}><title>{}</title></path>", curve(a, b, &l.reach), escape(&title));
    }
    for n in &g.nodes {
        let state = states.get(&n.name).map_or(if n.hub { "hub" } else { "declared" }, |s| s.as_str());
        let _ = writeln!(
            s,
            "<g><title>{} ({state}; networks: {})</title><circle cx=\"{}\" cy=\"{}\" r=\"{}\" fill=\"{}\" stroke=\"#263238\" stroke-width=\"{}\"/>\
             <text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"16\">{}</text></g>",
            escape(&n.name),
            escape(&n.networks.join(", ")),
            n.x,
            n.y,
            if n.hub { 26 } else { 20 },
            fill(n, states),
            if n.hub { 4 } else { 1 },
            n.x,
            n.y + if n.hub { 46.0 } else { 40.0 },
            escape(&n.name)
        );
    }
    s.push_str(
        "<g font-size=\"14\"><line x1=\"20\" y1=\"960\" x2=\"60\" y2=\"960\" stroke=\"#455a64\" stroke-width=\"2\"/><text x=\"66\" y=\"965\">peers directly</text>\
         <line x1=\"200\" y1=\"960\" x2=\"240\" y2=\"960\" stroke=\"#90a4ae\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"/><text x=\"246\" y=\"965\">through a hub</text>\
         <line x1=\"380\" y1=\"960\" x2=\"420\" y2=\"960\" stroke=\"#c62828\" stroke-width=\"1.5\" stroke-dasharray=\"2 4\"/><text x=\"426\" y=\"965\">no path</text></g>\n</svg>\n",
    );
    s
}

#[cfg(test)]
mod tests {

    use super::*;

    fn relayed_mesh() -> crate::Declaration {
        let mesh = r#"
[mesh]
name = "m"
domain = "m.mesh"
overlay_ipv4 = "10.9.0.0/24"

[networks]
internet = {}
site-a = {}
site-b = {}

[[node]]
name = "hub-1"
hub = true
networks = ["internet"]
  [[node.endpoint]]
  address = "198.51.100.1:51820"
  reachable_from = ["internet", "site-a", "site-b"]

[[node]]
name = "a-1"
networks = ["site-a"]
modules = ["web"]

[[node]]
name = "b-1"
networks = ["site-b"]
"#;
        let web = "[module]\nname = \"web\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"80\"]\nfrom = [\"node:b-1\"]\n";
        let file = |path: &str, text: &str| crate::SourceFile { path: path.to_string(), text: text.to_string() };
        crate::load(&file("mesh.toml", mesh), &[file("modules/web.toml", web)]).declaration.expect("a valid declaration")
    }

    #[test]
    fn a_relayed_pair_is_drawn_through_its_hub_and_both_peer_with_it() {
        let decl = relayed_mesh();
        let alloc = crate::allocate(&decl, &Default::default()).unwrap();
        let topo = Topology::new(&decl, &alloc, &crate::keys::Keys::default());
        let g = graph(&topo);
        let link = |a: &str, b: &str, reach: Reach| Link { a: a.into(), b: b.into(), reach };
        assert_eq!(
            g.links,
            vec![
                link("a-1", "b-1", Reach::Relayed("hub-1".into())),
                link("a-1", "hub-1", Reach::Direct),
                link("b-1", "hub-1", Reach::Direct)
            ]
        );
        assert_eq!(g.nodes[0].name, "hub-1", "hubs first, in the middle");
        assert_eq!((g.nodes[0].x, g.nodes[0].y), (500.0, 500.0));
        let states = BTreeMap::from([("a-1".to_string(), State::Revoked)]);
        let dot = dot(&g, &states);
        assert!(dot.contains("\"a-1\" -- \"b-1\" [style=dashed label=\"via hub-1\"];"), "{dot}");
        assert!(dot.contains("fillcolor=\"#c62828\""), "a revoked node is red: {dot}");
        let svg = svg(&g, &states);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<circle").count(), 3);
        assert_eq!(svg.matches("<path").count(), 3, "three links");
        assert_eq!(svg.matches(" Q").count(), 1, "the relayed pair is drawn as a curve");
        assert!(svg.contains("a-1 and b-1 through hub hub-1"), "{svg}");
    }
}

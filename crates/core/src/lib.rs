//! The pure core of trellis: the declaration model and its validation, overlay address
//! allocation, the path rule, and the compiler that turns a declared mesh into each node's file
//! resources. No async runtime, no database, no filesystem and no clock: values in, values out.

pub mod alloc;
pub mod bundle;
pub mod certs;
pub mod check;
pub mod compile;
pub mod decl;
pub mod delta;
pub mod diag;
pub mod explain;
pub mod graph;
pub mod keys;
pub mod load;
pub mod nodefile;
pub mod par;
pub mod paths;
pub mod plan;
pub mod release;
pub mod render;
pub mod ruleset;
pub mod text;
pub mod token;
pub mod topology;
pub mod traefik;
pub mod trust;
pub mod wgconf;
pub mod zone;

pub use alloc::{allocate, allocate_after, Allocation};
pub use check::{check, Checked};
pub use compile::{compile, Compiled};
pub use decl::Declaration;
pub use diag::{Diagnostic, Loc, Severity};
pub use keys::Keys;
pub use load::{load, load_relative, Loaded, SourceFile};
pub use plan::{FileResource, NodePlan};
pub use text::Text;

/// A hash map for the compiler's maps by name: foldhash, randomly seeded per map, is several
/// times faster than the default SipHash on short names, and names come from the declaration.
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
/// A set hashed as [`FastMap`] is.
pub type FastSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;

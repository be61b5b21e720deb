//! `Limits`: what one controller lets its clients hold, which the listener enforces on
//! connections and the body extractor on request bodies.

use std::time::Duration;

/// What one controller lets its clients hold: bounds that keep a flood of connections, or
/// connections that never finish their request, from starving everyone else.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections open at once; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Connections open at once from one source address.
    pub per_source: usize,
    /// How long a request body may take to arrive.
    pub body_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        // Below the 65,536 descriptors the shipped unit allows, with room for the database and
        // files; one source (a NAT in front of many agents) may hold a quarter.
        Limits { max_connections: 60_000, per_source: 15_000, body_timeout: Duration::from_secs(30) }
    }
}

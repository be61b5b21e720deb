//! Integration tests of the core: diagnostics, golden renderings, allocation and properties.

mod allocation;
mod certs;
mod deltas;
mod diagnostics;
mod exposures;
mod golden;
mod incremental;
mod load_cache;
mod paths;
mod pools;
mod props;
mod routes;
mod rulesets;
mod support;
mod zones;

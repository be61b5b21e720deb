//! End-to-end tests that drive the real `trellis` binary, and, as root, real network
//! namespaces with real nftables.

mod agent;
mod certs;
mod cli;
mod controller;
mod delivery;
mod docs;
mod doctor;
mod failover;
mod lab;
mod metrics;
mod nft;
mod pg_failover;
mod restores;
mod support;
mod trust;
mod ui;

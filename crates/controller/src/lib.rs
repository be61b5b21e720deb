//! The trellis controller: its state directory (`init`), the HTTPS API over rustls (`serve`),
//! enrolment, and the admin client the CLI uses. Policy is decided by `trellis-core`; records
//! live in `trellis-store`; this crate is the edge that does IO and reads the clock.

pub mod api;
pub mod client;
pub mod error;
pub mod files;
pub mod publish;
pub mod server;
pub mod state;

pub fn now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

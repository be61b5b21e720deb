//! The controller's HTTPS API: `fn app(controller) -> Router` and the TLS listener. Handlers are
//! thin adapters: an extractor parses the body or recognises the caller, the handler calls one
//! decision of `trellis-controller`, and `error` maps its refusal to an HTTP status, once.
//! A bundle long-poll waits in the controller's decision, which returns what to answer.

pub mod auth;
pub mod body;
pub mod certs;
pub mod error;
pub mod handlers;
pub mod limits;
pub mod listener;
pub mod metrics;
pub mod openapi;
pub mod params;
pub mod routes;
pub mod trust;
pub mod ui;

pub use limits::Limits;
pub use listener::Server;
pub use routes::app;

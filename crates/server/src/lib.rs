//! The controller's HTTPS API: `fn app(controller) -> Router` and the TLS listener. Handlers are
//! thin adapters: an extractor parses the body or recognises the caller, the handler calls one
//! decision of `trellis-controller`, and `error` maps its refusal to an HTTP status, once.
//! Long-polls wait here, on the publisher's change channel.

pub mod auth;
pub mod body;
pub mod error;
pub mod listener;
pub mod metrics;
pub mod openapi;
pub mod routes;
pub mod ui;

pub use listener::{Limits, Server};
pub use routes::app;

//! The live picture at `/ui/`: one page, its style and script inside it and inside the binary,
//! fetching nothing from elsewhere. The page itself holds no data: it asks for the admin
//! credential, keeps it for the browser tab (`sessionStorage`), and polls
//! `GET /v1/admin/graph` with it every second, redrawing in place; clicking two nodes shows
//! `GET /v1/admin/explain` between them. A refusal offers the form again, and a refused
//! credential is forgotten.

use axum::http::header;
use axum::response::IntoResponse;

const PAGE: &str = include_str!("ui/index.html");

/// The page's `Content-Security-Policy`.
pub const CSP: &str =
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'";

/// The page, with the state colours `core::graph` draws with.
#[utoipa::path(get, path = "/ui/", tag = "ui", responses((status = 200, description = "The live picture of the mesh (HTML; the data comes from /v1/admin/graph with the admin credential)", content_type = "text/html")))]
pub async fn page() -> impl IntoResponse {
    let colours: String = trellis_proto::Shown::ALL
        .iter()
        .map(|s| {
            let colour = trellis_core::graph::colour(trellis_controller::view::drawn(*s));
            format!(".s-{0} circle {{ fill: {colour}; }} .k-{0} {{ background: {colour}; }}\n", s.as_str())
        })
        .collect();
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // Nothing from elsewhere: the page's own script and style, and requests to this origin;
            // and no other page may frame it (a framed page can be clicked through unseen).
            (header::CONTENT_SECURITY_POLICY, CSP),
        ],
        PAGE.replace("/*COLOURS*/", &colours),
    )
}

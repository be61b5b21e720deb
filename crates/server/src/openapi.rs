//! The API description: an OpenAPI 3.1 document made from the routes' own `#[utoipa::path]`
//! annotations and the request and answer types of `trellis-proto` (`utoipa::ToSchema`), never
//! written by hand. Served at `GET /v1/openapi.json`.

use std::sync::OnceLock;

use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{InfoBuilder, OpenApi};

/// The document, made once.
pub fn document() -> &'static OpenApi {
    static DOC: OnceLock<OpenApi> = OnceLock::new();
    DOC.get_or_init(|| {
        let mut doc = crate::routes::api().into_openapi();
        describe(&mut doc);
        doc
    })
}

/// What the routes do not say themselves: the title, and the two ways callers prove who they
/// are.
fn describe(doc: &mut OpenApi) {
    doc.info = InfoBuilder::new()
        .title("trellis controller API")
        .version(env!("CARGO_PKG_VERSION"))
        .description(Some(
            "Enrolment, signed bundle delivery and evidence for nodes (mutual TLS with the node certificate), and the \
             administration of the mesh (the admin credential as a bearer token). Every refusal is an ErrorBody: one \
             sentence and a stable code.",
        ))
        .build();
    let components = doc.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "admin",
        SecurityScheme::Http(
            Http::builder().scheme(HttpAuthScheme::Bearer).description(Some("The admin credential (admin.token)")).build(),
        ),
    );
    components.add_security_scheme(
        "node",
        SecurityScheme::MutualTls {
            description: Some("The node's certificate, issued by the mesh CA at enrolment or renewal".to_string()),
            extensions: None,
        },
    );
}

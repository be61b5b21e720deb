//! The API description: an OpenAPI 3.1 document made from the routes' own `#[utoipa::path]`
//! annotations and the request and answer types of `trellis-proto` (`utoipa::ToSchema`), never
//! written by hand. Served at `GET /v1/openapi.json`.

use std::sync::OnceLock;

use trellis_proto::ErrorBody;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{ContentBuilder, InfoBuilder, ObjectBuilder, OpenApi, Ref, ResponseBuilder, Type};
use utoipa::{PartialSchema, ToSchema};

/// The document, made once.
pub fn document() -> &'static OpenApi {
    static DOC: OnceLock<OpenApi> = OnceLock::new();
    DOC.get_or_init(|| {
        let mut doc = crate::handlers::api().into_openapi();
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
             sentence and a stable code; besides each operation's own, a path no route serves is answered 404 \
             `no_route`, a method a path does not take 405 `method_not_allowed` (with `Allow`), a query string that \
             does not fit 400 `bad_query`, and a 401 carries `WWW-Authenticate`.",
        ))
        .build();
    let components = doc.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "admin",
        SecurityScheme::Http(
            Http::builder().scheme(HttpAuthScheme::Bearer).description(Some("The admin credential (admin.token)")).build(),
        ),
    );
    refusals(doc);
    challenges(doc);
    let components = doc.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "node",
        SecurityScheme::MutualTls {
            description: Some("The node's certificate, issued by the mesh CA at enrolment or renewal".to_string()),
            extensions: None,
        },
    );
}

/// The schema of the body every refusal carries (`error::Refusals`, and each `401`), which the
/// operations name by reference.
fn refusals(doc: &mut OpenApi) {
    let mut schemas = vec![(ErrorBody::name().into_owned(), ErrorBody::schema())];
    ErrorBody::schemas(&mut schemas);
    doc.components.get_or_insert_with(Default::default).schemas.extend(schemas);
}

/// Each operation that can answer `401` describes it with the `WWW-Authenticate` challenge it
/// carries (see `error::challenge`): the admin credential's, a node certificate's, or an
/// enrolment token's.
fn challenges(doc: &mut OpenApi) {
    for (path, item) in doc.paths.paths.iter_mut() {
        for op in [&mut item.get, &mut item.post, &mut item.put, &mut item.delete].into_iter().flatten() {
            let tags = op.tags.clone().unwrap_or_default();
            let (credential, challenge) = if tags.iter().any(|t| t == "admin") {
                ("the admin credential is missing or wrong", crate::error::ADMIN_CHALLENGE)
            } else if op.security.is_some() {
                ("no node certificate was presented, or it is not the mesh CA's", crate::error::NODE_CHALLENGE)
            } else if path == "/v1/enrol" {
                ("the enrolment token is unknown, wrong, revoked or expired", crate::error::ENROLMENT_CHALLENGE)
            } else {
                continue;
            };
            let header = HeaderBuilder::new()
                .schema(ObjectBuilder::new().schema_type(Type::String))
                .description(Some(format!("The credential asked for, e.g. `{challenge}`")))
                .build();
            let response = ResponseBuilder::new()
                .description(format!("Refused: {credential}; an ErrorBody"))
                .header("WWW-Authenticate", header)
                .content("application/json", ContentBuilder::new().schema(Some(Ref::from_schema_name("ErrorBody"))).build())
                .build();
            op.responses.responses.insert("401".to_string(), response.into());
        }
    }
}

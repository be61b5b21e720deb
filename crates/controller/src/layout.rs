//! The state directory's files, by name, in one table: what `trellis init` makes, what rotations
//! and restores add, and who writes each. A leaf: it imports nothing of the controller, so
//! `state`, `authority`, `trust` and the rest name the files without importing each other.
//!
//! | file                  | what it holds                                              | written by                     |
//! |-----------------------|------------------------------------------------------------|--------------------------------|
//! | `controller.toml`     | the configuration (`state::Config`)                        | `state::init`, last            |
//! | `ca.pem`, `ca.key`    | the mesh CA                                                | `init`, a CA rotation's end    |
//! | `ca.next.pem`, `.key` | the next mesh CA while its rotation is open (ADR 0029)     | `trellis rotate ca`            |
//! | `ca.retired.pem`      | the CA trusted before the last CA rotation (no key)        | a CA rotation's end            |
//! | `server.pem`, `.key`  | the server certificate                                     | `init`, renewal, CA rotation   |
//! | `services-ca.pem`, `.key` | the services intermediate CA (ADR 0023)                | `init`, scoping, CA rotation   |
//! | `signing.key`         | the bundle-signing key (base64 seed)                       | `init`, a key rotation's end   |
//! | `signing.next.key`    | the next signing key while its rotation is open (ADR 0027) | `trellis rotate signing-key`   |
//! | `signing.retired.pub` | the public half of the key retired last                    | a key rotation's end           |
//! | `admin.token`         | the admin credential                                       | `init`                         |
//! | `audit.checkpoint`    | the signed audit head (see `audit`)                        | every publish run              |
//! | `versions.high`       | the highest bundle version published (see `restore`)       | publish runs, by steps         |
//! | `revocations.ledger`  | revocations and removals, made again after a restore       | `ledger`                       |
//! | `trellis.db`          | the SQLite database, unless another is configured          | the store                      |

/// The configuration; its presence means the directory holds a complete controller.
pub const CONFIG: &str = "controller.toml";
/// The mesh CA's certificate and key.
pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";
/// The next mesh CA, written by `trellis rotate ca` into the state directory before the
/// rotation starts (the key 0600), read by every replica from its own copy.
pub const NEXT_CA_CERT: &str = "ca.next.pem";
pub const NEXT_CA_KEY: &str = "ca.next.key";
/// The CA trusted before the last rotation completed (its certificate only: its key is gone).
pub const RETIRED_CA_CERT: &str = "ca.retired.pem";
/// The server certificate and its key.
pub const SERVER_CERT: &str = "server.pem";
pub const SERVER_KEY: &str = "server.key";
/// The services intermediate CA's certificate and key (ADR 0023).
pub const SERVICES_CA_CERT: &str = "services-ca.pem";
pub const SERVICES_CA_KEY: &str = "services-ca.key";
/// The key bundles, stamps and checkpoints are signed with (base64 of the 32-byte seed).
pub const SIGNING_KEY: &str = "signing.key";
/// The next bundle-signing key, written by `trellis rotate signing-key` into the state
/// directory before the rotation starts (0600), read by every replica from its own copy.
pub const NEXT_SIGNING_KEY: &str = "signing.next.key";
/// The public half of the key bundles were signed with before the last rotation completed (its
/// base64), kept so that an operator can see which key was retired. Its private half is not
/// kept: after a rotation made because the state directory leaked it is worth nothing, and a
/// later leak of it would let its holder sign for nodes that were away through the overlap.
pub const RETIRED_SIGNING_KEY: &str = "signing.retired.pub";
/// The retired key's private half, as older controllers kept it: removed when found.
pub const RETIRED_SIGNING_KEY_OLD: &str = "signing.retired.key";
/// The admin credential (its SHA-256 is in the configuration).
pub const ADMIN_TOKEN: &str = "admin.token";
/// The signed checkpoint of the audit head, outside the database (see `audit`).
pub const CHECKPOINT: &str = "audit.checkpoint";
/// The highest bundle version this state directory published (see `restore`).
pub const HIGH_WATER: &str = "versions.high";
/// Every node and token revocation and controller removal (see `ledger`).
pub const LEDGER: &str = "revocations.ledger";
/// The SQLite database `trellis init` configures unless given another.
pub const DATABASE: &str = "trellis.db";

//! Bundles: the signed, versioned set of files the controller decides for one node, and the one
//! function that verifies them (used by the agent and by `trellis-agent verify`). Pure: the
//! signing key, the expected node and the last applied version are arguments (ADR 0012).
//!
//! Wire form: `TRB1` | ed25519 signature (64) | u32 manifest length | manifest | contents. The
//! signature covers `"trellis bundle signature v1\0" || manifest`; the manifest is canonical:
//! `"trellis-bundle-v1\n"` | str mesh | str node | u64 version | i64 issued_at | u32 n |
//! n × (str path | u32 mode | [32] sha256 | u64 length), where str is a u32 length and the bytes,
//! integers big endian. The contents follow in manifest order; each is bound to the signature by
//! its SHA-256 in the manifest. Signing the manifest, not the contents, keeps signing cheap and
//! lets a content shared by many bundles (the mesh zone) be hashed once and held once.

use bytes::Bytes;
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};

pub const MAGIC: &[u8; 4] = b"TRB1";
pub const FORMAT: &str = "trellis-bundle-v1\n";
const SIGNING_CONTEXT: &[u8] = b"trellis bundle signature v1\0";
/// The largest bundle anyone signs or accepts. At 100,000 nodes the bundle of a node that sees
/// every node (an operator's, a hub relaying for everyone) is about 29 MiB (a `wireguard.conf` of
/// 100,000 peers and a zone of 100,000 names): the bound is twice that.
pub const MAX_BUNDLE: usize = 64 * 1024 * 1024;
pub const MAX_FILES: usize = 256;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleFile {
    pub path: String,
    pub mode: u32,
    pub sha256: [u8; 32],
    pub content: Bytes,
}

impl BundleFile {
    pub fn new(path: impl Into<String>, mode: u32, content: impl Into<Bytes>) -> BundleFile {
        let content = content.into();
        BundleFile { path: path.into(), mode, sha256: Sha256::digest(&content).into(), content }
    }
}

/// A signed bundle as sent: the head (magic, signature, manifest) and the contents, kept apart
/// so that a content shared by many bundles is not copied into each. The contents are buffers,
/// or the compiled `Text`s themselves (the controller holds those).
#[derive(Clone, Debug)]
pub struct Signed<C = Bytes> {
    pub head: Bytes,
    pub contents: Vec<C>,
}

/// A bundle's content as `Signed` holds it.
pub trait Content {
    /// How many bytes it holds.
    fn byte_len(&self) -> usize;
    /// Appends the bytes to `out`.
    fn write_to(&self, out: &mut Vec<u8>);
}

impl Content for Bytes {
    fn byte_len(&self) -> usize {
        Bytes::len(self)
    }

    fn write_to(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self);
    }
}

impl Content for crate::Text {
    fn byte_len(&self) -> usize {
        crate::Text::len(self)
    }

    fn write_to(&self, out: &mut Vec<u8>) {
        self.pieces().for_each(|p| out.extend_from_slice(p.as_bytes()));
    }
}

impl<C: Content> Signed<C> {
    pub fn len(&self) -> usize {
        self.head.len() + self.contents.iter().map(Content::byte_len).sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bundle in one buffer, as a node receives it.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        out.extend_from_slice(&self.head);
        for c in &self.contents {
            c.write_to(&mut out);
        }
        out
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bundle {
    pub mesh: String,
    pub node: String,
    pub version: u64,
    /// Unix seconds.
    pub issued_at: i64,
    pub files: Vec<BundleFile>,
}

/// Why a bundle was refused. Each refusal has its own variant and sentence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BundleError {
    TooLarge {
        size: usize,
        max: usize,
    },
    UnknownFormat,
    BadSignature,
    Malformed(&'static str),
    WrongMesh {
        bundle: String,
        ours: String,
    },
    WrongNode {
        bundle: String,
        ours: String,
    },
    NotNewer {
        version: u64,
        last: u64,
    },
    EqualVersionOtherContent {
        version: u64,
    },
    FileDigest {
        path: String,
    },
    UnsafePath {
        path: String,
    },
    /// A delta that does not build the bundle it names from the one held (ADR 0033).
    Delta(crate::delta::DeltaError),
}

impl std::fmt::Display for BundleError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BundleError::TooLarge { size, max } => write!(f, "bundle is {size} bytes, over the bound of {max}"),
            BundleError::UnknownFormat => f.write_str("bundle is in an unknown format; refusing it (fail closed)"),
            BundleError::BadSignature => f.write_str("bundle signature does not verify with the controller's key"),
            BundleError::Malformed(what) => write!(f, "bundle is malformed: {what}"),
            BundleError::WrongMesh { bundle, ours } => write!(f, "bundle is for mesh `{bundle}`, this node is in mesh `{ours}`"),
            BundleError::WrongNode { bundle, ours } => write!(f, "bundle is for node `{bundle}`, not for this node `{ours}`"),
            BundleError::NotNewer { version, last } => {
                write!(f, "bundle version {version} is not greater than the last applied version {last}; refusing a rollback")
            }
            BundleError::EqualVersionOtherContent { version } => {
                write!(f, "bundle version {version} equals the last applied version but its content differs")
            }
            BundleError::FileDigest { path } => write!(f, "file {path} does not match its SHA-256 in the bundle"),
            BundleError::Delta(e) => write!(f, "{e}"),
            BundleError::UnsafePath { path } => {
                write!(
                    f,
                    "file path {path:?} is not one of the files trellis delivers ({}, {}/peers-00.conf .. peers-{:02}.conf, {}/names-00.zone .. names-{:02}.zone)",
                    crate::plan::DELIVERED.join(", "),
                    crate::plan::WIREGUARD_DIR,
                    crate::plan::WIREGUARD_PARTS - 1,
                    crate::plan::ZONE_DIR,
                    crate::plan::WIREGUARD_PARTS - 1
                )
            }
        }
    }
}

impl std::error::Error for BundleError {}

fn put_str(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
}

/// A file of a bundle about to be signed whose content is held as pieces shared with other
/// bundles (a compiled `Text`): signed and sent without being copied into one buffer.
#[derive(Clone, Debug)]
pub struct Piecewise {
    pub path: String,
    pub mode: u32,
    pub sha256: [u8; 32],
    pub pieces: Vec<Bytes>,
}

impl Piecewise {
    pub fn len(&self) -> usize {
        self.pieces.iter().map(Bytes::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<BundleFile> for Piecewise {
    fn from(f: BundleFile) -> Piecewise {
        Piecewise { path: f.path, mode: f.mode, sha256: f.sha256, pieces: vec![f.content] }
    }
}

/// What the manifest says of one file: path, mode, digest and length. A signer that holds the
/// contents elsewhere (shared between bundles, sent from where they were compiled) signs these.
pub type Entry<'a> = (&'a str, u32, &'a [u8; 32], usize);

/// The canonical manifest that is signed.
fn manifest_of<'a>(mesh: &str, node: &str, version: u64, issued_at: i64, files: &[Entry<'a>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(128 + files.iter().map(|f| f.0.len() + 48).sum::<usize>());
    out.extend_from_slice(FORMAT.as_bytes());
    put_str(&mut out, mesh.as_bytes());
    put_str(&mut out, node.as_bytes());
    out.extend_from_slice(&version.to_be_bytes());
    out.extend_from_slice(&issued_at.to_be_bytes());
    out.extend_from_slice(&(files.len() as u32).to_be_bytes());
    for (path, mode, sha256, len) in files {
        put_str(&mut out, path.as_bytes());
        out.extend_from_slice(&mode.to_be_bytes());
        out.extend_from_slice(*sha256);
        out.extend_from_slice(&(*len as u64).to_be_bytes());
    }
    out
}

/// The head of a signed bundle: magic, signature over the manifest, and the manifest. ed25519
/// signatures are deterministic: the same manifest signed by the same key gives the same bytes,
/// so replicas hand out identical bundles for one version.
fn signed_head(key: &SigningKey, manifest: &[u8]) -> Bytes {
    let mut msg = Vec::with_capacity(SIGNING_CONTEXT.len() + manifest.len());
    msg.extend_from_slice(SIGNING_CONTEXT);
    msg.extend_from_slice(manifest);
    let sig = key.sign(&msg);
    let mut head = Vec::with_capacity(4 + 64 + 4 + manifest.len());
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&sig.to_bytes());
    head.extend_from_slice(&(manifest.len() as u32).to_be_bytes());
    head.extend_from_slice(manifest);
    head.into()
}

/// Signs a bundle whose files are held in pieces (see `Bundle::sign`).
pub fn sign_pieces(key: &SigningKey, mesh: &str, node: &str, version: u64, issued_at: i64, files: &[Piecewise]) -> Signed {
    let entries: Vec<Entry> = files.iter().map(|f| (f.path.as_str(), f.mode, &f.sha256, f.len())).collect();
    let head = sign_entries(key, mesh, node, version, issued_at, &entries);
    Signed { head, contents: files.iter().flat_map(|f| f.pieces.iter().cloned()).collect() }
}

/// The head of a signed bundle (magic, signature, manifest) for files the signer holds
/// elsewhere: their contents, in the order of `files`, follow it on the wire.
pub fn sign_entries(key: &SigningKey, mesh: &str, node: &str, version: u64, issued_at: i64, files: &[Entry]) -> Bytes {
    signed_head(key, &manifest_of(mesh, node, version, issued_at, files))
}

impl Bundle {
    /// The canonical manifest that is signed.
    pub fn manifest(&self) -> Vec<u8> {
        let entries: Vec<Entry> = self.files.iter().map(|f| (f.path.as_str(), f.mode, &f.sha256, f.content.len())).collect();
        manifest_of(&self.mesh, &self.node, self.version, self.issued_at, &entries)
    }

    /// Signs the bundle. ed25519 signatures are deterministic: the same bundle signed by the same
    /// key gives the same bytes, so replicas hand out identical bundles for one version.
    pub fn sign(&self, key: &SigningKey) -> Signed {
        Signed { head: signed_head(key, &self.manifest()), contents: self.files.iter().map(|f| f.content.clone()).collect() }
    }

    /// SHA-256 over what the node will hold: every file's path, mode and content. Version and
    /// issue time are not part of it, so two versions with the same files have the same digest.
    pub fn content_digest(&self) -> [u8; 32] {
        content_digest(&self.files)
    }
}

pub fn content_digest(files: &[BundleFile]) -> [u8; 32] {
    digest_of(files.iter().map(|f| (f.path.as_str(), f.mode, &f.sha256)))
}

/// `content_digest` of files held in pieces.
pub fn piecewise_digest(files: &[Piecewise]) -> [u8; 32] {
    digest_of(files.iter().map(|f| (f.path.as_str(), f.mode, &f.sha256)))
}

/// `content_digest` of files listed by what the manifest says of them.
pub fn entries_digest(files: &[Entry]) -> [u8; 32] {
    digest_of(files.iter().map(|&(path, mode, sha256, _)| (path, mode, sha256)))
}

fn digest_of<'a>(files: impl Iterator<Item = (&'a str, u32, &'a [u8; 32])>) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"trellis bundle content v1\0");
    for (path, mode, sha256) in files {
        h.update((path.len() as u64).to_be_bytes());
        h.update(path.as_bytes());
        h.update(mode.to_be_bytes());
        h.update(sha256);
    }
    h.finalize().into()
}

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], BundleError> {
        if self.b.len() < n {
            return Err(BundleError::Malformed("it ends early"));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }

    fn u32(&mut self) -> Result<u32, BundleError> {
        Ok(u32::from_be_bytes(self.take(4)?.try_into().expect("4")))
    }

    fn u64(&mut self) -> Result<u64, BundleError> {
        Ok(u64::from_be_bytes(self.take(8)?.try_into().expect("8")))
    }

    fn bytes(&mut self) -> Result<&'a [u8], BundleError> {
        let n = self.u32()? as usize;
        self.take(n)
    }

    fn string(&mut self) -> Result<String, BundleError> {
        String::from_utf8(self.bytes()?.to_vec()).map_err(|_| BundleError::Malformed("a name is not UTF-8"))
    }
}

/// A path a bundle may carry: exactly one of the files the compiler and the controller produce,
/// all under `etc/trellis/`. Anything else (`etc/cron.d/x`, `root/.ssh/authorized_keys`, the
/// agent's own key) is refused even when the signature is good: a bundle describes the mesh, it
/// does not administer the host.
pub fn safe_path(p: &str) -> bool {
    crate::plan::delivered(p).is_some()
}

/// What the verifier knows of the last bundle applied on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Applied {
    pub version: u64,
    /// Its content digest, when known: with it, receiving the same version again is recognised
    /// as a re-delivery instead of refused.
    pub digest: Option<[u8; 32]>,
}

/// The outcome of a successful verification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verified {
    pub bundle: Bundle,
    /// True when this is the version already applied, with the same content.
    pub redelivery: bool,
    /// The bundle's signed head (magic, signature, manifest): with the files, its exact bytes.
    pub head: Bytes,
    /// The paths of the files a delta built (sent whole or as edits); `None` for a whole bundle,
    /// whose every file came.
    pub changed: Option<Vec<String>>,
    /// The files a delta built as edits of a held file, with where they differ from it: a
    /// reader that holds that file can look at the hunks only.
    pub edited: Vec<Edited>,
}

/// A file a delta built from a held file (ADR 0035): that file's SHA-256 and the hunks where the
/// new content differs from it. The content was checked against the signed manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Edited {
    pub path: String,
    pub base: [u8; 32],
    pub hunks: std::sync::Arc<[crate::delta::Hunk]>,
}

/// A verified head: what its signed manifest says, and how long it is.
struct Head {
    mesh: String,
    node: String,
    version: u64,
    issued_at: i64,
    files: Vec<(String, u32, [u8; 32], usize)>,
    len: usize,
}

/// Verifies the head at the start of `bytes`: format, signature (strict ed25519), structure,
/// mesh and node, every path and mode, and the version against the last applied (the content
/// digest needs only the manifest). What follows the head is not read.
fn verify_head(bytes: &[u8], key: &VerifyingKey, mesh: &str, node: &str, last: Option<Applied>) -> Result<(Head, bool), BundleError> {
    let start = 4 + 64 + 4;
    if bytes.len() < start + FORMAT.len() || &bytes[..4] != MAGIC || &bytes[start..start + FORMAT.len()] != FORMAT.as_bytes() {
        return Err(BundleError::UnknownFormat);
    }
    let sig = Signature::from_bytes(bytes[4..68].try_into().expect("64"));
    let manifest_len = u32::from_be_bytes(bytes[68..72].try_into().expect("4")) as usize;
    if manifest_len > bytes.len() - start {
        return Err(BundleError::Malformed("the manifest is longer than the bundle"));
    }
    if manifest_len < FORMAT.len() {
        return Err(BundleError::Malformed("the manifest is shorter than its format line"));
    }
    let manifest = &bytes[start..start + manifest_len];
    let mut msg = Vec::with_capacity(SIGNING_CONTEXT.len() + manifest.len());
    msg.extend_from_slice(SIGNING_CONTEXT);
    msg.extend_from_slice(manifest);
    key.verify_strict(&msg, &sig).map_err(|_| BundleError::BadSignature)?;

    let Manifest { mesh: bundle_mesh, node: bundle_node, version, issued_at, files } = read_manifest(&manifest[FORMAT.len()..])?;
    // Head and contents together, as a whole bundle is bounded: a delta builds nothing a whole
    // bundle could not be.
    let total = files.iter().fold(start + manifest_len, |t, f| t.saturating_add(f.3));
    if total > MAX_BUNDLE {
        return Err(BundleError::TooLarge { size: total, max: MAX_BUNDLE });
    }
    if bundle_mesh != mesh {
        return Err(BundleError::WrongMesh { bundle: bundle_mesh, ours: mesh.to_string() });
    }
    if bundle_node != node {
        return Err(BundleError::WrongNode { bundle: bundle_node, ours: node.to_string() });
    }
    let mut redelivery = false;
    if let Some(last) = last {
        if version < last.version {
            return Err(BundleError::NotNewer { version, last: last.version });
        }
        if version == last.version {
            let digest = digest_of(files.iter().map(|(path, mode, sha256, _)| (path.as_str(), *mode, sha256)));
            match last.digest {
                Some(d) if d == digest => redelivery = true,
                Some(_) => return Err(BundleError::EqualVersionOtherContent { version }),
                None => return Err(BundleError::NotNewer { version, last: last.version }),
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    for (path, mode, _, _) in &files {
        if !safe_path(path) {
            return Err(BundleError::UnsafePath { path: path.clone() });
        }
        if !seen.insert(path.as_str()) {
            return Err(BundleError::Malformed("a path appears twice"));
        }
        if mode & !0o777 != 0 {
            return Err(BundleError::Malformed("a file mode has bits beyond 0777"));
        }
    }
    let head = Head { mesh: bundle_mesh, node: bundle_node, version, issued_at, files, len: start + manifest_len };
    Ok((head, redelivery))
}

/// What a manifest says of one file: path, mode, SHA-256 and length.
pub type SignedFile = (String, u32, [u8; 32], usize);

/// A manifest as read (after its format line), not yet judged.
struct Manifest {
    mesh: String,
    node: String,
    version: u64,
    issued_at: i64,
    files: Vec<SignedFile>,
}

/// Reads a manifest after its format line: its structure only (at most [`MAX_FILES`] files, no
/// bytes after the last); what it says is judged by [`verify_head`].
fn read_manifest(b: &[u8]) -> Result<Manifest, BundleError> {
    let mut r = Reader { b };
    let mesh = r.string()?;
    let node = r.string()?;
    let version = r.u64()?;
    let issued_at = r.u64()? as i64;
    let n = r.u32()? as usize;
    if n > MAX_FILES {
        return Err(BundleError::Malformed("too many files"));
    }
    let mut files = Vec::with_capacity(n);
    for _ in 0..n {
        let path = r.string()?;
        let mode = r.u32()?;
        let sha256: [u8; 32] = r.take(32)?.try_into().expect("32");
        let len = usize::try_from(r.u64()?).unwrap_or(usize::MAX);
        files.push((path, mode, sha256, len));
    }
    if !r.b.is_empty() {
        return Err(BundleError::Malformed("bytes follow the last entry of the manifest"));
    }
    Ok(Manifest { mesh, node, version, issued_at, files })
}

/// The manifest of a head, read without checking its signature: for the signer's own heads,
/// and to read the files a verified head names.
fn head_manifest(head: &[u8]) -> Option<Manifest> {
    let start = 4 + 64 + 4;
    let len = u32::from_be_bytes(head.get(68..start)?.try_into().ok()?) as usize;
    read_manifest(head.get(start..start.checked_add(len)?)?.get(FORMAT.len()..)?).ok()
}

/// What the manifest of a head says of each file: path, mode, SHA-256 and length, in order. Not
/// a verification (the signature is not checked): for the signer's own heads, and to read the
/// files a verified head names.
pub fn signed_files(head: &[u8]) -> Vec<SignedFile> {
    head_manifest(head).map(|m| m.files).unwrap_or_default()
}

/// The mesh a bundle's manifest names, read without checking anything (a client that knows
/// no mesh yet, as the delivery bench's simulated agents).
pub fn signed_mesh(bundle: &[u8]) -> Option<String> {
    head_manifest(bundle).map(|m| m.mesh)
}

/// The bytes of a bundle a node holds as its signed head and the files it wrote (ADR 0033):
/// the head, then each file the manifest names, read by `read` (given its path under the node's
/// root, the mode and the length the manifest says; it refuses a file not so). Verify the
/// result as any bundle; a file changed on disk fails there.
pub fn held_bytes(head: Vec<u8>, mut read: impl FnMut(&str, u32, usize) -> Result<Vec<u8>, String>) -> Result<Vec<u8>, String> {
    let mut bytes = head;
    let mut total = bytes.len();
    for (path, mode, _, len) in signed_files(&bytes) {
        if !safe_path(&path) {
            return Err(format!("the bundle held names {path:?}, which is not a file trellis delivers"));
        }
        total = total.saturating_add(len);
        if total > MAX_BUNDLE {
            return Err(format!("the bundle held is over the bound of {MAX_BUNDLE} bytes"));
        }
        let content = read(&path, mode, len)?;
        bytes.extend_from_slice(&content);
    }
    Ok(bytes)
}

fn check_digest(path: &str, sha256: &[u8; 32], content: &[u8]) -> Result<(), BundleError> {
    match <[u8; 32]>::from(Sha256::digest(content)) == *sha256 {
        true => Ok(()),
        false => Err(BundleError::FileDigest { path: path.to_string() }),
    }
}

/// Verifies a bundle as received. Checks, in order: size, format, signature (strict ed25519),
/// structure, mesh and node, version against the last applied, every path and every file digest.
pub fn verify(bytes: &[u8], key: &VerifyingKey, mesh: &str, node: &str, last: Option<Applied>) -> Result<Verified, BundleError> {
    if bytes.len() > MAX_BUNDLE {
        return Err(BundleError::TooLarge { size: bytes.len(), max: MAX_BUNDLE });
    }
    let (head, redelivery) = verify_head(bytes, key, mesh, node, last)?;
    let mut rest = &bytes[head.len..];
    let mut files = Vec::with_capacity(head.files.len());
    for (path, mode, sha256, len) in head.files {
        if rest.len() < len {
            return Err(BundleError::Malformed("a file is shorter than the manifest says"));
        }
        let (content, tail) = rest.split_at(len);
        rest = tail;
        check_digest(&path, &sha256, content)?;
        files.push(BundleFile { path, mode, sha256, content: Bytes::copy_from_slice(content) });
    }
    if !rest.is_empty() {
        return Err(BundleError::Malformed("bytes follow the last file"));
    }
    let bundle = Bundle { mesh: head.mesh, node: head.node, version: head.version, issued_at: head.issued_at, files };
    Ok(Verified { bundle, redelivery, head: Bytes::copy_from_slice(&bytes[..head.len]), changed: None, edited: Vec::new() })
}

/// Verifies a delta (ADR 0033) against the bundle this node holds, verified when it came, and
/// returns the new bundle. The delta's head is verified exactly as a whole bundle's (signature,
/// mesh, node, version against `last`); its base must be `held`; a file it keeps must be held
/// (under any path) with the digest the signed manifest names (taken as held: not read, not hashed); a file it
/// sends whole or as edits must come out with that digest. Anything else refuses the delta
/// whole, before anything is written.
pub fn verify_delta(
    delta: &[u8],
    key: &VerifyingKey,
    mesh: &str,
    node: &str,
    last: Option<Applied>,
    held: &Bundle,
) -> Result<Verified, BundleError> {
    use crate::delta::{DeltaError, Read};
    let mut parsed = crate::delta::parse(delta).map_err(BundleError::Delta)?;
    let (head, redelivery) = verify_head(parsed.head, key, mesh, node, last)?;
    if head.len != parsed.head.len() {
        return Err(BundleError::Malformed("bytes follow the delta's manifest"));
    }
    if parsed.base != crate::delta::Base::of(held.version, &held.content_digest()) {
        return Err(BundleError::Delta(DeltaError::OtherBase { version: parsed.base.version }));
    }
    // By content: the held file with this digest has these bytes, whatever its path.
    let held_file = |path: &str, sha256: &[u8; 32]| {
        held.files.iter().find(|f| f.sha256 == *sha256).ok_or_else(|| BundleError::Delta(DeltaError::NotHeld { path: path.to_string() }))
    };
    let mut files = Vec::with_capacity(head.files.len());
    let mut changed = Vec::new();
    let mut edited = Vec::new();
    for (path, mode, sha256, len) in head.files {
        let content = match parsed.ops.next(len).map_err(BundleError::Delta)? {
            Read::Keep => {
                let f = held_file(&path, &sha256)?;
                if f.content.len() != len {
                    return Err(BundleError::Delta(DeltaError::Mismatch { path }));
                }
                files.push(BundleFile { path, mode, sha256, content: f.content.clone() });
                continue;
            }
            Read::Whole(content) => Bytes::copy_from_slice(content),
            Read::Edits { base, edits } => {
                let from = held_file(&path, &base)?;
                let (content, hunks) = crate::delta::rebuild_with_hunks(&from.content, edits, len, &path).map_err(BundleError::Delta)?;
                if let Some(hunks) = hunks {
                    edited.push(Edited { path: path.clone(), base, hunks: hunks.into() });
                }
                Bytes::from(content)
            }
        };
        check_digest(&path, &sha256, &content)?;
        changed.push(path.clone());
        files.push(BundleFile { path, mode, sha256, content });
    }
    if !parsed.ops.done() {
        return Err(BundleError::Malformed("bytes follow the delta's last file"));
    }
    let bundle = Bundle { mesh: head.mesh, node: head.node, version: head.version, issued_at: head.issued_at, files };
    Ok(Verified { bundle, redelivery, head: Bytes::copy_from_slice(parsed.head), changed: Some(changed), edited })
}

/// A signed freshness stamp: the controller's clock, signed, so an agent can tell how old the
/// controller's newest word is even when nothing changed (a frozen channel shows up as stale).
/// Wire form: `TRF1` | signature (64) | "trellis-freshness-v1\n" | str mesh | i64 at.
pub fn sign_stamp(key: &SigningKey, mesh: &str, at: i64) -> Vec<u8> {
    let mut body = b"trellis-freshness-v1\n".to_vec();
    put_str(&mut body, mesh.as_bytes());
    body.extend_from_slice(&at.to_be_bytes());
    let sig = key.sign(&body);
    let mut out = b"TRF1".to_vec();
    out.extend_from_slice(&sig.to_bytes());
    out.extend_from_slice(&body);
    out
}

/// Verifies a freshness stamp and returns the time it carries.
pub fn verify_stamp(bytes: &[u8], key: &VerifyingKey, mesh: &str) -> Result<i64, BundleError> {
    const HEAD: &[u8] = b"trellis-freshness-v1\n";
    if bytes.len() < 68 + HEAD.len() || &bytes[..4] != b"TRF1" || &bytes[68..68 + HEAD.len()] != HEAD {
        return Err(BundleError::UnknownFormat);
    }
    let sig = Signature::from_bytes(bytes[4..68].try_into().expect("64"));
    key.verify_strict(&bytes[68..], &sig).map_err(|_| BundleError::BadSignature)?;
    let mut r = Reader { b: &bytes[68 + HEAD.len()..] };
    let stamp_mesh = r.string()?;
    let at = r.u64()? as i64;
    if !r.b.is_empty() {
        return Err(BundleError::Malformed("bytes follow the freshness stamp's time"));
    }
    if stamp_mesh != mesh {
        return Err(BundleError::WrongMesh { bundle: stamp_mesh, ours: mesh.to_string() });
    }
    Ok(at)
}

/// A file of a bundle about to be signed: what its manifest says of it, and its content, held
/// as the compiled output holds it (shared with other bundles, never copied).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    /// One of the files trellis delivers (`plan::DELIVERED`).
    pub path: &'static str,
    pub mode: u32,
    pub sha256: [u8; 32],
    pub content: crate::Text,
}

/// The files every bundle of a publish run carries alike, beside the compiled ones: the CAs a
/// node trusts (`ca.pem`) and what it trusts beyond them (`trust.toml`: its controllers, the next
/// signing key, the next CA; ADR 0027, 0028, 0029), each hashed once a run.
#[derive(Clone, Debug)]
pub struct Shared {
    ca_pem: crate::Text,
    ca_sha256: [u8; 32],
    trust_toml: crate::Text,
    trust_sha256: [u8; 32],
}

impl Shared {
    pub fn new(ca_pem: &str, trust_toml: &str) -> Shared {
        let (ca_pem, trust_toml) = (crate::Text::from(ca_pem), crate::Text::from(trust_toml));
        Shared { ca_sha256: ca_pem.sha256(), ca_pem, trust_sha256: trust_toml.sha256(), trust_toml }
    }
}

/// One node's bundle, every file of it in the manifest's order (by path): the compiled files
/// (`digest` gives each content's SHA-256, so a caller that keeps them across runs hashes a
/// content once), `ca.pem`, `trust.toml` and, once it has one, the node's certificate. The zone
/// keeps the serial it was compiled with, so that the digest of these entries
/// (`entries_digest`) changes only with the content; [`number`] gives it the version's. `paths`
/// is the node's `paths.toml` (`paths::write`), when it has direct candidates.
pub fn assemble(
    compiled: &[crate::FileResource],
    digest: impl Fn(&crate::Text) -> [u8; 32],
    shared: &Shared,
    node_pem: Option<&str>,
    paths: Option<&str>,
) -> Vec<Listed> {
    use crate::plan::{delivered, CA_PEM, NODE_PEM, PATHS_TOML, TRUST_TOML};
    let listed = |f: &crate::FileResource| Listed {
        path: delivered(&f.path).expect("the compiler makes only files trellis delivers"),
        mode: f.mode,
        sha256: digest(&f.content),
        content: f.content.clone(),
    };
    let mut files: Vec<Listed> = compiled.iter().map(listed).collect();
    files.push(Listed { path: CA_PEM, mode: 0o644, sha256: shared.ca_sha256, content: shared.ca_pem.clone() });
    files.push(Listed { path: TRUST_TOML, mode: 0o644, sha256: shared.trust_sha256, content: shared.trust_toml.clone() });
    if let Some(pem) = node_pem {
        let content = crate::Text::from(pem);
        files.push(Listed { path: NODE_PEM, mode: 0o644, sha256: content.sha256(), content });
    }
    if let Some(text) = paths {
        let content = crate::Text::from(text);
        files.push(Listed { path: PATHS_TOML, mode: 0o644, sha256: content.sha256(), content });
    }
    files.sort_by(|a, b| a.path.cmp(b.path));
    files
}

/// Numbers an assembled bundle for its version: the zone's SOA serial is the version, so it rises
/// whenever the bundle's content does, and it is the same on every replica (the version is the
/// database's).
pub fn number(files: &mut [Listed], version: u64) {
    if let Some(zone) = files.iter_mut().find(|f| f.path == crate::plan::MESH_ZONE) {
        zone.content = crate::render::with_serial(&zone.content, zone_serial(version));
        zone.sha256 = zone.content.sha256();
    }
}

/// A bundle version as a zone's SOA serial: the serial arithmetic of RFC 1982 wraps at 2^32, so
/// a version beyond it still reads as higher than the one before.
pub fn zone_serial(version: u64) -> u32 {
    version as u32
}

/// What the manifest says of assembled files.
pub fn entries(files: &[Listed]) -> Vec<Entry<'_>> {
    files.iter().map(|f| (f.path, f.mode, &f.sha256, f.content.len())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bundle is the compiled files, `ca.pem`, `trust.toml` and the node's certificate once it
    /// has one, in path order; numbering sets the zone's serial to the version (wrapping at
    /// 2^32) and its digest with it, and leaves every other file as it was.
    #[test]
    fn a_bundle_is_assembled_in_path_order_and_numbered_in_its_zone() {
        use crate::plan::{CA_PEM, MESH_ZONE, NODE_PEM, NODE_TOML, TRUST_TOML, WIREGUARD_CONF};
        let zone = "@\tIN\tSOA\tns.mesh.example. hostmaster.mesh.example. 1 3600 600 86400 60\n";
        let compiled = vec![
            crate::FileResource { path: WIREGUARD_CONF.into(), mode: 0o600, content: crate::Text::from("[Interface]\n") },
            crate::FileResource { path: MESH_ZONE.into(), mode: 0o644, content: crate::Text::from(zone) },
            crate::FileResource { path: NODE_TOML.into(), mode: 0o644, content: crate::Text::from("node = 1\n") },
        ];
        let shared = Shared::new("CA\n", "trust\n");
        let without = assemble(&compiled, |t| t.sha256(), &shared, None, None);
        let paths: Vec<&str> = without.iter().map(|f| f.path).collect();
        assert_eq!(paths, [CA_PEM, MESH_ZONE, NODE_TOML, TRUST_TOML, WIREGUARD_CONF]);
        let mut files = assemble(&compiled, |t| t.sha256(), &shared, Some("CERT\n"), None);
        let paths: Vec<&str> = files.iter().map(|f| f.path).collect();
        assert_eq!(paths, [CA_PEM, MESH_ZONE, NODE_PEM, NODE_TOML, TRUST_TOML, WIREGUARD_CONF]);
        for f in &files {
            assert_eq!(f.sha256, f.content.sha256(), "{}", f.path);
        }
        let before = files.clone();
        number(&mut files, (1 << 32) + 7);
        let zone = files.iter().find(|f| f.path == MESH_ZONE).unwrap();
        assert!(zone.content.to_string().contains("hostmaster.mesh.example. 7 3600"), "{}", zone.content);
        assert_eq!(zone.sha256, zone.content.sha256());
        for (a, b) in before.iter().zip(&files).filter(|(a, _)| a.path != MESH_ZONE) {
            assert_eq!(a, b);
        }
    }

    fn key() -> SigningKey {
        SigningKey::from_bytes(&[7; 32])
    }

    fn sample(version: u64) -> Bundle {
        Bundle {
            mesh: "acme".into(),
            node: "db-1".into(),
            version,
            issued_at: 1_800_000_000,
            files: vec![
                BundleFile::new("etc/trellis/ca.pem", 0o644, b"-----BEGIN CERTIFICATE-----\n".to_vec()),
                BundleFile::new("etc/trellis/wireguard.conf", 0o600, b"[Interface]\n".to_vec()),
            ],
        }
    }

    fn check(bytes: &[u8], last: Option<Applied>) -> Result<Verified, BundleError> {
        verify(bytes, &key().verifying_key(), "acme", "db-1", last)
    }

    #[test]
    fn a_bundle_signed_from_pieces_is_the_same_bundle_byte_for_byte() {
        let b = sample(3);
        let pieces: Vec<Piecewise> = b
            .files
            .iter()
            .map(|f| {
                let (x, y) = f.content.split_at(5);
                Piecewise {
                    path: f.path.clone(),
                    mode: f.mode,
                    sha256: f.sha256,
                    pieces: vec![Bytes::copy_from_slice(x), Bytes::copy_from_slice(y)],
                }
            })
            .collect();
        let signed = sign_pieces(&key(), &b.mesh, &b.node, b.version, b.issued_at, &pieces);
        assert_eq!(signed.contents.len(), 4);
        assert_eq!(signed.to_vec(), b.sign(&key()).to_vec());
        assert_eq!(piecewise_digest(&pieces), b.content_digest());
        assert_eq!(check(&signed.to_vec(), None).unwrap().bundle, b);
    }

    #[test]
    fn a_head_signed_from_entries_followed_by_the_contents_is_the_same_bundle() {
        let b = sample(3);
        let entries: Vec<Entry> = b.files.iter().map(|f| (f.path.as_str(), f.mode, &f.sha256, f.content.len())).collect();
        let mut bytes = sign_entries(&key(), &b.mesh, &b.node, b.version, b.issued_at, &entries).to_vec();
        b.files.iter().for_each(|f| bytes.extend_from_slice(&f.content));
        assert_eq!(bytes, b.sign(&key()).to_vec());
        assert_eq!(entries_digest(&entries), b.content_digest());
    }

    #[test]
    fn a_signed_bundle_verifies_and_signing_is_deterministic() {
        let b = sample(3);
        let bytes = b.sign(&key()).to_vec();
        assert_eq!(bytes, b.sign(&key()).to_vec());
        let v = check(&bytes, Some(Applied { version: 2, digest: None })).unwrap();
        assert_eq!((v.bundle, v.redelivery), (b.clone(), false));
        let again = check(&bytes, Some(Applied { version: 3, digest: Some(b.content_digest()) })).unwrap();
        assert!(again.redelivery);
    }

    #[test]
    fn every_refusal_has_its_own_reason() {
        let signed = sample(3).sign(&key());
        let bytes = signed.to_vec();
        // One byte changed anywhere is refused: in the signature or manifest as a bad signature,
        // in a file as a digest mismatch.
        for i in 0..bytes.len() {
            let mut t = bytes.clone();
            t[i] ^= 0x20;
            let e = check(&t, None).unwrap_err();
            if i < 4 || (72..72 + FORMAT.len()).contains(&i) {
                assert_eq!(e, BundleError::UnknownFormat, "byte {i}");
            } else if (68..72).contains(&i) {
                assert!(matches!(e, BundleError::Malformed(_) | BundleError::BadSignature), "byte {i}: {e:?}");
            } else if i < signed.head.len() {
                assert_eq!(e, BundleError::BadSignature, "byte {i}");
            } else {
                assert!(matches!(e, BundleError::FileDigest { .. }), "byte {i}: {e:?}");
            }
        }
        assert_eq!(check(&bytes, Some(Applied { version: 5, digest: None })), Err(BundleError::NotNewer { version: 3, last: 5 }));
        assert_eq!(check(&bytes, Some(Applied { version: 3, digest: None })), Err(BundleError::NotNewer { version: 3, last: 3 }));
        assert_eq!(
            check(&bytes, Some(Applied { version: 3, digest: Some([0; 32]) })),
            Err(BundleError::EqualVersionOtherContent { version: 3 })
        );
        let mut other = sample(3);
        other.node = "db-2".into();
        assert_eq!(check(&other.sign(&key()).to_vec(), None), Err(BundleError::WrongNode { bundle: "db-2".into(), ours: "db-1".into() }));
        let mut lying = sample(3);
        lying.files[1].content = Bytes::from_static(b"changed");
        assert_eq!(check(&lying.sign(&key()).to_vec(), None), Err(BundleError::FileDigest { path: "etc/trellis/wireguard.conf".into() }));
        for bad in [
            "/etc/passwd",
            "etc/../../root",
            "",
            "etc//x",
            "etc/cron.d/x",
            "root/.ssh/authorized_keys",
            "etc/trellis/../../var/lib/trellis-agent/wireguard.key",
            "etc/trellis/wireguard.key",
            "etc/trellis/mesh.zone/../../x",
        ] {
            let mut b = sample(3);
            b.files[0] = BundleFile::new(bad, 0o644, Vec::new());
            assert_eq!(check(&b.sign(&key()).to_vec(), None), Err(BundleError::UnsafePath { path: bad.into() }), "{bad}");
        }
        let huge = vec![0u8; MAX_BUNDLE + 1];
        assert_eq!(check(&huge, None), Err(BundleError::TooLarge { size: MAX_BUNDLE + 1, max: MAX_BUNDLE }));
        let other_key = SigningKey::from_bytes(&[8; 32]);
        assert_eq!(check(&sample(3).sign(&other_key).to_vec(), None), Err(BundleError::BadSignature));
    }

    #[test]
    fn stamps_carry_the_time_and_refuse_tampering() {
        let s = sign_stamp(&key(), "acme", 1234);
        assert_eq!(verify_stamp(&s, &key().verifying_key(), "acme"), Ok(1234));
        let mut t = s.clone();
        let last = t.len() - 1;
        t[last] ^= 1;
        assert_eq!(verify_stamp(&t, &key().verifying_key(), "acme"), Err(BundleError::BadSignature));
    }

    /// Found by the `bundle` fuzz target: a manifest length shorter than the format line (which
    /// the envelope check reads past it) panicked when the manifest was read, once signed.
    #[test]
    fn a_manifest_shorter_than_its_format_line_is_refused() {
        let signed = sample(3).sign(&key()).to_vec();
        for len in [0, 4, FORMAT.len() - 1] {
            let manifest = &signed[72..72 + len];
            let mut msg = SIGNING_CONTEXT.to_vec();
            msg.extend_from_slice(manifest);
            let mut b = signed.clone();
            b[4..68].copy_from_slice(&key().sign(&msg).to_bytes());
            b[68..72].copy_from_slice(&(len as u32).to_be_bytes());
            assert_eq!(check(&b, None), Err(BundleError::Malformed("the manifest is shorter than its format line")), "length {len}");
        }
    }

    /// Found by the `bundle` fuzz target: a stamp signed with bytes after its time verified, so
    /// two different stamps read as the same time. Like a bundle, a stamp is read whole.
    #[test]
    fn a_stamp_with_bytes_after_its_time_is_refused() {
        let mut body = sign_stamp(&key(), "acme", 1234)[68..].to_vec();
        body.extend_from_slice(b"more");
        let mut s = b"TRF1".to_vec();
        s.extend_from_slice(&key().sign(&body).to_bytes());
        s.extend_from_slice(&body);
        assert_eq!(
            verify_stamp(&s, &key().verifying_key(), "acme"),
            Err(BundleError::Malformed("bytes follow the freshness stamp's time"))
        );
    }
}

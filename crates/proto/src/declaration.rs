//! `POST /v1/admin/apply`'s body in trellis's own form: the same `ApplyRequest`, its files as
//! they are (lengths before them), so that neither the command nor the controller makes a JSON
//! string of megabytes of TOML (at 100,000 nodes the declaration is 12.8 MiB; its JSON 14.8 MB,
//! 32 ms to write and 45 ms to read). The JSON body is still taken.
//!
//! `TRDECL1\n` | i64 expected revision, big-endian (`i64::MIN`: none) | u32 file count | each
//! file: u32 path length | path | u32 text length | text. Paths and texts are UTF-8; nothing
//! follows the last file.

use crate::{ApplyRequest, DeclFile};

/// The media type of the body.
pub const MEDIA_TYPE: &str = "application/vnd.trellis.declaration";
const MAGIC: &[u8] = b"TRDECL1\n";
/// No revision expected.
const NONE: i64 = i64::MIN;
/// The most files a body may list, and the longest path: far beyond a mesh.toml and a manifest
/// per module, so that a count read from the body allocates nothing unbounded.
const MAX_FILES: u32 = 65_536;
const MAX_PATH: u32 = 4096;

/// The body of `req`.
pub fn encode(req: &ApplyRequest) -> Vec<u8> {
    let size = MAGIC.len() + 12 + req.files.iter().map(|f| 8 + f.path.len() + f.text.len()).sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&req.expect_revision.unwrap_or(NONE).to_be_bytes());
    out.extend_from_slice(&(req.files.len() as u32).to_be_bytes());
    for f in &req.files {
        for part in [f.path.as_bytes(), f.text.as_bytes()] {
            out.extend_from_slice(&(part.len() as u32).to_be_bytes());
            out.extend_from_slice(part);
        }
    }
    out
}

/// The request a body holds; the error is one sentence naming what is wrong and where (the
/// byte, the file).
pub fn decode(body: &[u8]) -> Result<ApplyRequest, String> {
    let rest = body.strip_prefix(MAGIC).ok_or("the body does not start with TRDECL1 (a trellis declaration)")?;
    let mut r = Reader { body, at: MAGIC.len(), rest };
    let expect = i64::from_be_bytes(r.take(8, "the expected revision")?.try_into().expect("eight bytes"));
    let count = r.u32("the number of files")?;
    if count > MAX_FILES {
        return Err(format!("the body lists {count} files (at most {MAX_FILES})"));
    }
    let mut files = Vec::with_capacity(count as usize);
    for i in 0..count {
        let n = r.u32(&format!("file {}'s path length", i + 1))?;
        if n > MAX_PATH {
            return Err(format!("file {}'s path is {n} bytes long (at most {MAX_PATH})", i + 1));
        }
        let path = r.text(n, &format!("file {}'s path", i + 1))?;
        let n = r.u32(&format!("the length of {path}"))?;
        let text = r.text(n, &path)?;
        files.push(DeclFile { path, text });
    }
    if !r.rest.is_empty() {
        return Err(format!("{} bytes follow the last file, at byte {}", r.rest.len(), r.at));
    }
    Ok(ApplyRequest { files, expect_revision: (expect != NONE).then_some(expect) })
}

struct Reader<'b> {
    body: &'b [u8],
    at: usize,
    rest: &'b [u8],
}

impl<'b> Reader<'b> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'b [u8], String> {
        if self.rest.len() < n {
            return Err(format!("the body ends at byte {} within {what} ({n} bytes from byte {})", self.body.len(), self.at));
        }
        let (taken, rest) = self.rest.split_at(n);
        (self.rest, self.at) = (rest, self.at + n);
        Ok(taken)
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_be_bytes(self.take(4, what)?.try_into().expect("four bytes")))
    }

    fn text(&mut self, n: u32, what: &str) -> Result<String, String> {
        let at = self.at;
        let bytes = self.take(n as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| format!("{what} is not UTF-8 (byte {})", at + e.utf8_error().valid_up_to()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(expect: Option<i64>) -> ApplyRequest {
        ApplyRequest {
            files: vec![
                DeclFile { path: "mesh.toml".into(), text: "[mesh]\nname = \"m\" # é\n".into() },
                DeclFile { path: "modules/pg.toml".into(), text: String::new() },
            ],
            expect_revision: expect,
        }
    }

    #[test]
    fn a_request_reads_back_as_it_was_written() {
        for expect in [None, Some(0), Some(7), Some(i64::MAX)] {
            let back = decode(&encode(&req(expect))).unwrap();
            assert_eq!(back.expect_revision, expect);
            assert_eq!(
                back.files.iter().map(|f| (f.path.as_str(), f.text.as_str())).collect::<Vec<_>>(),
                [("mesh.toml", "[mesh]\nname = \"m\" # é\n"), ("modules/pg.toml", "")]
            );
        }
    }

    /// Every cut of a body, and bytes that are not what they say, are refused with a sentence
    /// that says where; nothing is allocated from a count or a length the body has not got.
    #[test]
    fn a_body_that_is_not_whole_or_not_text_is_refused_saying_where() {
        let body = encode(&req(Some(3)));
        for n in 0..body.len() {
            let e = decode(&body[..n]).unwrap_err();
            assert!(e.contains("byte") || e.contains("TRDECL1"), "{n}: {e}");
        }
        let mut extra = body.clone();
        extra.push(0);
        assert!(decode(&extra).unwrap_err().contains("1 bytes follow the last file"));
        let mut bad = body.clone();
        let at = bad.windows(2).position(|w| w == "é".as_bytes()).unwrap();
        bad[at] = 0xff;
        assert!(decode(&bad).unwrap_err().contains("mesh.toml is not UTF-8"), "{:?}", decode(&bad));
        let mut many = MAGIC.to_vec();
        many.extend_from_slice(&NONE.to_be_bytes());
        many.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode(&many).unwrap_err().contains("at most 65536"));
        let mut long = many[..MAGIC.len() + 8].to_vec();
        long.extend_from_slice(&1u32.to_be_bytes());
        long.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode(&long).unwrap_err().contains("path is 4294967295 bytes long"));
        assert!(decode(b"{\"files\": []}").unwrap_err().contains("TRDECL1"));
    }
}

//! File contents made of shared pieces. A file that names many nodes (the peer list of a node
//! that peers with everyone, the zone of a node that may reach everyone) holds each node's text
//! by reference, so the files of a mesh share what they have in common instead of copying it:
//! a compile's cost grows with the pieces it makes, not with the bytes of every file.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// A file's content: pieces in order, read as one text. Cheap to clone; equal when the bytes
/// are equal, however they are cut.
#[derive(Clone)]
pub struct Text(Arc<Inner>);

struct Inner {
    pieces: Vec<Arc<str>>,
    len: usize,
}

impl Text {
    pub fn len(&self) -> usize {
        self.0.len
    }

    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// A text of these pieces, in order.
    pub fn from_pieces(pieces: Vec<Arc<str>>) -> Text {
        let len = pieces.iter().map(|p| p.len()).sum();
        Text(Arc::new(Inner { pieces, len }))
    }

    /// The same bytes with every run of pieces shorter than `shared` gathered into one piece:
    /// what a holder of many small pieces keeps to send them from few buffers.
    pub fn gathered(&self, shared: usize) -> Text {
        let mut pieces = Vec::new();
        let mut small = String::new();
        for p in self.pieces() {
            if p.len() < shared {
                small.push_str(p);
                continue;
            }
            if !small.is_empty() {
                pieces.push(Arc::from(std::mem::take(&mut small)));
            }
            pieces.push(p.clone());
        }
        if !small.is_empty() {
            pieces.push(Arc::from(small));
        }
        Text(Arc::new(Inner { pieces, len: self.len() }))
    }

    /// The pieces, in order; their concatenation is the text.
    pub fn pieces(&self) -> &[Arc<str>] {
        &self.0.pieces
    }

    /// Whether both are the same value (not only the same bytes): a clone of a text is.
    fn same(a: &Text, b: &Text) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }

    /// A number naming this value while it is alive (for caches that hold the value).
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.0) as usize
    }

    /// SHA-256 of the bytes.
    pub fn sha256(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        for p in self.pieces() {
            h.update(p.as_bytes());
        }
        h.finalize().into()
    }

    /// The bytes in one buffer.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        for p in self.pieces() {
            out.extend_from_slice(p.as_bytes());
        }
        out
    }

    fn bytes(&self) -> impl Iterator<Item = &[u8]> {
        self.pieces().iter().map(|p| p.as_bytes())
    }
}

/// Whether two sequences of byte slices hold the same bytes, wherever they are cut.
fn same_bytes<'a>(mut a: impl Iterator<Item = &'a [u8]>, mut b: impl Iterator<Item = &'a [u8]>) -> bool {
    let (mut x, mut y): (&[u8], &[u8]) = (&[], &[]);
    loop {
        while x.is_empty() {
            match a.next() {
                Some(n) => x = n,
                None => break,
            }
        }
        while y.is_empty() {
            match b.next() {
                Some(n) => y = n,
                None => break,
            }
        }
        if x.is_empty() || y.is_empty() {
            return x.is_empty() && y.is_empty();
        }
        let k = x.len().min(y.len());
        if x[..k] != y[..k] {
            return false;
        }
        (x, y) = (&x[k..], &y[k..]);
    }
}

impl PartialEq for Text {
    fn eq(&self, other: &Text) -> bool {
        Text::same(self, other) || (self.len() == other.len() && same_bytes(self.bytes(), other.bytes()))
    }
}

impl Eq for Text {}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.pieces().iter().try_for_each(|p| f.write_str(p))
    }
}

impl fmt::Debug for Text {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.to_string(), f)
    }
}

impl From<String> for Text {
    fn from(s: String) -> Text {
        let mut b = TextBuilder::default();
        b.push_str(&s);
        b.finish()
    }
}

impl From<&str> for Text {
    fn from(s: &str) -> Text {
        Text::from(s.to_string())
    }
}

/// Builds a `Text`: owned text is gathered into pieces of its own, shared pieces are taken by
/// reference.
#[derive(Default)]
pub struct TextBuilder {
    pieces: Vec<Arc<str>>,
    len: usize,
    pending: String,
}

impl TextBuilder {
    /// A builder with room for `pieces` shared pieces and `bytes` of text of its own.
    pub fn with_capacity(pieces: usize, bytes: usize) -> TextBuilder {
        TextBuilder { pieces: Vec::with_capacity(pieces), len: 0, pending: String::with_capacity(bytes) }
    }

    /// Text of this file alone, copied.
    pub fn push_str(&mut self, s: &str) {
        self.pending.push_str(s);
    }

    /// A piece shared with other files, by reference.
    pub fn push_shared(&mut self, s: &Arc<str>) {
        if s.is_empty() {
            return;
        }
        self.flush();
        self.len += s.len();
        self.pieces.push(s.clone());
    }

    fn flush(&mut self) {
        if !self.pending.is_empty() {
            let s = std::mem::take(&mut self.pending);
            self.len += s.len();
            self.pieces.push(s.into());
        }
    }

    pub fn finish(mut self) -> Text {
        self.flush();
        Text(Arc::new(Inner { pieces: self.pieces, len: self.len }))
    }
}

impl fmt::Write for TextBuilder {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.push_str(s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(s: &str, at: &[usize]) -> Text {
        let mut b = TextBuilder::default();
        let mut from = 0;
        for &i in at.iter().chain(std::iter::once(&s.len())) {
            b.push_shared(&Arc::from(&s[from..i]));
            from = i;
        }
        b.finish()
    }

    #[test]
    fn texts_are_equal_by_their_bytes_wherever_they_are_cut() {
        let s = "alpha\nbeta\ngamma\n";
        let whole = Text::from(s);
        for at in [vec![], vec![1], vec![3, 9], vec![5, 6, 7, 16]] {
            let t = cut(s, &at);
            assert_eq!(t, whole, "cut at {at:?}");
            assert_eq!(t.to_string(), s);
            assert_eq!(t.len(), s.len());
            assert_eq!(t.sha256(), <[u8; 32]>::from(Sha256::digest(s.as_bytes())));
        }
        assert_ne!(cut("alpha\nbeta\ngammA\n", &[4, 9]), whole);
        assert_ne!(cut("alpha\nbeta\n", &[4]), whole);
        assert_eq!(cut("", &[]), Text::from(""));
    }

    #[test]
    fn a_gathered_text_is_the_same_text_in_fewer_pieces() {
        let big: Arc<str> = Arc::from("B".repeat(10).as_str());
        let t = Text::from_pieces(vec![Arc::from("a"), Arc::from("b"), big.clone(), Arc::from("c")]);
        let g = t.gathered(8);
        assert_eq!(g, t);
        assert_eq!(g.pieces().iter().map(|p| &**p).collect::<Vec<_>>(), ["ab", &*big, "c"]);
        assert!(Arc::ptr_eq(&g.pieces()[1], &big), "a large piece is kept, not copied");
        assert_eq!(g.len(), t.len());
    }

    #[test]
    fn owned_text_between_shared_pieces_keeps_its_place() {
        let shared: Arc<str> = Arc::from("[shared]");
        let mut b = TextBuilder::default();
        b.push_str("head ");
        b.push_str("more ");
        b.push_shared(&shared);
        b.push_str(" tail");
        let t = b.finish();
        assert_eq!(t.to_string(), "head more [shared] tail");
        assert_eq!(t.pieces().len(), 3);
        assert!(Arc::ptr_eq(&t.pieces()[1], &shared));
    }
}

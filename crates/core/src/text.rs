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
    chunks: Vec<Chunk>,
    len: usize,
}

/// A run of a text's pieces, held by reference: a text made again from mostly the same pieces
/// (a peer list with one peer more) takes the runs that did not change from the text before, so
/// that it costs what changed rather than one reference per piece.
#[derive(Clone)]
pub struct Chunk(Arc<ChunkInner>);

struct ChunkInner {
    pieces: Vec<Arc<str>>,
    len: usize,
}

impl Chunk {
    fn new(pieces: Vec<Arc<str>>) -> Chunk {
        let len = pieces.iter().map(|p| p.len()).sum();
        Chunk(Arc::new(ChunkInner { pieces, len }))
    }

    pub fn pieces(&self) -> &[Arc<str>] {
        &self.0.pieces
    }

    fn len(&self) -> usize {
        self.0.len
    }
}

/// The chunks of a text, in order, for `TextBuilder::push_run` to take runs from: a text made
/// again from mostly the same runs finds each at or just after where the last one was taken.
pub struct Runs<'t> {
    chunks: &'t [Chunk],
    next: usize,
}

/// A piece of a run as `TextBuilder::push_run` reads it: the shared text, and the address of its
/// bytes, by which runs are compared.
pub trait RunPiece {
    fn piece(&self) -> &Arc<str>;

    fn at(&self) -> *const u8 {
        Arc::as_ptr(self.piece()).cast()
    }
}

impl RunPiece for &Arc<str> {
    fn piece(&self) -> &Arc<str> {
        self
    }
}

/// A piece whose address was read once, where it is held (a node's records, in the node's text):
/// a run of them is compared with the runs before without going back to where each is held (a
/// zone of 100,000 names would read 100,000 texts far apart in memory once more).
#[derive(Clone, Copy)]
pub struct HeldPiece<'a> {
    piece: &'a Arc<str>,
    at: *const u8,
}

impl<'a> HeldPiece<'a> {
    pub fn of(piece: &'a Arc<str>) -> HeldPiece<'a> {
        HeldPiece { piece, at: Arc::as_ptr(piece).cast() }
    }
}

impl RunPiece for HeldPiece<'_> {
    fn piece(&self) -> &Arc<str> {
        self.piece
    }

    fn at(&self) -> *const u8 {
        self.at
    }
}

/// How far past the last run taken `Runs` looks for the next one.
const LOOK_AHEAD: usize = 8;

impl<'t> Runs<'t> {
    pub fn of(text: Option<&'t Text>) -> Runs<'t> {
        Runs { chunks: text.map_or(&[], |t| t.chunks()), next: 0 }
    }

    /// The chunk holding exactly these pieces (by address), if it is near where the last was.
    fn take<P: RunPiece>(&mut self, run: &[P]) -> Option<&'t Chunk> {
        let ahead = self.chunks.get(self.next..)?;
        let at = ahead.iter().take(LOOK_AHEAD).position(|c| {
            c.pieces().len() == run.len() && c.pieces().iter().zip(run).all(|(a, b)| std::ptr::eq(Arc::as_ptr(a).cast::<u8>(), b.at()))
        })?;
        self.next += at + 1;
        Some(&ahead[at])
    }

    /// The chunk near where the last was taken that begins with `first`, if it holds at most
    /// `most` pieces, and how far past the last it is.
    fn starting_with(&self, first: &Arc<str>, most: usize) -> Option<(usize, &'t Chunk)> {
        let ahead = self.chunks.get(self.next..)?;
        ahead
            .iter()
            .take(LOOK_AHEAD)
            .enumerate()
            .find(|(_, c)| c.pieces().first().is_some_and(|p| Arc::ptr_eq(p, first)))
            .filter(|(_, c)| c.pieces().len() <= most)
    }
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
        let chunk = Chunk::new(pieces);
        Text(Arc::new(Inner { len: chunk.len(), chunks: vec![chunk] }))
    }

    /// This text with its first piece for which `replace` gives a new text replaced by it: the
    /// other chunks are shared with this one, only the chunk that held the piece is made again.
    /// None when no piece is replaced.
    pub fn replace_first(&self, replace: impl Fn(&str) -> Option<String>) -> Option<Text> {
        let (at, i, new) = self
            .0
            .chunks
            .iter()
            .enumerate()
            .find_map(|(at, c)| c.pieces().iter().enumerate().find_map(|(i, p)| replace(p).map(|new| (at, i, new))))?;
        let mut chunks = self.0.chunks.clone();
        let mut pieces = chunks[at].pieces().to_vec();
        pieces[i] = new.into();
        chunks[at] = Chunk::new(pieces);
        let len = chunks.iter().map(Chunk::len).sum();
        Some(Text(Arc::new(Inner { chunks, len })))
    }

    /// The chunks, in order; their pieces, in order, are the text.
    pub fn chunks(&self) -> &[Chunk] {
        &self.0.chunks
    }

    /// The pieces, in order; their concatenation is the text.
    pub fn pieces(&self) -> impl Iterator<Item = &Arc<str>> {
        self.0.chunks.iter().flat_map(|c| c.pieces())
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
        self.pieces().map(|p| p.as_bytes())
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
        self.pieces().try_for_each(|p| f.write_str(p))
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
    chunks: Vec<Chunk>,
    /// The pieces of the chunk being made.
    pieces: Vec<Arc<str>>,
    len: usize,
    pending: String,
}

impl TextBuilder {
    /// A builder with room for `pieces` shared pieces and `bytes` of text of its own.
    pub fn with_capacity(pieces: usize, bytes: usize) -> TextBuilder {
        TextBuilder { chunks: Vec::new(), pieces: Vec::with_capacity(pieces), len: 0, pending: String::with_capacity(bytes) }
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

    /// A run of shared pieces (none empty) as a chunk of its own: the chunk of the text before
    /// that holds exactly these pieces, if there is one where `before` looks, else a new one.
    pub fn push_run<P: RunPiece>(&mut self, run: &[P], before: &mut Runs) {
        self.end_chunk();
        if run.is_empty() {
            return;
        }
        let chunk = match before.take(run) {
            Some(c) => c.clone(),
            None => Chunk::new(run.iter().map(|p| p.piece().clone()).collect()),
        };
        self.len += chunk.len();
        self.chunks.push(chunk);
    }

    /// Runs of `before` taken whole where the caller knows their pieces are the same as there
    /// but for those it names: the next `most` pieces are `piece(0)`, `piece(1)`, ..., and no
    /// piece among them is new or in another place, only some may have gone. A run of `before`
    /// of chunks that starts with `piece(0)`, holds at most `most` pieces and whose last piece is
    /// the one at its length is then made of exactly those pieces (had one gone from between its
    /// ends, the same ends would be fewer pieces apart now, and pieces are distinct). So whether
    /// the chunks up to one are the same is known from that chunk's last piece alone, and it
    /// stays unknown once a piece has gone: the longest such run is found by bisection, reading
    /// a count of each chunk and the ends of a few, not each piece (an operator's hub section of
    /// 100,000 relayed nodes is some 1,600 chunks). Gives how many pieces it took; none when
    /// `before` has no such run there.
    pub(crate) fn push_same_run<'a>(&mut self, before: &mut Runs, most: usize, piece: impl Fn(usize) -> &'a Arc<str>) -> Option<usize> {
        if most == 0 {
            return None;
        }
        let (at, _) = before.starting_with(piece(0), most)?;
        let from = before.next + at;
        let chunks = &before.chunks[from..];
        // The pieces up to the end of each chunk, as far as `most` allows (the first fits:
        // `starting_with` says so).
        let mut ends = Vec::new();
        let mut total = 0;
        for c in chunks {
            total += c.pieces().len();
            if total > most {
                break;
            }
            ends.push(total);
        }
        let same = |k: usize| Arc::ptr_eq(chunks[k].pieces().last().expect("a chunk is never empty"), piece(ends[k] - 1));
        if !same(0) {
            return None;
        }
        // `same(lo)` holds; the last chunk that is the same is below `hi`.
        let (mut lo, mut hi) = (0, ends.len());
        if same(hi - 1) {
            lo = hi - 1;
        }
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if same(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        before.next = from + lo + 1;
        self.end_chunk();
        for c in &chunks[..=lo] {
            self.len += c.len();
            self.chunks.push(c.clone());
        }
        Some(ends[lo])
    }

    fn flush(&mut self) {
        if !self.pending.is_empty() {
            let s = std::mem::take(&mut self.pending);
            self.len += s.len();
            self.pieces.push(s.into());
        }
    }

    fn end_chunk(&mut self) {
        self.flush();
        if !self.pieces.is_empty() {
            self.chunks.push(Chunk::new(std::mem::take(&mut self.pieces)));
        }
    }

    pub fn finish(mut self) -> Text {
        self.end_chunk();
        Text(Arc::new(Inner { chunks: self.chunks, len: self.len }))
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
    fn owned_text_between_shared_pieces_keeps_its_place() {
        let shared: Arc<str> = Arc::from("[shared]");
        let mut b = TextBuilder::default();
        b.push_str("head ");
        b.push_str("more ");
        b.push_shared(&shared);
        b.push_str(" tail");
        let t = b.finish();
        assert_eq!(t.to_string(), "head more [shared] tail");
        let pieces: Vec<&Arc<str>> = t.pieces().collect();
        assert_eq!(pieces.len(), 3);
        assert!(Arc::ptr_eq(pieces[1], &shared));
    }

    #[test]
    fn replacing_a_piece_makes_only_its_chunk_again() {
        let pieces: Vec<Arc<str>> = (0..4).map(|i| Arc::from(format!("[{i}]"))).collect();
        let mut before = Runs::of(None);
        let mut b = TextBuilder::default();
        b.push_run(&[&pieces[0], &pieces[1]], &mut before);
        b.push_run(&[&pieces[2], &pieces[3]], &mut before);
        let t = b.finish();
        let r = t.replace_first(|p| (p.starts_with('[') && p != "[0]" && p != "[1]").then(|| "<two>".to_string())).expect("replaced");
        assert_eq!(r.to_string(), "[0][1]<two>[3]");
        assert_eq!(r.len(), 14);
        assert!(Arc::ptr_eq(&r.chunks()[0].0, &t.chunks()[0].0), "the chunk without the piece is shared");
        assert_eq!(t.to_string(), "[0][1][2][3]", "the text replaced from is as it was");
        assert!(t.replace_first(|_| None).is_none());
    }

    #[test]
    fn a_run_known_the_same_is_taken_by_its_ends() {
        let pieces: Vec<Arc<str>> = (0..6).map(|i| Arc::from(format!("[{i}]"))).collect();
        let mut none = Runs::of(None);
        let mut b = TextBuilder::default();
        b.push_run(&[&pieces[0], &pieces[1], &pieces[2]], &mut none);
        b.push_run(&[&pieces[3], &pieces[4]], &mut none);
        let first = b.finish();
        // Taken: a run that starts with the first piece and ends with the piece at its length,
        // within what may be taken.
        let list = [&pieces[0], &pieces[1], &pieces[2], &pieces[3], &pieces[4]];
        let mut before = Runs::of(Some(&first));
        let mut b = TextBuilder::default();
        assert_eq!(b.push_same_run(&mut before, 4, |k| list[k]), Some(3));
        assert_eq!(b.push_same_run(&mut before, 2, |k| list[3 + k]), Some(2));
        let second = b.finish();
        // Both runs at once, when both may be taken.
        let mut again = Runs::of(Some(&first));
        let mut b = TextBuilder::default();
        assert_eq!(b.push_same_run(&mut again, 5, |k| list[k]), Some(5));
        let both = b.finish();
        assert_eq!(both.to_string(), "[0][1][2][3][4]");
        assert!(Arc::ptr_eq(&both.chunks()[1].0, &first.chunks()[1].0));
        assert_eq!(second.to_string(), "[0][1][2][3][4]");
        assert!(Arc::ptr_eq(&second.chunks()[0].0, &first.chunks()[0].0));
        // Not taken: a run longer than may be taken (a changed piece among its pieces), a run
        // that ends elsewhere now (piece 1 gone), and no run beginning there.
        let mut before = Runs::of(Some(&first));
        assert_eq!(TextBuilder::default().push_same_run(&mut before, 2, |k| list[k]), None);
        let gone = [&pieces[0], &pieces[2], &pieces[3]];
        assert_eq!(TextBuilder::default().push_same_run(&mut before, 3, |k| gone[k]), None);
        assert_eq!(TextBuilder::default().push_same_run(&mut before, 3, |_| &pieces[5]), None);
    }

    #[test]
    fn the_longest_run_known_the_same_ends_before_the_first_piece_gone() {
        // Chunks of 1 to 5 pieces; each piece in turn gone from the list the run is taken for.
        let pieces: Vec<Arc<str>> = (0..60).map(|i| Arc::from(format!("[{i}]"))).collect();
        let mut none = Runs::of(None);
        let mut b = TextBuilder::default();
        let mut starts = Vec::new();
        let mut at = 0;
        for len in (0..).map(|k| 1 + k * 7 % 5) {
            if at + len > pieces.len() {
                break;
            }
            starts.push(at);
            b.push_run(&pieces[at..at + len].iter().collect::<Vec<_>>(), &mut none);
            at += len;
        }
        let (first, whole) = (b.finish(), at);
        let all: Vec<&Arc<str>> = pieces[..whole].iter().collect();
        let mut b = TextBuilder::default();
        assert_eq!(b.push_same_run(&mut Runs::of(Some(&first)), whole, |k| all[k]), Some(whole), "nothing gone: every chunk");
        assert_eq!(b.finish().to_string(), first.to_string());
        for (gone, piece) in pieces.iter().enumerate().take(whole).skip(1) {
            let list: Vec<&Arc<str>> = all.iter().copied().filter(|p| !Arc::ptr_eq(p, piece)).collect();
            // The chunks before the one that held the piece gone.
            let kept = *starts.iter().rev().find(|&&s| s <= gone).expect("the first chunk starts at 0");
            let mut b = TextBuilder::default();
            let took = b.push_same_run(&mut Runs::of(Some(&first)), list.len(), |k| list[k]);
            assert_eq!(took, (kept > 0).then_some(kept), "piece {gone} gone");
            let expected: String = list[..kept].iter().map(|p| &***p).collect();
            assert_eq!(b.finish().to_string(), expected, "piece {gone} gone");
        }
    }

    #[test]
    fn a_run_the_same_as_before_is_taken_from_the_text_before() {
        let pieces: Vec<Arc<str>> = (0..6).map(|i| Arc::from(format!("[piece {i}]\n"))).collect();
        let build = |runs: &[&[usize]], before: Option<&Text>| {
            let mut before = Runs::of(before);
            let mut b = TextBuilder::default();
            b.push_str("head\n");
            for run in runs {
                b.push_run(&run.iter().map(|&i| &pieces[i]).collect::<Vec<_>>(), &mut before);
            }
            b.push_str("tail\n");
            b.finish()
        };
        let first = build(&[&[0, 1], &[2, 3], &[4]], None);
        assert_eq!(first.to_string(), "head\n[piece 0]\n[piece 1]\n[piece 2]\n[piece 3]\n[piece 4]\ntail\n");
        assert_eq!(first.chunks().len(), 5);
        // Piece 3 gone, 5 added: the first run is taken from before, the others are new.
        let second = build(&[&[0, 1], &[2], &[4, 5]], Some(&first));
        assert_eq!(second.to_string(), "head\n[piece 0]\n[piece 1]\n[piece 2]\n[piece 4]\n[piece 5]\ntail\n");
        assert_eq!(second.len(), second.to_string().len());
        assert!(Arc::ptr_eq(&second.chunks()[1].0, &first.chunks()[1].0), "the same run is the same chunk");
        assert!(!Arc::ptr_eq(&second.chunks()[2].0, &first.chunks()[2].0), "a run that lost a piece is made again");
        // The same pieces from another allocation are not the same run: taken by address.
        let copy: Arc<str> = Arc::from(&*pieces[0]);
        let mut before = Runs::of(Some(&first));
        let mut b = TextBuilder::default();
        b.push_run(&[&copy, &pieces[1]], &mut before);
        let third = b.finish();
        assert!(!Arc::ptr_eq(&third.chunks()[0].0, &first.chunks()[1].0));
        assert_eq!(third.to_string(), "[piece 0]\n[piece 1]\n");
    }
}

//! The fetch engine's per-file and per-handle part (the Faster AFS paper's chunk
//! fetching): pieces, shared in-flight fetches, the gate and epoch, sequential detection and
//! the per-handle hint. The workers, their queue and the prefetch across a directory's files
//! are `fetch_pool.rs`; `fs/fetch.rs` uses both for `CachingFs::read` and the whole-file
//! fetch on open, where the cache record and its crash rules live.
//!
//! - A missing chunk is fetched as one **flight**: a record in the file's in-flight table
//!   ([`FileFetch::flights`], keyed by chunk) split into pieces of [`PIECE`] bytes. Anyone who
//!   needs bytes of the chunk (a reader, a worker) claims the pieces not yet claimed and
//!   fetches them; pieces someone else claimed are waited for on the flight's condvar. So a
//!   read waits only for the pieces it asked for (early return), concurrent readers share
//!   one fetch, and the rest of the chunk is finished by a worker.
//! - Source reads and cache writes run without the file's state mutex. A cache write holds
//!   the file's **gate** for reading and checks the generation the flight was started with;
//!   whatever changes the cached bytes or the record's version (reset, write, truncate,
//!   drop) takes the gate for writing and bumps the generation, which aborts every flight of
//!   the old one: no byte of an older version is written after that, nor marked present.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::cache::record::DataIdentity;
use crate::cleaner::Usage;
use crate::sync::{Condvar, Mutex, RwLock};

#[cfg(test)]
mod model_check;
use crate::health::GuardedSource;

/// Unit of a source read and of early return: a read waits for the pieces it covers.
/// 128 KiB is the kernel's FUSE read size (and its readahead unit), so a sequential reader's
/// request maps onto one piece.
pub const PIECE: u64 = 128 << 10;

/// Generation value of a state that was unloaded: no flight of it may write any more.
const DEAD: u64 = u64::MAX;

/// A read-only descriptor of a source file kept for fetching; counted, so that the number
/// open at once stays under `fetch_fds` (the paper's "resource hog" warning about hints).
pub struct SourceFd {
    pub reader: crate::source::SourceReader,
    open: Arc<AtomicU64>,
    /// Closes the descriptor off the thread that drops it, often under the file's lock
    /// (`GuardedSource::close_later`: a close may wait for the source).
    closer: Option<Arc<GuardedSource>>,
}

impl SourceFd {
    /// `reader`, one of the descriptors counted in `open` (already counted; given back
    /// when this is dropped), closed through `closer` if given.
    pub fn counted(
        reader: crate::source::SourceReader,
        open: Arc<AtomicU64>,
        closer: Option<Arc<GuardedSource>>,
    ) -> SourceFd {
        SourceFd {
            reader,
            open,
            closer,
        }
    }
}

impl std::fmt::Debug for SourceFd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceFd")
            .field("reader", &self.reader)
            .finish()
    }
}

impl Drop for SourceFd {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Relaxed);
        use crate::source::SourceReader;
        if let Some(closer) = self.closer.take()
            && let SourceReader::File(_) = &self.reader
        {
            let gone = SourceReader::Object {
                rel: Default::default(),
                etag: None,
            };
            closer.close_later(std::mem::replace(&mut self.reader, gone));
        }
    }
}

/// How a flight ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    Running,
    /// Every piece written and the chunk marked present.
    Complete,
    /// A source or cache error (errno): waiters read the source directly.
    Failed(i32),
    /// The file's generation changed: waiters start over.
    Aborted,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Piece {
    Todo,
    Claimed,
    Done,
}

#[derive(Debug)]
struct FlightState {
    pieces: Vec<Piece>,
    done: usize,
    end: End,
}

/// One chunk being fetched.
#[derive(Debug)]
pub struct Flight {
    pub chunk: u64,
    /// The file's generation when the fetch started.
    pub epoch: u64,
    /// Byte range of the chunk in the file.
    pub off: u64,
    pub len: u64,
    /// Started by prefetch (or the whole-file fetch), not by a read that needed it.
    pub prefetch: bool,
    /// Copies only what the source holds in memory (`resident_only`).
    pub resident_only: bool,
    st: Mutex<FlightState>,
    cv: Condvar,
    /// The cache's usage estimate and the bytes reserved in it not yet written; what is
    /// left when the flight is dropped is given back.
    usage: Option<(Arc<Usage>, AtomicU64)>,
    /// Bytes per piece (`PIECE`, or a whole chunk: `with_piece`).
    piece: u64,
}

impl Drop for Flight {
    fn drop(&mut self) {
        if let Some((u, left)) = &self.usage {
            u.unreserve(left.load(Relaxed));
        }
    }
}

/// What to do next for a range of a flight.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Fetch piece `i` (now claimed by the caller).
    Fetch(usize),
    /// Every piece of the range is present in the cache file.
    Ready,
    /// The flight ended without the range (failed or aborted).
    Ended(End),
}

impl Flight {
    pub fn new(chunk: u64, epoch: u64, off: u64, len: u64, prefetch: bool) -> Flight {
        let n = len.div_ceil(PIECE).max(1) as usize;
        Flight {
            chunk,
            epoch,
            off,
            len,
            prefetch,
            resident_only: false,
            st: Mutex::new(FlightState {
                pieces: vec![Piece::Todo; n],
                done: 0,
                end: End::Running,
            }),
            cv: Condvar::new(),
            usage: None,
            piece: PIECE,
        }
    }

    /// A flight that reads only what is in the source's page cache and ends without the
    /// chunk where a page is not (the fill behind a source read: `fs/source_reads.rs`).
    pub fn resident_only(mut self) -> Flight {
        self.resident_only = true;
        self
    }

    /// Pieces of `piece` bytes instead of `PIECE`: an object store pays a request per
    /// piece, so there a piece is the whole chunk.
    pub fn with_piece(mut self, piece: u64) -> Flight {
        self.piece = piece.max(1);
        let n = self.len.div_ceil(self.piece).max(1) as usize;
        self.st.get_mut().unwrap().pieces = vec![Piece::Todo; n];
        self
    }

    /// Reserves the chunk's bytes in the cache's usage estimate (`Usage::reserve`).
    pub fn reserving(mut self, usage: &Arc<Usage>) -> Flight {
        usage.reserve(self.len);
        self.usage = Some((usage.clone(), AtomicU64::new(self.len)));
        self
    }

    /// `n` bytes of it were written to the cache file.
    pub fn committed(&self, n: u64) {
        if let Some((u, left)) = &self.usage {
            left.fetch_sub(n, Relaxed);
            u.commit(n);
        }
    }

    pub fn npieces(&self) -> usize {
        self.len.div_ceil(self.piece).max(1) as usize
    }

    /// Byte range (in the file) of piece `i`.
    pub fn piece(&self, i: usize) -> Range<u64> {
        let a = self.off + i as u64 * self.piece;
        a..(a + self.piece).min(self.off + self.len)
    }

    /// The pieces covering file bytes `a..b` (clipped to the chunk).
    pub fn pieces_of(&self, a: u64, b: u64) -> Range<usize> {
        let a = a.max(self.off) - self.off;
        let b = b.min(self.off + self.len).max(self.off + a) - self.off;
        if b <= a {
            return 0..0;
        }
        (a / self.piece) as usize..b.div_ceil(self.piece) as usize
    }

    /// Claims the first unclaimed piece of `range`, or, with `wait`, waits until the range
    /// is done or the flight ends. `waited` is set if the caller had to wait for someone
    /// else's piece.
    pub fn next(&self, range: Range<usize>, wait: bool, waited: &mut bool) -> Option<Step> {
        let mut st = self.st.lock().unwrap();
        loop {
            match st.end {
                End::Failed(_) | End::Aborted => return Some(Step::Ended(st.end)),
                End::Running | End::Complete => {}
            }
            if let Some(i) = range.clone().find(|&i| st.pieces[i] == Piece::Todo) {
                st.pieces[i] = Piece::Claimed;
                return Some(Step::Fetch(i));
            }
            if range.clone().all(|i| st.pieces[i] == Piece::Done) {
                return Some(Step::Ready);
            }
            if !wait {
                return None;
            }
            *waited = true;
            st = self.cv.wait(st).unwrap();
        }
    }

    /// Piece `i` was written to the cache. Returns true if it was the last one: the caller
    /// then marks the chunk present and calls [`Flight::complete`] (the piece stays "claimed"
    /// until then, so that no reader of it returns before the chunk is marked).
    pub fn piece_written(&self, i: usize) -> bool {
        let mut st = self.st.lock().unwrap();
        st.done += 1;
        if st.done == st.pieces.len() {
            return true;
        }
        st.pieces[i] = Piece::Done;
        drop(st);
        self.cv.notify_all();
        false
    }

    /// Ends the flight: `Complete` marks every piece done.
    pub fn finish(&self, end: End) {
        let mut st = self.st.lock().unwrap();
        if st.end == End::Running {
            st.end = end;
        }
        if end == End::Complete {
            st.pieces.iter_mut().for_each(|p| *p = Piece::Done);
        }
        drop(st);
        self.cv.notify_all();
    }

    /// Gives back a claimed piece that was not fetched (the claimer stops).
    pub fn unclaim(&self, i: usize) {
        let mut st = self.st.lock().unwrap();
        if st.pieces[i] == Piece::Claimed {
            st.pieces[i] = Piece::Todo;
        }
        drop(st);
        self.cv.notify_all();
    }

    pub fn end(&self) -> End {
        self.st.lock().unwrap().end
    }

    /// Whether every piece has arrived.
    pub fn is_done(&self) -> bool {
        let st = self.st.lock().unwrap();
        st.done == st.pieces.len()
    }
}

/// Fetch state of one loaded file, shared by its readers and the workers fetching for it.
#[derive(Debug)]
pub struct FileFetch {
    /// The generation of the file's cached content. Cache writes and cache reads outside
    /// the state mutex hold it for reading; a new generation takes it for writing.
    gate: RwLock<u64>,
    /// Chunks in flight. Lock order (the module header of `fs.rs`): `Inode::file`, the gate,
    /// then this, then a flight's own mutex.
    pub flights: Mutex<HashMap<u64, Arc<Flight>>>,
    /// Chunks prefetched and not read since (for `prefetch_hits`).
    prefetched: Mutex<HashSet<u64>>,
    /// The cache data file, for writes and reads outside the state mutex.
    pub data: Option<File>,
    /// The data file's identity (inode, ctime) as hoardfs itself last left it: after its
    /// own last write, or as its record last vouched for it. `None`: not known (nothing
    /// is checked against it). A record may only vouch for data hoardfs wrote, so a data
    /// file that moved on from this was changed by someone else (`CachingFs::checkpoint`).
    own: Mutex<Option<DataIdentity>>,
}

impl FileFetch {
    pub fn new(data: Option<File>) -> FileFetch {
        FileFetch {
            gate: RwLock::new(0),
            flights: Mutex::default(),
            prefetched: Mutex::default(),
            data,
            own: Mutex::new(None),
        }
    }

    /// Runs `f` writing the cache file if the generation is still `epoch` (as `with_data`),
    /// then notes the file's identity as hoardfs's own (`own`), still under the gate.
    pub fn write_data<T>(
        &self,
        epoch: u64,
        f: impl FnOnce(&File) -> io::Result<T>,
    ) -> Option<io::Result<T>> {
        let g = self.gate.read().unwrap();
        if *g != epoch || epoch == DEAD {
            return None;
        }
        let data = self.data.as_ref()?;
        let r = f(data);
        self.note_written(data);
        drop(g);
        Some(r)
    }

    /// hoardfs has just changed `data` (this file's cache data file): its identity now is
    /// hoardfs's own. The `fstat` is taken under the lock, so that of concurrent writers
    /// the last to note sees every write noted before it (ctimes are not compared: the
    /// kernel's fine- and coarse-grained ctimes need not be in order).
    pub fn note_written(&self, data: &File) {
        let mut own = self.own.lock().unwrap();
        *own = crate::source::fstat(std::os::fd::AsFd::as_fd(data))
            .ok()
            .map(|st| DataIdentity::of(&st));
    }

    /// See `own`.
    pub fn own(&self) -> Option<DataIdentity> {
        *self.own.lock().unwrap()
    }

    pub fn set_own(&self, id: Option<DataIdentity>) {
        *self.own.lock().unwrap() = id;
    }

    /// Runs `f` while no write of the cache file is under way (`write_data` holds the gate
    /// for reading across its write and its note), without changing the generation.
    pub fn quiet<T>(&self, f: impl FnOnce() -> T) -> T {
        let _g = self.gate.write().unwrap();
        f()
    }

    pub fn epoch(&self) -> u64 {
        *self.gate.read().unwrap()
    }

    /// Runs `f` with the cache file if the generation is still `epoch` (and keeps it from
    /// changing meanwhile).
    pub fn with_data<T>(&self, epoch: u64, f: impl FnOnce(&File) -> T) -> Option<T> {
        let g = self.gate.read().unwrap();
        if *g != epoch || epoch == DEAD {
            return None;
        }
        let data = self.data.as_ref()?;
        let r = f(data);
        drop(g);
        Some(r)
    }

    /// A new generation (the cached content changes): every flight of the old one is
    /// aborted and no write of it reaches the cache file after this returns.
    pub fn invalidate(&self) {
        self.bump(false);
    }

    /// The state is unloaded: nothing may write through this any more.
    pub fn kill(&self) {
        self.bump(true);
    }

    fn bump(&self, dead: bool) {
        {
            let mut g = self.gate.write().unwrap();
            *g = if dead { DEAD } else { g.wrapping_add(1) % DEAD };
        }
        let flights: Vec<Arc<Flight>> = self.flights.lock().unwrap().drain().map(|e| e.1).collect();
        for f in flights {
            f.finish(End::Aborted);
        }
        self.prefetched.lock().unwrap().clear();
    }

    /// Whether any chunk is in flight.
    pub fn busy(&self) -> bool {
        !self.flights.lock().unwrap().is_empty()
    }

    /// Removes `flight` from the table (if it is still the one there).
    pub fn remove(&self, flight: &Arc<Flight>) {
        let mut t = self.flights.lock().unwrap();
        if t.get(&flight.chunk).is_some_and(|f| Arc::ptr_eq(f, flight)) {
            t.remove(&flight.chunk);
        }
    }

    pub fn note_prefetched(&self, chunk: u64) {
        self.prefetched.lock().unwrap().insert(chunk);
    }

    /// Whether `chunk` was prefetched and not read since (and forgets it).
    pub fn take_prefetched(&self, chunk: u64) -> bool {
        let mut p = self.prefetched.lock().unwrap();
        !p.is_empty() && p.remove(&chunk)
    }
}

/// Per open handle: sequential detection and the short-path hint.
#[derive(Debug, Default)]
pub struct HandleFetch {
    st: Mutex<HandleState>,
}

#[derive(Debug, Default)]
struct HandleState {
    seq: Seq,
    hint: Option<Hint>,
}

/// The paper's hint: a chunk known present, valid while the file's generation is `epoch`.
#[derive(Debug)]
struct Hint {
    ff: Arc<FileFetch>,
    epoch: u64,
    range: Range<u64>,
    chunk_size: u64,
}

/// Sequential detection: the highest offset read so far, how many reads in a row stayed
/// within a chunk of it, the prefetch window and how far ahead prefetch was asked for.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Seq {
    hi: u64,
    run: u32,
    window: u64,
    /// Chunks before this one were asked for already.
    ahead: u64,
}

/// Reads in a row, each within a chunk of the previous ones, before prefetch starts: a
/// random reader landing near its last read once or twice must not look sequential.
const SEQ_RUN: u32 = 3;

impl Seq {
    /// Notes a read of `off..end` (chunk size `cs`, largest window `max`) and returns the
    /// chunks to prefetch now.
    pub fn observe(&mut self, off: u64, end: u64, cs: u64, max: u64) -> Range<u64> {
        let near = off <= self.hi.saturating_add(cs) && off.saturating_add(cs) >= self.hi;
        let cur = off / cs;
        if !near {
            *self = Seq {
                hi: end,
                run: 1,
                window: 0,
                ahead: 0,
            };
            return 0..0;
        }
        let entered = end.div_ceil(cs) > self.hi.div_ceil(cs);
        self.hi = self.hi.max(end);
        self.run = self.run.saturating_add(1);
        if self.run < SEQ_RUN || max == 0 {
            return 0..0;
        }
        // The window doubles each time the reader enters a new chunk (1, 2, 4, ... max).
        if self.window == 0 {
            self.window = 1;
        } else if entered {
            self.window = (self.window * 2).min(max);
        }
        self.window = self.window.min(max);
        let last = (end.max(1) - 1) / cs;
        let from = self.ahead.max(last + 1).max(cur + 1);
        let to = last + 1 + self.window;
        if from >= to {
            return 0..0;
        }
        self.ahead = to;
        from..to
    }
}

impl HandleFetch {
    pub fn observe(&self, off: u64, end: u64, cs: u64, max: u64) -> Range<u64> {
        self.st.lock().unwrap().seq.observe(off, end, cs, max)
    }

    /// Remembers that `range` (one chunk) is present at generation `epoch`.
    pub fn set_hint(&self, ff: &Arc<FileFetch>, epoch: u64, range: Range<u64>, chunk_size: u64) {
        self.st.lock().unwrap().hint = Some(Hint {
            ff: ff.clone(),
            epoch,
            range,
            chunk_size,
        });
    }

    /// The short path: reads `off..end` straight from the cache file if it lies within
    /// the hinted chunk and the file's generation has not changed. Also feeds sequential
    /// detection (a hinted read is still a read of the pattern).
    pub fn hint_read(&self, off: u64, end: u64) -> Option<io::Result<Vec<u8>>> {
        let mut st = self.st.lock().unwrap();
        let h = st.hint.as_ref()?;
        if off < h.range.start || end > h.range.end {
            return None;
        }
        let ff = h.ff.clone();
        let epoch = h.epoch;
        let cs = h.chunk_size;
        // Hinted reads do not prefetch (they stay inside one chunk); the next read outside
        // it takes the long path, which does.
        let _ = st.seq.observe(off, end, cs, 0);
        drop(st);
        ff.with_data(epoch, |data| {
            let mut buf = vec![0u8; (end - off) as usize];
            crate::source::read_full(data, &mut buf, off).map(|n| {
                buf.truncate(n);
                buf
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CS: u64 = 1 << 20;

    #[test]
    fn sequential_reads_grow_the_window() {
        let mut s = Seq::default();
        let mut asked = Vec::new();
        let mut off = 0;
        while off < 20 * CS {
            let r = s.observe(off, off + PIECE, CS, 8);
            asked.extend(r);
            off += PIECE;
        }
        // Every chunk ahead asked for once, in order; the window reached its maximum.
        let mut sorted = asked.clone();
        sorted.dedup();
        assert_eq!(asked, sorted);
        assert_eq!(asked[0], 1);
        assert_eq!(*asked.last().unwrap(), 20 + 8 - 1);
        assert_eq!(s.window, 8);
    }

    #[test]
    fn window_grows_one_two_four() {
        let mut s = Seq::default();
        let mut sizes = Vec::new();
        for c in 0..6 {
            for p in 0..(CS / PIECE) {
                let off = c * CS + p * PIECE;
                s.observe(off, off + PIECE, CS, 16);
            }
            sizes.push(s.window);
        }
        assert_eq!(sizes, vec![1, 2, 4, 8, 16, 16]);
    }

    #[test]
    fn random_reads_do_not_prefetch() {
        let mut s = Seq::default();
        let mut x: u64 = 12345;
        for _ in 0..1000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let off = (x >> 20) % (1 << 40);
            assert_eq!(s.observe(off, off + 4096, CS, 8), 0..0);
        }
    }

    #[test]
    fn a_break_resets_the_pattern() {
        let mut s = Seq::default();
        for i in 0..16 {
            s.observe(i * PIECE, (i + 1) * PIECE, CS, 8);
        }
        assert!(s.window > 0);
        assert_eq!(s.observe(500 * CS, 500 * CS + PIECE, CS, 8), 0..0);
        assert_eq!(s.window, 0);
    }

    #[test]
    fn pieces_claim_and_share() {
        let f = Flight::new(0, 0, 0, 3 * PIECE + 5, false);
        assert_eq!(f.npieces(), 4);
        assert_eq!(f.pieces_of(PIECE + 1, PIECE + 2), 1..2);
        assert_eq!(f.pieces_of(0, 10 * PIECE), 0..4);
        assert_eq!(f.piece(3), 3 * PIECE..3 * PIECE + 5);
        let mut w = false;
        assert_eq!(f.next(1..2, false, &mut w), Some(Step::Fetch(1)));
        // Claimed by someone else: no step without waiting.
        assert_eq!(f.next(1..2, false, &mut w), None);
        assert!(!f.piece_written(1));
        assert_eq!(f.next(1..2, true, &mut w), Some(Step::Ready));
        for i in [0, 2] {
            assert_eq!(f.next(0..4, false, &mut w), Some(Step::Fetch(i)));
            assert!(!f.piece_written(i));
        }
        assert_eq!(f.next(0..4, false, &mut w), Some(Step::Fetch(3)));
        assert!(f.piece_written(3), "the last piece");
        assert!(f.is_done());
        f.finish(End::Complete);
        assert_eq!(f.next(0..4, true, &mut w), Some(Step::Ready));
    }

    #[test]
    fn invalidate_aborts_flights_and_closes_the_gate() {
        let ff = FileFetch::new(None);
        let g = ff.epoch();
        let f = Arc::new(Flight::new(2, g, 0, PIECE, false));
        ff.flights.lock().unwrap().insert(2, f.clone());
        ff.invalidate();
        assert_ne!(ff.epoch(), g);
        assert!(!ff.busy());
        let mut w = false;
        assert_eq!(f.next(0..1, true, &mut w), Some(Step::Ended(End::Aborted)));
        ff.kill();
        assert_eq!(ff.epoch(), DEAD);
    }
}

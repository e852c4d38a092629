//! The fetch engine's shared part: the workers, their queue and budget, and the prefetch
//! across the files of a directory (per-file flights are `fetch.rs`).
//!
//! - **Workers** (`fetch_workers` threads) take jobs from one queue: the rest of a chunk a
//!   reader started, prefetched chunks, whole-file fetches. Queued and running jobs count
//!   against `fetch_inflight` bytes; a job that does not fit is not queued (prefetch is
//!   skipped; a reader finishes its chunk itself).
//! - **Across files** ([`DirPrefetch`]): opendir keeps the order of a directory's regular
//!   files (the order readers such as `grep -r`, `cp -r` and `tar` open them in). Opens of
//!   them in that order make a cursor; once it holds (two opens in order, or an open of the
//!   directory's first file) an open that misses the cache queues whole-file fetches of the
//!   next `fetch_dir_prefetch` files for the workers. A queued file is dropped when the
//!   reader gets there first or the order breaks; a worker fetches it through the file's
//!   own cache state (`fs/fetch.rs`), so a later open joins it or finds it cached, and
//!   validates it against the source like any other cached file. An open that hits the
//!   cache fetches nothing; it has the next files' cache entries read into memory instead
//!   (`cache/warm.rs`), so that their opens do not wait for the disk one by one.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::{OsStr, OsString};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};

use crate::cache::warm::ColdFindings;
use crate::fetch::{FileFetch, Flight, SourceFd};
use crate::health::GuardedSource;

/// What a worker does: finish a flight of a file; `N`: the file system's node.
pub struct Job<N> {
    pub inode: Arc<N>,
    pub ff: Arc<FileFetch>,
    pub flight: Arc<Flight>,
    pub src: Arc<SourceFd>,
}

/// A whole-file fetch of a file the directory prefetch expects to be opened soon.
#[derive(Debug)]
pub struct FileJob {
    /// Node id of the directory (the parent of the open that queued this).
    pub dir_id: u64,
    /// Path of the file, relative to the source root.
    pub path: PathBuf,
    /// Its place among the directory's regular files.
    pub pos: usize,
    /// The directory's cursor when this was queued.
    pub cursor: Arc<Cursor>,
    pub generation: u64,
    /// Bytes counted against `fetch_inflight` (a guess until the file is stat'ed).
    pub len: AtomicU64,
}

impl FileJob {
    /// Still wanted: the order has held since, and the reader has not got there yet.
    pub fn wanted(&self) -> bool {
        let at = self.cursor.at.load(Relaxed);
        self.cursor.generation.load(Relaxed) == self.generation
            && (at == NO_POS || at < self.pos as u64)
    }
}

/// The chunks a closed source read may have brought into the source's page cache, to be
/// copied from there in order, one at a time (`resident_only` flights).
pub struct BehindJob<N> {
    pub inode: Arc<N>,
    pub ff: Arc<FileFetch>,
    pub flights: Vec<Arc<Flight>>,
    pub src: Arc<SourceFd>,
}

/// What the workers take from the queue.
pub enum Task<N> {
    Chunk(Job<N>),
    File(FileJob),
    Behind(BehindJob<N>),
}

impl<N> Task<N> {
    /// Bytes it counts against `fetch_inflight`.
    pub fn bytes(&self) -> u64 {
        match self {
            Task::Chunk(j) => j.flight.len,
            Task::File(f) => f.len.load(Relaxed),
            // One chunk at a time.
            Task::Behind(b) => b.flights.first().map_or(0, |f| f.len),
        }
    }
}

/// Tunables of the engine (`hoardfs set`: fetch_window, fetch_inflight, fetch_fds).
#[derive(Debug)]
pub struct FetchTunables {
    /// Largest prefetch window, in chunks (0: no prefetch).
    pub window: AtomicU64,
    /// Bytes of chunks queued for or running on workers.
    pub inflight: AtomicU64,
    /// Source descriptors kept open for fetching.
    pub fds: AtomicU64,
    /// Files of a directory fetched ahead of a reader opening them in order (0: none).
    pub dir_prefetch: AtomicU64,
}

/// The engine's shared part: the job queue, its budget and the descriptor count.
pub struct Fetcher<N> {
    queue: Mutex<VecDeque<Task<N>>>,
    cv: Condvar,
    /// Set at shutdown: `pop` answers `None` from then on.
    closed: std::sync::atomic::AtomicBool,
    /// Workers started (0 in a `CachingFs` without them: readers then fetch everything).
    pub workers: AtomicUsize,
    /// Bytes of the jobs queued or running.
    queued_bytes: AtomicU64,
    pub tun: FetchTunables,
    fds_open: Arc<AtomicU64>,
    /// Where the fetch descriptors are closed (`SourceFd`); dropped in place without one.
    closer: Option<Arc<GuardedSource>>,
    /// The order of recently listed directories and the readers' cursors in them.
    pub dirs: DirPrefetch,
}

impl<N> std::fmt::Debug for Fetcher<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fetcher")
            .field("workers", &self.workers)
            .field("queued_bytes", &self.queued_bytes)
            .finish()
    }
}

impl<N> Fetcher<N> {
    pub fn new(window: u64, inflight: u64, fds: u64, dir_prefetch: u64) -> Fetcher<N> {
        Fetcher {
            queue: Mutex::default(),
            cv: Condvar::new(),
            closed: Default::default(),
            workers: AtomicUsize::new(0),
            queued_bytes: AtomicU64::new(0),
            tun: FetchTunables {
                window: AtomicU64::new(window),
                inflight: AtomicU64::new(inflight),
                fds: AtomicU64::new(fds),
                dir_prefetch: AtomicU64::new(dir_prefetch),
            },
            fds_open: Arc::new(AtomicU64::new(0)),
            closer: None,
            dirs: DirPrefetch::default(),
        }
    }

    /// Fetch descriptors are closed through `source` (`SourceFd`).
    pub fn closing_through(mut self, source: Arc<GuardedSource>) -> Fetcher<N> {
        self.closer = Some(source);
        self
    }

    /// Opens a fetch descriptor with `open` unless `fetch_fds` are open already.
    pub fn open_source(
        &self,
        open: impl FnOnce() -> io::Result<crate::source::SourceReader>,
    ) -> Option<Arc<SourceFd>> {
        let max = self.tun.fds.load(Relaxed);
        let prev = self
            .fds_open
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1))
            .ok()?;
        let _ = prev;
        match open() {
            Ok(reader) => Some(Arc::new(SourceFd::counted(
                reader,
                self.fds_open.clone(),
                self.closer.clone(),
            ))),
            Err(_) => {
                self.fds_open.fetch_sub(1, Relaxed);
                None
            }
        }
    }

    pub fn fds_open(&self) -> u64 {
        self.fds_open.load(Relaxed)
    }

    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes.load(Relaxed)
    }

    /// Queues `job` if a worker exists and it fits the in-flight budget; gives it back
    /// otherwise. `front`: ahead of prefetches (the rest of a chunk a reader is waiting in).
    pub fn try_queue(&self, job: Job<N>, front: bool) -> Result<(), Job<N>> {
        match self.try_queue_task(Task::Chunk(job), front) {
            Ok(()) => Ok(()),
            Err(Task::Chunk(j)) => Err(j),
            Err(Task::File(_) | Task::Behind(_)) => unreachable!(),
        }
    }

    /// Queues a file of the directory prefetch (behind everything queued); false if no
    /// worker exists or it does not fit the in-flight budget.
    pub fn try_queue_file(&self, job: FileJob) -> bool {
        self.try_queue_task(Task::File(job), false).is_ok()
    }

    /// Queues the fill behind a source read (behind everything queued); gives it back if no
    /// worker exists or its first chunk does not fit the in-flight budget.
    pub fn try_queue_behind(&self, job: BehindJob<N>) -> Result<(), BehindJob<N>> {
        match self.try_queue_task(Task::Behind(job), false) {
            Ok(()) => Ok(()),
            Err(Task::Behind(b)) => Err(b),
            Err(_) => unreachable!(),
        }
    }

    fn try_queue_task(&self, task: Task<N>, front: bool) -> Result<(), Task<N>> {
        if self.workers.load(Relaxed) == 0 {
            return Err(task);
        }
        if !self.reserve(task.bytes()) {
            return Err(task);
        }
        let mut q = self.queue.lock().unwrap();
        if front {
            q.push_front(task);
        } else {
            q.push_back(task);
        }
        drop(q);
        self.cv.notify_one();
        Ok(())
    }

    /// Counts `len` more bytes against `fetch_inflight` if they fit.
    fn reserve(&self, len: u64) -> bool {
        let max = self.tun.inflight.load(Relaxed);
        self.queued_bytes
            .fetch_update(Relaxed, Relaxed, |q| (q + len <= max).then_some(q + len))
            .is_ok()
    }

    /// A file job learned its real size: its share of the budget becomes `len` if that
    /// fits (false: it does not, and the job should not fetch).
    pub fn resize(&self, job: &FileJob, len: u64) -> bool {
        let old = job.len.load(Relaxed);
        if len > old && !self.reserve(len - old) {
            return false;
        }
        if len < old {
            self.job_done(old - len);
        }
        job.len.store(len, Relaxed);
        true
    }

    /// The next job (blocks); `None` once closed.
    pub fn pop(&self) -> Option<Task<N>> {
        let mut q = self.queue.lock().unwrap();
        loop {
            if self.closed.load(Relaxed) {
                return None;
            }
            if let Some(j) = q.pop_front() {
                return Some(j);
            }
            q = self.cv.wait(q).unwrap();
        }
    }

    /// Ends the workers' waits at shutdown: jobs still queued are never run (a fetch is
    /// an optimisation; what it would have filled stays absent).
    pub fn close(&self) {
        let _q = self.queue.lock().unwrap();
        self.closed.store(true, Relaxed);
        self.cv.notify_all();
    }

    /// A job taken by `pop` is over.
    pub fn job_done(&self, len: u64) {
        let _ = self
            .queued_bytes
            .fetch_update(Relaxed, Relaxed, |q| Some(q.saturating_sub(len)));
    }
}

/// A reader's position in a directory, shared with the file jobs queued for it.
#[derive(Debug)]
pub struct Cursor {
    /// Bumped when the order breaks: jobs queued before are dropped.
    generation: AtomicU64,
    /// Position of the last file opened (`NO_POS`: none yet).
    at: AtomicU64,
}

const NO_POS: u64 = u64::MAX;

/// Directories whose order is kept at most (the least recently used goes).
const DIRS_KEPT: usize = 32;
/// Directories with more regular files than this keep no order (memory).
const DIR_FILES_MAX: usize = 1 << 17;

/// One listed directory: its regular files in listing order and the reader's cursor.
#[derive(Debug)]
struct DirOrder {
    pos: HashMap<OsString, usize>,
    names: Vec<OsString>,
    cursor: Arc<Cursor>,
    /// Opens in order so far (the pattern holds from 2).
    run: u32,
    /// Files to keep fetched ahead: 2 when the pattern starts, doubling with each open
    /// in order up to `fetch_dir_prefetch` (a single open of a first file costs little).
    window: usize,
    /// Positions before this one were queued already.
    ahead: usize,
    /// Positions before this one were handed to the warmer already.
    warmed: usize,
    /// An open of this pass over the directory found its cached data out of memory: the
    /// next files' entries are read ahead (a pass over a directory in memory reads none).
    warming: bool,
    /// Positions whose fetch a worker started (for `dir_prefetch_hits`).
    started: HashSet<usize>,
    used: u64,
}

/// Prefetch across the files of a directory: the listing order taken at opendir, and
/// per directory a cursor following the opens (see the module documentation).
#[derive(Debug, Default)]
pub struct DirPrefetch {
    dirs: Mutex<(HashMap<PathBuf, DirOrder>, u64)>,
    /// What the opens of cached files found (`Found::Hit` or `Found::ColdHit`).
    opens: Mutex<ColdFindings>,
    /// When reading ahead last found an entry out of memory among many
    /// (`cold_found_at`).
    warmer_cold_at: Mutex<Option<std::time::Instant>>,
}

/// A directory listed within this long of such an open has its first files' cache entries
/// read ahead at once: a walk reading a cold cache goes on into the next directory, whose
/// first opens would otherwise wait for the disk one by one. Short, so that a walk that
/// only lists (a stat walk after a read) reads nothing ahead for long.
const COLD_SPELL: std::time::Duration = std::time::Duration::from_millis(50);
/// How many first files that is.
const WARM_FIRST: usize = 4;

/// What an open found in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// Not all of the file's data.
    Miss,
    /// All of it, on disk but not in memory (the kernel's caches were dropped).
    ColdHit,
    /// All of it, in memory as far as known.
    Hit,
}

/// What an open of a file in a listed directory asks for.
#[derive(Debug, Default)]
pub struct DirOpen {
    /// The file was fetched (or is being fetched) by the directory prefetch.
    pub hit: bool,
    /// Files to queue: (position, path), with the cursor and its generation.
    pub ahead: Vec<(usize, PathBuf)>,
    pub cursor: Option<(Arc<Cursor>, u64)>,
    /// Files cached before, whose cache entries to read ahead (`cache/warm.rs`): a warm
    /// cache's reader in order, whom nothing is fetched for.
    pub warm: Vec<PathBuf>,
}

impl DirPrefetch {
    /// Reading ahead found a cache entry out of memory at `at`: the pass that asked for it
    /// is reading a cold cache, and the next directory it lists has its first files read
    /// ahead (`listed`).
    pub fn cold_found_at(&self, at: std::time::Instant) {
        let mut last = self.warmer_cold_at.lock().unwrap();
        if last.is_none_or(|t| t < at) {
            *last = Some(at);
        }
    }

    /// Whether a reader is going through a cache on disk: within `COLD_SPELL` of a cold
    /// finding, by an open or by reading ahead, among enough others (`ColdFindings`). A
    /// pass over a cache in memory meets an entry out of memory now and then; one alone
    /// started a spell, and the next directories' reading ahead found another such, so
    /// that such a pass read nearly every entry ahead (9,297 of 9,576 files here).
    fn cold_spell(&self) -> bool {
        let recent = |t: Option<std::time::Instant>| t.is_some_and(|t| t.elapsed() < COLD_SPELL);
        recent(self.opens.lock().unwrap().cold_since())
            || recent(*self.warmer_cold_at.lock().unwrap())
    }

    /// opendir read `dir`: the order of its regular files, `names`. Returns the files
    /// whose cache entries to read ahead: the first few, during a cold spell.
    pub fn listed(&self, dir: &Path, names: impl Iterator<Item = OsString>) -> Vec<PathBuf> {
        let names: Vec<OsString> = names.take(DIR_FILES_MAX + 1).collect();
        let cold = self.cold_spell();
        let mut g = self.dirs.lock().unwrap();
        let (dirs, clock) = &mut *g;
        *clock += 1;
        if names.len() > DIR_FILES_MAX || names.is_empty() {
            dirs.remove(dir);
            return Vec::new();
        }
        // Listed again with the same files (a second reader, or a re-open): the cursor
        // stays.
        if let Some(d) = dirs.get_mut(dir)
            && d.names == names
        {
            d.used = *clock;
            return Vec::new();
        }
        let first = if cold { names.len().min(WARM_FIRST) } else { 0 };
        let warm = names[..first].iter().map(|n| dir.join(n)).collect();
        if dirs.len() >= DIRS_KEPT && !dirs.contains_key(dir) {
            let oldest = dirs
                .iter()
                .min_by_key(|(_, d)| d.used)
                .map(|(p, _)| p.clone());
            if let Some(p) = oldest {
                dirs.remove(&p);
            }
        }
        let pos = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i))
            .collect();
        dirs.insert(
            dir.to_path_buf(),
            DirOrder {
                pos,
                names,
                cursor: Arc::new(Cursor {
                    generation: AtomicU64::new(0),
                    at: AtomicU64::new(NO_POS),
                }),
                run: 0,
                window: 0,
                ahead: 0,
                warmed: first,
                warming: cold,
                started: HashSet::new(),
                used: *clock,
            },
        );
        warm
    }

    /// An open of `dir/name` for reading, which `found` the file so in the cache. Follows
    /// the cursor and returns the files to fetch ahead (at most `max` past this one), or
    /// after cold hits, those whose cache entries to read ahead.
    pub fn opened(&self, dir: &Path, name: &OsStr, found: Found, max: u64) -> DirOpen {
        let miss = found == Found::Miss;
        let mut out = DirOpen::default();
        let mut g = self.dirs.lock().unwrap();
        let (dirs, clock) = &mut *g;
        *clock += 1;
        let Some(d) = dirs.get_mut(dir) else {
            return out;
        };
        let Some(&pos) = d.pos.get(name) else {
            return out;
        };
        d.used = *clock;
        out.hit = d.started.remove(&pos);
        let last = d.cursor.at.load(Relaxed);
        let max = max.min(DIR_FILES_MAX as u64) as usize;
        if last != NO_POS && pos as u64 == last {
            // The same file again: neither follows nor breaks the order.
        } else if pos == 0 {
            // Reading the directory from its first file: a pattern of its own.
            d.run = 2;
            d.window = 0;
            d.ahead = 1;
            if last != NO_POS {
                // A new pass over the directory: whether it reads ahead is its own.
                d.warmed = 1;
                d.warming = false;
            }
        } else if last != NO_POS && (pos as u64) > last && pos as u64 <= last + 1 + max as u64 {
            // The next file, or one a little further (a reader skipping some).
            d.run = d.run.saturating_add(1);
        } else {
            // The order broke: nothing queued for the old one is wanted any more.
            d.run = 1;
            d.window = 0;
            d.ahead = pos + 1;
            d.warmed = pos + 1;
            d.warming = false;
            d.cursor.generation.fetch_add(1, Relaxed);
        }
        if d.run >= 2 && (last == NO_POS || pos as u64 != last) {
            d.window = if d.window == 0 { 2 } else { d.window * 2 };
        }
        d.window = d.window.min(max);
        d.warming |= found == Found::ColdHit;
        // Only files found out of memory keep the spell going (here, or by the warming
        // workers: `cold_found_at`): a pass over files in memory reads nothing ahead once
        // the spell it began in is over.
        if found != Found::Miss {
            self.opens.lock().unwrap().note(found == Found::ColdHit);
        }
        d.cursor.at.store(pos as u64, Relaxed);
        if d.run < 2 || max == 0 {
            return out;
        }
        // Misses move the window on, and so do files prefetched before (the reader is
        // consuming them); hits on files cached before do not (a warm cache fetches
        // nothing), but have the next entries read from the cache ahead of them.
        if !(miss || out.hit) {
            if !d.warming {
                return out;
            }
            let from = d.warmed.max(pos + 1);
            let to = (pos + 1 + d.window).min(d.names.len());
            if from < to {
                d.warmed = to;
                out.warm = (from..to).map(|i| dir.join(&d.names[i])).collect();
            }
            return out;
        }
        let from = d.ahead.max(pos + 1);
        let to = (pos + 1 + d.window).min(d.names.len());
        if from >= to {
            return out;
        }
        d.ahead = to;
        out.ahead = (from..to).map(|i| (i, dir.join(&d.names[i]))).collect();
        out.cursor = Some((d.cursor.clone(), d.cursor.generation.load(Relaxed)));
        out
    }

    /// A worker started fetching the file at `pos` of `dir` (a later open of it is a hit).
    pub fn started(&self, dir: &Path, cursor: &Arc<Cursor>, pos: usize) {
        let mut g = self.dirs.lock().unwrap();
        if let Some(d) = g.0.get_mut(dir)
            && Arc::ptr_eq(&d.cursor, cursor)
        {
            d.started.insert(pos);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;

    #[test]
    fn tunables_change_live_and_bound_the_queue() {
        let f = Fetcher::<()>::new(8, 1 << 20, 2, 16);
        // Two descriptors at most.
        let open = || File::open("/dev/null").map(crate::source::SourceReader::File);
        let a = f.open_source(open).unwrap();
        let _b = f.open_source(open).unwrap();
        assert!(f.open_source(open).is_none());
        drop(a);
        let c = f.open_source(open);
        assert!(c.is_some());
        assert_eq!(f.fds_open(), 2);
        drop(c);
        assert_eq!(f.fds_open(), 1);
    }

    fn names(n: usize) -> impl Iterator<Item = OsString> {
        (0..n).map(|i| OsString::from(format!("f{i}")))
    }

    fn asked(d: &DirPrefetch, i: usize, miss: bool) -> Vec<usize> {
        let found = if miss { Found::Miss } else { Found::Hit };
        let o = d.opened(Path::new("d"), OsStr::new(&format!("f{i}")), found, 16);
        o.ahead.into_iter().map(|(p, _)| p).collect()
    }

    #[test]
    fn a_directory_read_in_order_is_fetched_ahead_in_a_growing_window() {
        let d = DirPrefetch::default();
        d.listed(Path::new("d"), names(100));
        assert_eq!(asked(&d, 0, true), vec![1, 2]);
        assert_eq!(asked(&d, 1, true), (3..6).collect::<Vec<_>>());
        assert_eq!(asked(&d, 2, true), (6..11).collect::<Vec<_>>());
        assert_eq!(asked(&d, 3, true), (11..20).collect::<Vec<_>>());
        // At most 16 ahead; a hit on a file cached before asks for nothing.
        assert_eq!(asked(&d, 4, true), vec![20]);
        assert_eq!(asked(&d, 5, false), Vec::<usize>::new());
        assert_eq!(asked(&d, 6, true), vec![21, 22]);
        // A file the prefetch started counts as a hit and moves the window on.
        let c = d
            .opened(Path::new("d"), OsStr::new("f6"), Found::Hit, 16)
            .cursor;
        assert!(c.is_none(), "the same file again asks for nothing");
        let (cursor, _) = d
            .opened(Path::new("d"), OsStr::new("f7"), Found::Miss, 16)
            .cursor
            .unwrap();
        d.started(Path::new("d"), &cursor, 8);
        let o = d.opened(Path::new("d"), OsStr::new("f8"), Found::Hit, 16);
        assert!(o.hit);
        assert_eq!(o.ahead.first().map(|a| a.0), Some(24));
        assert_eq!(o.ahead.last().map(|a| a.0), Some(24));
    }

    fn warmed(d: &DirPrefetch, i: usize, found: Found) -> Vec<String> {
        let o = d.opened(Path::new("d"), OsStr::new(&format!("f{i}")), found, 16);
        assert!(o.ahead.is_empty(), "a hit fetches nothing");
        o.warm.iter().map(|p| p.display().to_string()).collect()
    }

    #[test]
    fn hits_out_of_memory_have_the_next_entries_read_ahead_and_hits_in_memory_do_not() {
        let d = DirPrefetch::default();
        d.listed(Path::new("d"), names(40));
        // A pass over a directory in memory reads nothing ahead.
        for i in 0..10 {
            assert!(warmed(&d, i, Found::Hit).is_empty(), "f{i}");
        }
        // A new pass whose first file was out of memory: the next ones, in a growing
        // window, each once; hits in memory after it go on with the pass.
        assert_eq!(warmed(&d, 0, Found::ColdHit), ["d/f1", "d/f2"]);
        assert_eq!(warmed(&d, 1, Found::Hit), ["d/f3", "d/f4", "d/f5"]);
        assert_eq!(warmed(&d, 2, Found::Hit).len(), 5);
        assert_eq!(
            warmed(&d, 2, Found::Hit),
            Vec::<String>::new(),
            "the same file again"
        );
        // A break in the order ends the pass; in-order hits in memory start none.
        assert!(warmed(&d, 30, Found::Hit).is_empty());
        assert!(warmed(&d, 31, Found::Hit).is_empty());
        assert_eq!(
            warmed(&d, 32, Found::ColdHit).first().map(|s| s.as_str()),
            Some("d/f33")
        );
    }

    /// During a cold spell (enough cold hits among the last opens, the last less than
    /// `COLD_SPELL` ago) a directory listed for the first time has its first files read
    /// ahead at once, and its pass goes on warming; outside one, a listing reads nothing
    /// ahead.
    #[test]
    fn a_directory_listed_in_a_cold_spell_has_its_first_entries_read_ahead() {
        let d = DirPrefetch::default();
        assert!(d.listed(Path::new("d"), names(40)).is_empty());
        assert!(warmed(&d, 0, Found::Hit).is_empty());
        assert_eq!(
            warmed(&d, 1, Found::ColdHit),
            ["d/f2", "d/f3", "d/f4", "d/f5"]
        );
        // One cold hit is no spell yet.
        assert!(d.listed(Path::new("x"), names(10)).is_empty());
        for i in 2..=ColdFindings::MIN_COLD as usize {
            warmed(&d, i, Found::ColdHit);
        }
        let first = d.listed(Path::new("e"), names(10));
        assert_eq!(first, ["e/f0", "e/f1", "e/f2", "e/f3"].map(PathBuf::from));
        // Listed again with the same files: nothing more.
        assert!(d.listed(Path::new("e"), names(10)).is_empty());
        // Its pass warms on past what the listing read, though its opens hit memory.
        let o = d.opened(Path::new("e"), OsStr::new("f0"), Found::Hit, 16);
        assert!(
            o.warm.is_empty(),
            "the window (2) is within what the listing read"
        );
        let o = d.opened(Path::new("e"), OsStr::new("f1"), Found::Hit, 16);
        assert_eq!(o.warm, ["e/f4", "e/f5"].map(PathBuf::from));
        // Hits in memory end the spell once the cold ones are too few among the last.
        for _ in 0..ColdFindings::LEN {
            d.opened(Path::new("e"), OsStr::new("f2"), Found::Hit, 16);
        }
        assert!(d.listed(Path::new("g"), names(10)).is_empty());
        // An entry that reading ahead found out of memory among many (`cold_found_at`)
        // makes one, for `COLD_SPELL`.
        d.cold_found_at(std::time::Instant::now());
        assert_eq!(d.listed(Path::new("i"), names(10)).len(), WARM_FIRST);
        let past = std::time::Instant::now() - COLD_SPELL - std::time::Duration::from_millis(1);
        *d.warmer_cold_at.lock().unwrap() = Some(past);
        assert!(d.listed(Path::new("j"), names(10)).is_empty());
        d.cold_found_at(past);
        assert_eq!(
            *d.warmer_cold_at.lock().unwrap(),
            Some(past),
            "never earlier"
        );
    }

    /// A pass over a cache in memory that meets an entry out of memory now and then (one
    /// in a hundred) starts no spell: its next directories read nothing ahead.
    #[test]
    fn a_rare_cold_hit_in_a_pass_over_memory_starts_no_spell() {
        let d = DirPrefetch::default();
        for n in 0..300 {
            let dir = format!("d{n}");
            d.listed(Path::new(&dir), names(5));
            for i in 0..5 {
                let found = if (n * 5 + i) % 100 == 7 {
                    Found::ColdHit
                } else {
                    Found::Hit
                };
                d.opened(Path::new(&dir), OsStr::new(&format!("f{i}")), found, 16);
            }
            assert!(
                d.listed(Path::new(&format!("next{n}")), names(5))
                    .is_empty(),
                "after directory {n}"
            );
        }
    }

    #[test]
    fn a_break_in_the_order_stops_the_directory_prefetch() {
        let d = DirPrefetch::default();
        d.listed(Path::new("d"), names(50));
        assert_eq!(asked(&d, 0, true), vec![1, 2]);
        let o = d.opened(Path::new("d"), OsStr::new("f1"), Found::Miss, 16);
        let (cursor, generation) = o.cursor.unwrap();
        let job = |pos| FileJob {
            dir_id: 1,
            path: PathBuf::from(format!("d/f{pos}")),
            pos,
            cursor: cursor.clone(),
            generation,
            len: AtomicU64::new(1),
        };
        assert!(job(4).wanted());
        // The reader passed it: not wanted.
        assert!(!job(1).wanted());
        // Backwards: the order broke; what was queued is not wanted any more.
        assert_eq!(asked(&d, 30, true), Vec::<usize>::new());
        assert!(!job(40).wanted());
        // Random opens never start it again.
        for i in [12, 7, 44, 3, 25, 9] {
            assert_eq!(asked(&d, i, true), Vec::<usize>::new(), "open of f{i}");
        }
        // Two in order do.
        assert_eq!(asked(&d, 10, true), vec![11, 12]);
        // Unknown directories and names ask for nothing.
        assert!(
            d.opened(Path::new("e"), OsStr::new("f1"), Found::Miss, 16)
                .ahead
                .is_empty()
        );
        assert!(
            d.opened(Path::new("d"), OsStr::new("x"), Found::Miss, 16)
                .ahead
                .is_empty()
        );
    }
}

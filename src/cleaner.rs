//! The cleaner: keeps the cache between a high and a low watermark (xCachefs' user-level
//! cleaner: LRU delete above ~90 % until below ~70 %), and never fills the cache's file
//! system for others (cachefilesd's bcull: a minimum of free space).
//!
//! Policy lives here; the mechanism of evicting one file safely (no open file loses its
//! data, no record ever claims evicted bytes) is `EvictTarget`, implemented by `CachingFs`.
//!
//! Usage is tracked as an estimate: a background scan of the record tree sets it exactly
//! (bytes and files), at least every `RESCAN_MIN`, and in between the fetch path adds what
//! it caches (`Usage::add`), writes and truncations count what they changed in the data
//! file's allocated blocks (`Usage::adjust`: an overwrite adds nothing), and removals and
//! new records keep the file count (`file_added`, `file_removed`). The fetch path also
//! asks `Usage::may_grow` before caching a chunk: above the high watermark it serves the
//! chunk from the source without caching it and kicks the cleaner, so the cache never
//! overshoots by more than one chunk per concurrent reader and nothing ever waits for it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::cache::CacheRecord;
use crate::cache::store::Trees;
use crate::source::BeneathRoot;
use crate::threads::Threads;

/// The pins file in the cache root.
const PINS: &str = "pins";

/// What `hoardfs stats` shows of the cleaner.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CleanerSnapshot {
    pub limit_bytes: u64,
    pub high_watermark_bytes: u64,
    pub low_watermark_bytes: u64,
    pub min_free_bytes: u64,
    pub used_bytes: u64,
    pub pinned_bytes: u64,
    pub cleans: u64,
    pub evicted_files: u64,
    pub evicted_chunks: u64,
    pub evicted_bytes: u64,
    pub chunks_not_cached_when_full: u64,
}

/// Limits of the cache, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// The cache's size limit (from `--cache-size`, or a share of its file system).
    pub max_bytes: u64,
    /// Clean when usage exceeds this share of `max_bytes` (percent).
    pub high_pct: u8,
    /// Clean down to this share of `max_bytes` (percent).
    pub low_pct: u8,
    /// Also clean when the cache's file system has less than this free.
    pub min_free_bytes: u64,
}

impl Limits {
    pub fn high(&self) -> u64 {
        self.max_bytes / 100 * self.high_pct as u64
    }

    pub fn low(&self) -> u64 {
        self.max_bytes / 100 * self.low_pct as u64
    }
}

/// A unit of eviction: a whole small file, or one chunk of a large one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedFile {
    pub rel: PathBuf,
    /// `Some(c)`: only chunk `c` of a file above the whole-file threshold.
    pub chunk: Option<u64>,
    /// Milliseconds since the epoch.
    pub last_used: u64,
    /// Bytes the unit occupies on disk.
    pub bytes: u64,
    pub pinned: bool,
}

/// What the cleaner needs from the file system.
pub trait EvictTarget: Send + Sync {
    /// Drops the cached data of `rel` (all of it, or only `chunks`) unless the file is open
    /// through the mount; returns the bytes freed (0 when skipped).
    fn evict(&self, rel: &Path, chunks: Option<&[u64]>) -> u64;
    /// Free bytes on the cache's file system.
    fn cache_fs_free(&self) -> u64;
    /// Called before a pass: finishes what keeps closed files from being evicted (their
    /// records waiting for a group commit).
    fn settle(&self) {}
}

/// The shared usage estimate and the cleaner's counters.
#[derive(Debug, Default)]
pub struct Usage {
    pub bytes: AtomicU64,
    pub evicted_files: AtomicU64,
    pub evicted_chunks: AtomicU64,
    pub evicted_bytes: AtomicU64,
    pub cleans: AtomicU64,
    pub pinned_bytes: AtomicU64,
    pub skipped_chunks: AtomicU64,
    /// Cached files (records): set by each scan, kept up between scans as records are
    /// made and files evicted.
    pub files: AtomicU64,
    /// Every byte ever added, so that a scan can account for fetches that ran during it.
    added_total: AtomicU64,
    /// Every byte ever subtracted (freed), so that a scan can tell that its figure may
    /// already be out of date.
    removed_total: AtomicU64,
    files_added_total: AtomicU64,
    files_removed_total: AtomicU64,
    /// A scan ran while the cache changed: the next one comes soon (`RESCAN_SOON`).
    rescan_soon: std::sync::atomic::AtomicBool,
    /// The last scan found the cache within reach of a limit (`RESCAN_FAR` otherwise).
    near_limit: std::sync::atomic::AtomicBool,
    /// Bytes of fetches under way (counted in `bytes` from their start, so that concurrent
    /// fetches see each other; a scan cannot see them yet).
    reserved: AtomicU64,
    /// Files above this size are evicted chunk by chunk (the whole-file threshold).
    pub chunked_above: AtomicU64,
    limits: Mutex<Option<Limits>>,
    kick: Mutex<Option<Sender<Option<u64>>>>,
    /// The cache root, for the free space of its file system (`min_free`).
    cache_fs: std::sync::OnceLock<std::os::fd::OwnedFd>,
    /// Last uses (milliseconds) of files whose records were not rewritten for them, being
    /// recent enough on disk (`store::LAST_USED_GRAIN_MS`): a scan takes the later of the
    /// two, so the order of files used within the grain holds.
    recent_uses: Mutex<HashMap<PathBuf, u64>>,
}

/// Recent uses kept at most; past it, those older than the grain go (the records on disk
/// are within the grain of them).
const RECENT_USES_MAX: usize = 1 << 16;

impl Usage {
    pub fn limits(&self) -> Option<Limits> {
        *self.limits.lock().unwrap()
    }

    pub fn set_limits(&self, l: Option<Limits>) {
        *self.limits.lock().unwrap() = l;
        self.kick(None);
    }

    pub fn add(&self, n: u64) {
        self.bytes.fetch_add(n, Relaxed);
        self.added_total.fetch_add(n, Relaxed);
    }

    /// `rel` was used at `ms` (milliseconds since the epoch), which its record on disk
    /// does not say (`recent_uses`).
    pub fn used(&self, rel: &Path, ms: u64) {
        let mut recent = self.recent_uses.lock().unwrap();
        if recent.len() >= RECENT_USES_MAX {
            let grain = crate::cache::store::LAST_USED_GRAIN_MS;
            recent.retain(|_, &mut t| t.saturating_add(grain) > ms);
            if recent.len() >= RECENT_USES_MAX {
                recent.clear();
            }
        }
        recent.insert(rel.to_path_buf(), ms);
    }

    /// A fetch of `n` bytes starts (after `may_grow`).
    pub fn reserve(&self, n: u64) {
        self.bytes.fetch_add(n, Relaxed);
        self.reserved.fetch_add(n, Relaxed);
    }

    /// `n` reserved bytes were written to the cache.
    pub fn commit(&self, n: u64) {
        self.reserved.fetch_sub(n, Relaxed);
        self.added_total.fetch_add(n, Relaxed);
    }

    /// `n` reserved bytes will not be written after all.
    pub fn unreserve(&self, n: u64) {
        self.reserved.fetch_sub(n, Relaxed);
        self.sub(n);
    }

    /// An operation changed a cache file's disk usage from `before` to `after` bytes (an
    /// overwrite changes nothing, a truncation frees).
    pub fn adjust(&self, before: u64, after: u64) {
        if after > before {
            self.add(after - before);
        } else {
            self.sub(before - after);
        }
    }

    /// A cache entry was made (a new record).
    pub fn file_added(&self) {
        self.files.fetch_add(1, Relaxed);
        self.files_added_total.fetch_add(1, Relaxed);
    }

    /// A cache entry was removed.
    pub fn file_removed(&self) {
        let _ = self
            .files
            .fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(1)));
        self.files_removed_total.fetch_add(1, Relaxed);
    }

    /// A cache entry was removed, holding what `removed` says.
    pub fn removed(&self, removed: crate::cache::store::Removed) {
        self.sub(removed.data_bytes);
        if removed.record {
            self.file_removed();
        }
    }

    /// Bytes added, bytes removed, files added, files removed, ever.
    fn totals(&self) -> (u64, u64, u64, u64) {
        (
            self.added_total.load(Relaxed),
            self.removed_total.load(Relaxed),
            self.files_added_total.load(Relaxed),
            self.files_removed_total.load(Relaxed),
        )
    }

    /// Where free space is measured for `min_free`: the cache root's file system.
    pub fn set_cache_fs(&self, fd: std::os::fd::OwnedFd) {
        let _ = self.cache_fs.set(fd);
    }

    /// Free bytes on the cache's file system, if known.
    pub fn fs_free(&self) -> Option<u64> {
        use std::os::fd::AsFd;
        crate::cache::store::fs_free(self.cache_fs.get()?.as_fd()).ok()
    }

    pub fn sub(&self, n: u64) {
        self.removed_total.fetch_add(n, Relaxed);
        let _ = self
            .bytes
            .fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(n)));
    }

    /// May the cache grow by `n` bytes now? If not, the cleaner is kicked and the caller
    /// serves from the source without caching. Both limits hold: the cache's own (its
    /// high watermark) and the free space its file system must keep (`min_free`), which
    /// is what stops the cache when `--cache-size` is larger than its file system.
    pub fn may_grow(&self, n: u64) -> bool {
        let Some(l) = self.limits() else { return true };
        // Up to the high watermark a fetch may add its chunk, so the cache overshoots by at
        // most one chunk per concurrent fetch before the cleaner runs.
        let under_limit = self.bytes.load(Relaxed) < l.high();
        // (`min_free` 0 turns the floor off: the file system may fill, and a write that
        // does not fit fails and is counted as a cache error.)
        let room = l.min_free_bytes == 0
            || self
                .fs_free()
                .is_none_or(|free| free >= l.min_free_bytes.saturating_add(n));
        if under_limit && room {
            return true;
        }
        self.skipped_chunks.fetch_add(1, Relaxed);
        self.kick(None);
        false
    }

    pub fn snapshot(&self) -> CleanerSnapshot {
        let l = self.limits();
        CleanerSnapshot {
            limit_bytes: l.map(|l| l.max_bytes).unwrap_or(0),
            high_watermark_bytes: l.map(|l| l.high()).unwrap_or(0),
            low_watermark_bytes: l.map(|l| l.low()).unwrap_or(0),
            min_free_bytes: l.map(|l| l.min_free_bytes).unwrap_or(0),
            used_bytes: self.bytes.load(Relaxed),
            pinned_bytes: self.pinned_bytes.load(Relaxed),
            cleans: self.cleans.load(Relaxed),
            evicted_files: self.evicted_files.load(Relaxed),
            evicted_chunks: self.evicted_chunks.load(Relaxed),
            evicted_bytes: self.evicted_bytes.load(Relaxed),
            chunks_not_cached_when_full: self.skipped_chunks.load(Relaxed),
        }
    }

    /// Asks the cleaner to run now (optionally down to `target` bytes).
    pub fn kick(&self, target: Option<u64>) {
        if let Some(tx) = self.kick.lock().unwrap().as_ref() {
            let _ = tx.send(target);
        }
    }
}

/// Paths the cleaner never evicts (Coda's hoard priorities, reduced to on/off), kept in
/// `CACHE_DIR/pins`, one source-relative path per line; a directory pins its subtree.
#[derive(Debug)]
pub struct Pins {
    /// The cache root, beneath which `pins` is read and replaced.
    root: Arc<BeneathRoot>,
    set: Mutex<BTreeSet<PathBuf>>,
}

impl Pins {
    pub fn load(root: Arc<BeneathRoot>) -> std::io::Result<Pins> {
        let set = match crate::cache::store::read_small_file(&root, Path::new(PINS)) {
            Ok(bytes) => Self::parse(&bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeSet::new(),
            Err(e) => return Err(e),
        };
        Ok(Pins {
            root,
            set: Mutex::new(set),
        })
    }

    /// The pins in the bytes of a pins file: one path per line, as raw bytes (names need
    /// not be UTF-8). Lines that are not a relative path of normal components (damaged or
    /// edited by hand) are dropped.
    pub fn parse(bytes: &[u8]) -> BTreeSet<PathBuf> {
        use std::os::unix::ffi::OsStrExt;
        bytes
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty() && !l.contains(&0))
            .map(|l| PathBuf::from(std::ffi::OsStr::from_bytes(l)))
            .filter(|p| crate::source::check_relative(p).is_ok())
            .collect()
    }

    /// The bytes of a pins file holding `set`.
    pub fn serialize<'a>(set: impl Iterator<Item = &'a PathBuf>) -> Vec<u8> {
        use std::os::unix::ffi::OsStrExt;
        let mut text = Vec::new();
        for p in set {
            text.extend_from_slice(p.as_os_str().as_bytes());
            text.push(b'\n');
        }
        text
    }

    pub fn is_pinned(&self, rel: &Path) -> bool {
        let set = self.set.lock().unwrap();
        rel.ancestors()
            .any(|a| !a.as_os_str().is_empty() && set.contains(a))
            || set.contains(Path::new(""))
    }

    pub fn list(&self) -> Vec<PathBuf> {
        self.set.lock().unwrap().iter().cloned().collect()
    }

    /// Adds or removes a pin and saves the list (write to a temporary file, then rename).
    pub fn set(&self, rel: &Path, pinned: bool) -> std::io::Result<()> {
        use std::os::unix::ffi::OsStrExt;
        if pinned && rel.as_os_str().as_bytes().contains(&b'\n') {
            // One path per line: such a name cannot be stored.
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "cannot pin a path with a newline in it",
            ));
        }
        let mut set = self.set.lock().unwrap();
        let changed = if pinned {
            set.insert(rel.to_path_buf())
        } else {
            set.remove(rel)
        };
        if changed {
            let text = Self::serialize(set.iter());
            crate::cache::store::replace_file(&self.root, Path::new(PINS), &text)?;
        }
        Ok(())
    }
}

/// What a scan found.
#[derive(Debug, Default)]
pub struct Scan {
    /// Every eviction unit.
    pub units: Vec<CachedFile>,
    /// Bytes all data files occupy: the cache's true usage (chunks of an open file are on
    /// disk before its record says so).
    pub on_disk: u64,
    /// Records (cached files).
    pub files: u64,
}

/// Walks the record tree: every cached file (or, for files larger than `chunked_above`,
/// every present chunk) with its last use and its disk usage. Everything is reached
/// beneath the trees' roots; symlinks in the cache are never followed.
pub fn scan(trees: &Trees, pins: &Pins, chunked_above: u64) -> Scan {
    use rustix::fs::{FileType, OFlags};
    use std::io::Read;
    use std::os::unix::ffi::OsStrExt;
    fn walk(trees: &Trees, rel: &Path, pins: &Pins, chunked_above: u64, out: &mut Scan) {
        let Ok(fd) = trees
            .meta
            .openat(rel, OFlags::RDONLY | OFlags::DIRECTORY, 0)
        else {
            return;
        };
        let Ok(dir) = rustix::fs::Dir::new(fd) else {
            return;
        };
        let mut entries = Vec::new();
        for e in dir.flatten() {
            let name = e.file_name().to_bytes();
            if name != b"." && name != b".." {
                let child = rel.join(std::ffi::OsStr::from_bytes(name));
                entries.push((child, e.file_type()));
            }
        }
        for (child, mut ft) in entries {
            if ft == FileType::Unknown {
                let Ok(st) = trees.meta.stat(&child) else {
                    continue;
                };
                ft = FileType::from_raw_mode(st.mode);
            }
            if ft == FileType::Directory {
                walk(trees, &child, pins, chunked_above, out);
                continue;
            }
            if ft != FileType::RegularFile {
                continue;
            }
            let rec = trees
                .meta
                .openat(&child, OFlags::RDONLY | OFlags::NONBLOCK, 0)
                .ok()
                .and_then(|fd| {
                    let mut b = Vec::new();
                    std::fs::File::from(fd).read_to_end(&mut b).ok()?;
                    CacheRecord::decode(&b).ok()
                });
            let bytes = trees
                .data
                .stat(&child)
                .map(|st| st.blocks * 512)
                .unwrap_or(0);
            let pinned = pins.is_pinned(&child);
            out.on_disk += bytes;
            out.files += 1;
            let out = &mut out.units;
            match rec {
                Some(r) if r.identity.size > chunked_above && r.nchunks() > 1 && !r.dirty => {
                    // A complete file is read through passthrough, where chunk reads are
                    // not seen: its chunks are as recent as the file's last open or close.
                    let complete = r.is_complete();
                    for c in (0..r.nchunks()).filter(|&c| r.is_present(c)) {
                        let minute = r.chunk_used[c as usize] as u64 * 60_000;
                        let len = r.chunk_size.min(r.identity.size - c * r.chunk_size);
                        out.push(CachedFile {
                            rel: child.clone(),
                            chunk: Some(c),
                            last_used: if complete || minute == 0 {
                                r.last_used
                            } else {
                                minute
                            },
                            bytes: len,
                            pinned,
                        });
                    }
                }
                r => out.push(CachedFile {
                    rel: child,
                    chunk: None,
                    last_used: r.map(|r| r.last_used).unwrap_or(0),
                    bytes,
                    pinned,
                }),
            }
        }
    }
    let mut out = Scan::default();
    walk(trees, Path::new(""), pins, chunked_above, &mut out);
    out
}

/// The files to evict, least recently used first, to bring `used` down to `target`.
pub fn choose(files: &[CachedFile], used: u64, target: u64) -> Vec<&CachedFile> {
    let mut candidates: Vec<&CachedFile> =
        files.iter().filter(|f| !f.pinned && f.bytes > 0).collect();
    candidates.sort_by_key(|f| (f.last_used, f.rel.clone(), f.chunk));
    let mut chosen = Vec::new();
    let mut left = used;
    for f in candidates {
        if left <= target {
            break;
        }
        left = left.saturating_sub(f.bytes);
        chosen.push(f);
    }
    chosen
}

/// One pass: rescan, then evict LRU files until under the low watermark (or `target`) and
/// above the free-space floor. Returns the bytes freed.
pub fn clean_once(
    trees: &Trees,
    pins: &Pins,
    usage: &Usage,
    target: Option<u64>,
    fs: &dyn EvictTarget,
) -> u64 {
    fs.settle();
    let before = usage.totals();
    let scan = scan(trees, pins, usage.chunked_above.load(Relaxed));
    let mut files = scan.units;
    {
        let recent = usage.recent_uses.lock().unwrap();
        for f in files.iter_mut().filter(|f| f.chunk.is_none()) {
            if let Some(&t) = recent.get(&f.rel) {
                f.last_used = f.last_used.max(t);
            }
        }
    }
    let after = usage.totals();
    // What changed while the walk ran may or may not have been seen by it: the true
    // figure lies between what the walk found less what was freed meanwhile, and plus
    // what was added meanwhile. The running figure (exact as far as the changes were
    // counted) is kept if it lies there, else brought to the nearest end; a scan that
    // nothing raced sets it exactly, and one comes soon.
    let clamp = |v: u64, found: u64, added: u64, removed: u64| {
        v.clamp(found.saturating_sub(removed), found + added)
    };
    let reserved = usage.reserved.load(Relaxed);
    let (added, removed) = (after.0 - before.0, after.1 - before.1);
    let (files_added, files_removed) = (after.2 - before.2, after.3 - before.3);
    let raced = added + removed + files_added + files_removed > 0;
    let mut used = 0;
    let _ = usage.bytes.fetch_update(Relaxed, Relaxed, |v| {
        used = clamp(v, scan.on_disk + reserved, added, removed);
        Some(used)
    });
    let _ = usage.files.fetch_update(Relaxed, Relaxed, |v| {
        Some(clamp(v, scan.files, files_added, files_removed))
    });
    usage.pinned_bytes.store(
        files.iter().filter(|f| f.pinned).map(|f| f.bytes).sum(),
        Relaxed,
    );
    let limits = usage.limits();
    let pinned = usage.pinned_bytes.load(Relaxed);
    if let Some(l) = limits.filter(|l| pinned > l.low()) {
        tracing::warn!(
            pinned,
            low_watermark = l.low(),
            "pinned data alone is above the low watermark: the cleaner cannot get under it"
        );
    }
    let mut goal = match (target, limits) {
        (Some(t), _) => t,
        (None, Some(l)) if used >= l.high() => l.low(),
        (None, _) => used,
    };
    // The free-space floor, whatever the cache's own limit says (it may be larger than
    // its file system): free enough that the file system keeps min_free available, and
    // a margin more (the gap between the watermarks, as a share of min_free), so that
    // the cleaner does not run again for every chunk fetched.
    let free = limits.map(|_| fs.cache_fs_free());
    // A figure that raced changes is made true soon only near a limit: far below them
    // the next periodic scan is soon enough, and a scan of a large cache during a burst
    // of writes or deletes costs the workload a share of a core (issue 22).
    let near_limit = limits
        .zip(free)
        .is_some_and(|(l, free)| used >= l.low() / 2 || free < l.min_free_bytes.saturating_mul(2));
    usage.rescan_soon.store(raced && near_limit, Relaxed);
    usage.near_limit.store(near_limit, Relaxed);
    if let (Some(l), Some(free)) = (limits, free)
        && free < l.min_free_bytes
    {
        let margin = l.min_free_bytes / 100 * (l.high_pct.saturating_sub(l.low_pct)) as u64;
        let short = l.min_free_bytes - free + margin;
        goal = goal.min(used.saturating_sub(short));
    }
    if goal >= used {
        return 0;
    }
    usage.cleans.fetch_add(1, Relaxed);
    let mut freed = 0;
    // Group the chosen chunks by file: one record update per file.
    let mut whole: Vec<&Path> = Vec::new();
    let mut chunks: BTreeMap<&Path, Vec<u64>> = BTreeMap::new();
    for f in choose(&files, used, goal) {
        match f.chunk {
            None => whole.push(&f.rel),
            Some(c) => chunks.entry(&f.rel).or_default().push(c),
        }
    }
    let evictions = whole
        .into_iter()
        .map(|rel| (rel, None))
        .chain(chunks.iter().map(|(rel, cs)| (*rel, Some(cs.as_slice()))));
    for (rel, cs) in evictions {
        let n = fs.evict(rel, cs);
        if n > 0 {
            freed += n;
            usage.sub(n);
            if cs.is_none() {
                usage.evicted_files.fetch_add(1, Relaxed);
                usage.file_removed();
            } else {
                usage
                    .evicted_chunks
                    .fetch_add(cs.map_or(0, |c| c.len() as u64), Relaxed);
            }
            usage.evicted_bytes.fetch_add(n, Relaxed);
        }
    }
    tracing::info!(used, goal, freed, "cache clean");
    freed
}

/// The shortest time between two scans that nothing asked for: they keep the usage
/// figure true (changes the fetch path does not count, such as files unlinked or
/// truncated through the mount) and catch the file system filling from outside.
const RESCAN_MIN: Duration = Duration::from_secs(5);

/// The same far below every limit: what the usage figure misses between scans cannot
/// matter there, and a burst that brings the cache near a limit kicks the cleaner
/// (`Usage::may_grow`). A scan reads every record, so a large cache scanned every few
/// seconds costs a write-heavy workload a share of a core.
const RESCAN_FAR: Duration = Duration::from_secs(60);

/// The next scan after one that ran while the cache changed.
const RESCAN_SOON: Duration = Duration::from_millis(200);

/// Runs the cleaner on its own thread: a first scan at start (off the mount's critical
/// path), then a pass whenever kicked, and a rescan every `RESCAN_MIN` near a limit
/// (`RESCAN_SOON` after a scan that raced changes there; `RESCAN_FAR` far below them) or twenty times as long as the last scan took (so
/// that a huge cache costs at most 5 % of one core), at most `period` apart. The thread
/// is the returned group's; stopping it ends the thread after the pass in progress.
pub fn spawn(
    trees: Trees,
    pins: Arc<Pins>,
    usage: Arc<Usage>,
    fs: Arc<dyn EvictTarget>,
    period: Duration,
) -> std::io::Result<Threads> {
    let (tx, rx): (Sender<Option<u64>>, Receiver<Option<u64>>) = std::sync::mpsc::channel();
    *usage.kick.lock().unwrap() = Some(tx);
    let threads = Threads::new("cleaner");
    // The kick channel's only sender goes: the thread's wait ends at once.
    let kick = usage.clone();
    threads.on_stop(move || drop(kick.kick.lock().unwrap().take()));
    threads.spawn("cleaner", move |stop| {
        let mut target = None;
        while !stop.is_set() {
            let started = std::time::Instant::now();
            clean_once(&trees, &pins, &usage, target.take(), fs.as_ref());
            let least = if usage.rescan_soon.swap(false, Relaxed) {
                RESCAN_SOON
            } else if usage.near_limit.load(Relaxed) {
                RESCAN_MIN
            } else {
                RESCAN_FAR
            };
            let wait = (started.elapsed() * 20).max(least).min(period);
            match rx.recv_timeout(wait) {
                Ok(t) => {
                    target = t;
                    // Coalesce a burst of kicks into one pass.
                    while let Ok(t2) = rx.try_recv() {
                        target = t2.or(target);
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    })?;
    Ok(threads)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(rel: &str, last_used: u64, bytes: u64, pinned: bool) -> CachedFile {
        CachedFile {
            rel: rel.into(),
            chunk: None,
            last_used,
            bytes,
            pinned,
        }
    }

    #[test]
    fn evicts_least_recently_used_first_and_skips_pins() {
        let files = [
            f("new", 30, 10, false),
            f("old", 10, 10, false),
            f("mid", 20, 10, false),
            f("pinned", 1, 10, true),
        ];
        let chosen: Vec<_> = choose(&files, 40, 25)
            .iter()
            .map(|f| f.rel.clone())
            .collect();
        assert_eq!(chosen, [PathBuf::from("old"), PathBuf::from("mid")]);
        let all: Vec<_> = choose(&files, 40, 0)
            .iter()
            .map(|f| f.rel.clone())
            .collect();
        assert_eq!(all.len(), 3, "pinned files are never chosen");
    }

    #[test]
    fn watermarks_and_growth_admission() {
        let u = Usage::default();
        assert!(u.may_grow(u64::MAX / 2), "no limits: always");
        u.set_limits(Some(Limits {
            max_bytes: 1000,
            high_pct: 90,
            low_pct: 70,
            min_free_bytes: 0,
        }));
        u.add(850);
        assert!(u.may_grow(500), "below high: one more chunk may go in");
        u.add(50);
        assert!(!u.may_grow(1));
        assert_eq!(u.skipped_chunks.load(Relaxed), 1);
    }

    #[test]
    fn pins_cover_subtrees_and_persist() {
        let d = tempfile::tempdir().unwrap();
        let root = || Arc::new(BeneathRoot::open(d.path()).unwrap());
        let p = Pins::load(root()).unwrap();
        p.set(Path::new("a/b"), true).unwrap();
        assert!(p.is_pinned(Path::new("a/b")));
        assert!(p.is_pinned(Path::new("a/b/c/d")));
        assert!(!p.is_pinned(Path::new("a/bc")));
        let again = Pins::load(root()).unwrap();
        assert!(again.is_pinned(Path::new("a/b/x")));
        again.set(Path::new("a/b"), false).unwrap();
        assert!(!Pins::load(root()).unwrap().is_pinned(Path::new("a/b/x")));
    }
}

//! Reads the cache entries of a directory's next files ahead of a reader going through
//! them in order (issue 23, "warm" runs: the cache full, the kernel's caches dropped).
//! There an open of a cached file waits for its record's inode and block and its data
//! file's inode, and the passthrough read after it for the data: three or four random
//! reads one after the other, where the native file system waits for two. The workers
//! here read the next files' entries meanwhile, several at once, so that their opens and
//! reads find them in memory.
//!
//! Only the cache's own files are read, beneath the trees' roots, and nothing is changed:
//! a guess that turns out wrong (the reader stops, a name is not cached, its removal is
//! queued) costs its reads and no more.

use std::collections::VecDeque;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use rustix::fs::{Advice, OFlags};

use crate::source::BeneathRoot;

/// Entries waiting at most; beyond, new ones are not warmed (the reader is there first).
const BACKLOG: usize = 256;
/// Workers, so reads in flight: each opening waits for its inodes one at a time.
const WORKERS: usize = 4;
/// Data read ahead per file at most (a small file whole; a large one's first chunks).
const DATA_MAX: u64 = 256 << 10;

#[derive(Default)]
struct Queue {
    paths: VecDeque<PathBuf>,
    stop: bool,
}

/// Of a stream of cache entries looked at, which were found out of memory: the last
/// `LEN` findings and when the last cold one was. One entry found out of memory says
/// little (a pass over a cache in memory meets a few whose first page went, about one
/// in a hundred here); a reader going through a cache on disk finds most of them so.
#[derive(Clone, Copy, Debug, Default)]
pub struct ColdFindings {
    /// Bit i: the finding i looks back was cold.
    history: u16,
    last_cold: Option<Instant>,
}

impl ColdFindings {
    /// Findings remembered.
    pub const LEN: u32 = u16::BITS;
    /// Cold ones among them that make a cold stream.
    pub const MIN_COLD: u32 = 4;

    /// One more finding: whether the entry was out of memory.
    pub fn note(&mut self, cold: bool) {
        self.history = self.history << 1 | u16::from(cold);
        if cold {
            self.last_cold = Some(Instant::now());
        }
    }

    /// When the last cold entry was found, if enough of the recent ones were cold.
    pub fn cold_since(&self) -> Option<Instant> {
        self.last_cold
            .filter(|_| self.history.count_ones() >= Self::MIN_COLD)
    }
}

struct Shared {
    queue: Mutex<Queue>,
    /// What the workers found: which entries had their data out of memory.
    findings: Mutex<ColdFindings>,
    wake: Condvar,
    data: Arc<BeneathRoot>,
    meta: Arc<BeneathRoot>,
}

/// The workers; dropping it stops them after the entry each is reading.
#[derive(Default)]
pub struct Warmer {
    shared: Option<Arc<Shared>>,
    threads: Vec<JoinHandle<()>>,
}

impl Warmer {
    /// A warmer that reads nothing: for a store opened before the daemon forks
    /// (`CacheStore::start_workers`), and for in-process cores.
    pub fn inline() -> Warmer {
        Warmer::default()
    }

    /// Starts the workers over the trees `data` and `meta`. Those that cannot start are
    /// done without (warming is a hint).
    pub fn start(data: Arc<BeneathRoot>, meta: Arc<BeneathRoot>) -> Warmer {
        let shared = Arc::new(Shared {
            queue: Mutex::default(),
            findings: Mutex::default(),
            wake: Condvar::new(),
            data,
            meta,
        });
        let threads: Vec<_> = (0..WORKERS)
            .filter_map(|_| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name("cache-warm".into())
                    .spawn(move || work(&shared))
                    .ok()
            })
            .collect();
        Warmer {
            shared: (!threads.is_empty()).then_some(shared),
            threads,
        }
    }

    /// Reads the entries of `paths` (relative to the trees) soon, in order.
    pub fn warm(&self, paths: impl IntoIterator<Item = PathBuf>) {
        let Some(shared) = &self.shared else {
            return;
        };
        let mut q = shared.queue.lock().unwrap();
        let before = q.paths.len();
        for p in paths {
            if q.paths.len() >= BACKLOG {
                break;
            }
            q.paths.push_back(p);
        }
        let added = q.paths.len() - before;
        drop(q);
        for _ in 0..added.min(WORKERS) {
            shared.wake.notify_one();
        }
    }
}

impl Warmer {
    /// When an entry was last found with its data out of memory (and read in), if
    /// enough of the last ones were (`ColdFindings`): while that is recent, the reader
    /// ahead is going through a cold cache.
    pub fn last_cold(&self) -> Option<Instant> {
        self.shared.as_ref()?.findings.lock().unwrap().cold_since()
    }
}

impl std::fmt::Debug for Warmer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Warmer")
            .field("workers", &self.threads.len())
            .finish()
    }
}

impl Drop for Warmer {
    fn drop(&mut self) {
        if let Some(shared) = &self.shared {
            shared.queue.lock().unwrap().stop = true;
            shared.wake.notify_all();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn work(shared: &Shared) {
    loop {
        let rel = {
            let mut q = shared.queue.lock().unwrap();
            loop {
                if q.stop {
                    return;
                }
                if let Some(p) = q.paths.pop_front() {
                    break p;
                }
                q = shared.wake.wait(q).unwrap();
            }
        };
        let cold = warm_one(&shared.data, &shared.meta, &rel);
        shared.findings.lock().unwrap().note(cold);
    }
}

/// Brings `rel`'s record and the start of its data file into memory: the opens read the
/// directories' blocks and the inodes; the advice starts the reads of the contents. An
/// entry whose data file's first page is in memory already is left as it is (a pass over
/// a cache in memory). Whether its data was out of memory.
fn warm_one(data: &BeneathRoot, meta: &BeneathRoot, rel: &Path) -> bool {
    let flags = OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOATIME;
    // O_NOATIME is refused for files the caller does not own: then without it.
    let open = |tree: &BeneathRoot| {
        tree.openat(rel, flags, 0)
            .or_else(|_| tree.openat(rel, flags - OFlags::NOATIME, 0))
            .ok()
    };
    let read_ahead = |fd: &std::os::fd::OwnedFd, max: u64| {
        let len = rustix::fs::fstat(fd)
            .ok()
            .filter(|st| st.st_mode & libc::S_IFMT == libc::S_IFREG)
            .and_then(|st| NonZeroU64::new((st.st_size as u64).min(max)));
        if let Some(len) = len {
            let _ = rustix::fs::fadvise(fd, 0, Some(len), Advice::WillNeed);
        }
    };
    let Some(data_fd) = open(data) else {
        return false;
    };
    if super::files::first_page_resident(&data_fd) {
        return false;
    }
    if let Some(fd) = open(meta) {
        read_ahead(&fd, u64::MAX);
    }
    read_ahead(&data_fd, DATA_MAX);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cold_stream_takes_enough_cold_findings_among_the_last() {
        let mut f = ColdFindings::default();
        assert!(f.cold_since().is_none());
        for _ in 1..ColdFindings::MIN_COLD {
            f.note(true);
        }
        assert!(f.cold_since().is_none(), "one short of the least");
        f.note(true);
        assert!(f.cold_since().is_some());
        // Findings in memory push the cold ones out of the window.
        for _ in 0..ColdFindings::LEN - ColdFindings::MIN_COLD {
            f.note(false);
        }
        assert!(f.cold_since().is_some(), "still within the last LEN");
        f.note(false);
        assert!(f.cold_since().is_none());
    }

    /// Warming reads and changes nothing: the files' bytes and times are as before, names
    /// that are not there or are not regular files are passed over, and a stopped warmer
    /// drops what is left.
    #[test]
    fn warming_changes_nothing_and_passes_over_what_is_not_there() {
        let dir = tempfile::tempdir().unwrap();
        for t in ["data", "meta"] {
            std::fs::create_dir_all(dir.path().join(t).join("d/sub")).unwrap();
            std::fs::write(dir.path().join(t).join("d/f"), b"bytes").unwrap();
        }
        let before: Vec<_> = ["data/d/f", "meta/d/f"]
            .iter()
            .map(|p| std::fs::metadata(dir.path().join(p)).unwrap())
            .collect();
        let data = Arc::new(BeneathRoot::open(&dir.path().join("data")).unwrap());
        let meta = Arc::new(BeneathRoot::open(&dir.path().join("meta")).unwrap());
        let w = Warmer::start(data.clone(), meta.clone());
        w.warm(["d/f", "d/missing", "d/sub", "../escape"].map(PathBuf::from));
        // The workers take the queue in order: waiting for it to empty, then stopping,
        // waits for every entry.
        while !w
            .shared
            .as_ref()
            .unwrap()
            .queue
            .lock()
            .unwrap()
            .paths
            .is_empty()
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        drop(w);
        for (p, b) in ["data/d/f", "meta/d/f"].iter().zip(before) {
            let now = std::fs::metadata(dir.path().join(p)).unwrap();
            assert_eq!(std::fs::read(dir.path().join(p)).unwrap(), b"bytes");
            assert_eq!(now.modified().unwrap(), b.modified().unwrap());
            assert_eq!(now.accessed().unwrap(), b.accessed().unwrap(), "{p}");
        }
        // An inline warmer takes paths and does nothing with them.
        Warmer::inline().warm([PathBuf::from("d/f")]);
        // An entry in memory is found so, and left alone.
        std::fs::read(dir.path().join("data/d/f")).unwrap();
        assert!(!warm_one(&data, &meta, Path::new("d/f")));
        // One out of memory (where the file system can drop its pages: not on tmpfs) is
        // read in. Whether `warm_one` says it did is not asked: its own look, a
        // `RWF_NOWAIT` read, starts the read-ahead when it misses, and a fast disk may
        // finish that within the call, so that the look finds the page in memory.
        let f = std::fs::File::open(dir.path().join("data/d/f")).unwrap();
        f.sync_all().unwrap();
        rustix::fs::fadvise(&f, 0, None, Advice::DontNeed).unwrap();
        // Asked by `mincore`, which reads nothing in.
        if !page_in_memory(&f) {
            warm_one(&data, &meta, Path::new("d/f"));
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while !page_in_memory(&f) {
                assert!(std::time::Instant::now() < deadline, "never read in");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    fn page_in_memory(f: &std::fs::File) -> bool {
        use std::os::fd::AsRawFd;
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let mut v = 0u8;
            assert_eq!(libc::mincore(p, 4096, &mut v), 0);
            libc::munmap(p, 4096);
            v & 1 == 1
        }
    }
}

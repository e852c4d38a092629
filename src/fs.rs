//! `CachingFs`: the file system's semantics, independent of how requests arrive.
//!
//! Every namespace operation and every write goes to the source first and returns only once
//! the source has answered (write-through); the cache is then brought in line, and any cache
//! failure only drops cached data, never fails the request. Reads are served from the cache
//! file, fetching missing chunks from the source first; reads of fully cached files opened
//! read-only go through FUSE passthrough and never reach the daemon.
//!
//! Lock order, the one order of the daemon's locks (`inode.rs` and `fetch.rs` point here): a
//! lock is taken only while holding locks above it in this list, never one below.
//! 1. `CachingFs::renames` (our own renames read, the watcher's batch write);
//! 2. `Inode::file`, a file's cache state (held by a rename's upload hold, and by a load);
//! 3. `CachingFs::evict_lock`, then `CachingFs::loaded`;
//! 4. a file's fetch state (`crate::fetch`): its gate, then its in-flight table, then a
//!    flight's own mutex;
//! 5. the inode table (`InodeTable`'s `inner`), then its name index, then `Inode::names`,
//!    then `Inode::former`;
//! 6. `CachingFs::handles`, with nothing taken under it.
//!
//! The inode table looks at `Inode::file` only with `try_lock` (freeing and reuse skip an
//! entry whose state is locked or loaded), which cannot deadlock; so `Inode::file` comes
//! before the table, and a loader can ask the table whether it still holds the entry it
//! locked (`InodeTable::holds`). No lock is held while waiting for another request; reads
//! and fetches hold `Inode::file` only to plan and to mark chunks present, never across
//! source I/O (the exceptions: `fetch_all`, used while passthrough opens exist, and
//! reopening the fetch descriptor after a reset). `src/inode/model_check.rs` and
//! `src/fetch/model_check.rs` check the table's and the flights' interleavings.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuser::{BackingId, Errno, FileAttr, FileType, FopenFlags};

mod attr;
mod backing;
mod changes;
mod commit;
mod control;
mod create;
mod dir;
mod entry;
mod evict;
mod fetch;
mod kernel_opens;
mod lock_waits;
mod locks;
mod namespace;
mod object;
mod offline;
mod open;
mod reintegrate;
mod source_reads;
mod source_writes;
mod state;
mod waiting_opens;
mod write;
pub use changes::spawn_coherence_threads;
pub use commit::spawn_committer;
pub use fetch::spawn_fetch_workers;
pub use lock_waits::{Answer, LockRequest};

use crate::cache::{CacheRecord, CacheStore, SourceIdentity};
use crate::cleaner::{Limits, Pins, Usage};
use crate::coherence::{Coherence, Notice};
use crate::config::Config;
use crate::fetch::HandleFetch;
use crate::health::{GuardedSource, OpenedSource, SourceFile};
use crate::inode::InodeLimits;
use crate::oplog::OpLog;
use crate::source::SourceReader;
use crate::source::{Capabilities, Stat};
use crate::stats::Stats;

pub type Result<T> = std::result::Result<T, Errno>;

/// How long a write behind the mount may still be copying its bytes after it moved the
/// file's times. Local file systems stamp the mtime and ctime first and copy after (ext4,
/// xfs and tmpfs call `file_modified` before `generic_perform_write`), so a fetch in that
/// time reads new bytes, old bytes and pages mid-copy under the new version's identity,
/// and no stat after the write differs. A version fetched within this of its last change
/// is recorded racy: its next open, or the watcher's notice of the write, compares it
/// with the source (`tests/mid_write.rs` stops a write halfway to show it). Generous: a
/// write of a few MiB copies in milliseconds, but a preempted one on a loaded machine
/// takes longer.
const WRITE_IN_FLIGHT: Duration = Duration::from_secs(1);

/// The set-ID bits of `mode` that a write or truncation by a caller without `CAP_FSETID`
/// clears: set-user-ID, and set-group-ID when the group may execute (without it the bit
/// means mandatory locking, and stays).
pub fn set_id_bits(mode: u32) -> u32 {
    let mut bits = mode & libc::S_ISUID;
    if mode & (libc::S_ISGID | libc::S_IXGRP) == libc::S_ISGID | libc::S_IXGRP {
        bits |= libc::S_ISGID;
    }
    bits
}

/// The errno of an I/O error; anything without one is EIO (and logged).
pub fn errno(e: io::Error) -> Errno {
    match e.raw_os_error() {
        Some(n) => Errno::from_i32(n),
        None => {
            tracing::warn!("I/O error without errno: {e}");
            Errno::EIO
        }
    }
}

/// A failed operation on the cache directory where the request cannot go on without it:
/// `EIO`, with the cause logged.
fn cache_failed(e: io::Error) -> Errno {
    tracing::warn!("cache directory: {e}");
    Errno::EIO
}

pub use entry::FileState;
use entry::{Env, OpenKind};

/// A node of this file system: the inode table's entry, holding a regular file's cache
/// state while it is open. Boxed: few entries have one loaded, and an entry's size is the
/// table's memory (928 bytes an entry with the state inline, 200 boxed).
pub type Inode = crate::inode::Inode<Box<FileState>>;
/// The inode table of this file system (`inode.rs`).
pub type InodeTable = crate::inode::InodeTable<Box<FileState>>;
/// The fetch workers' queue, whose jobs name this file system's nodes (`fetch_pool.rs`).
pub type Fetcher = crate::fetch_pool::Fetcher<Inode>;

/// An open regular file.
#[derive(Debug)]
pub struct Handle {
    pub inode: Arc<Inode>,
    /// The source file opened with the caller's access mode (absent for passthrough opens);
    /// closed through the source guard when the last request using the handle ends.
    source: Option<SourceFile>,
    writable: bool,
    passthrough: Option<Arc<BackingId>>,
    /// Opened with `FOPEN_DIRECT_IO` (`fs/open.rs`, `opens_direct`).
    direct: bool,
    /// Sequential detection and the short-path hint.
    fetch: HandleFetch,
    /// Where its writes go, decided at open.
    writes: Writes,
    /// Opened with `FOPEN_NOFLUSH`: its closes send no FLUSH, so the owners that took
    /// locks through it have them dropped at its RELEASE instead (`fs/locks.rs`).
    noflush: Option<std::sync::Mutex<Vec<u64>>>,
}

/// Where an open file's writes go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Writes {
    /// To the source, then copied into the cache (write-through); read-only handles too.
    Through,
    /// Opened for writing while offline: to the cache file, whose content goes to the
    /// offline log on close (`fs/reintegrate.rs`).
    Logged,
    /// Opened for writing on an object store: to the cache file, uploaded whole on close
    /// and fsync (`fs/object.rs`).
    Uploaded,
}

impl Handle {
    /// How the handle counts among its file's opens.
    fn open_kind(&self) -> OpenKind {
        match self.passthrough {
            Some(_) if self.writable => OpenKind::SourceWriter,
            Some(_) => OpenKind::Passthrough,
            None if self.direct => OpenKind::Direct {
                writes_source: self.writable && !self.writes_to_cache(),
            },
            None => OpenKind::Daemon {
                writes_source: self.writable && !self.writes_to_cache(),
            },
        }
    }

    /// Whether the kernel copies this handle's writes into its page cache before it sends
    /// them (`Inode::page_cache_writers`).
    fn writes_through_page_cache(&self) -> bool {
        self.writable && !self.direct && self.passthrough.is_none()
    }

    /// Whether writes go to the cache file rather than to the source.
    fn writes_to_cache(&self) -> bool {
        self.writes != Writes::Through
    }
}

/// What `open` and `create` answer.
pub struct Opened {
    pub fh: u64,
    pub flags: FopenFlags,
    pub backing: Option<Arc<BackingId>>,
}

/// The listing an open directory handle serves, read once at opendir.
#[derive(Debug)]
pub struct DirList {
    pub dir_id: u64,
    pub path: PathBuf,
    /// `O_PATH` descriptor of the directory (none on an object store), shared with the
    /// listing the directory holds.
    fd: Option<Arc<OwnedFd>>,
    pub entries: Vec<ListEntry>,
    /// The namespace generation (`offline::Listed`) before the listing was read.
    generation: u64,
    /// The directory's callback breaks (changes of its names, through the mount or seen by
    /// the watcher) before the listing was read (`CachingFs::listing`).
    breaks: u64,
}

/// What one READDIR serves: `list`'s entries from `start`, entry `i` at offset
/// `cookie | (i + 1)` (`cookie` names the listing a kernel-opened directory is read in,
/// `fs/kernel_opens.rs`; 0 for a handle's own).
pub struct Listing {
    pub list: Arc<DirList>,
    pub start: usize,
    pub cookie: u64,
}

/// One entry of a directory listing held by an open directory handle.
#[derive(Clone, Debug)]
pub struct ListEntry {
    pub ino: u64,
    pub kind: FileType,
    pub name: std::ffi::OsString,
}

pub struct CachingFs {
    pub cfg: Config,
    /// The source, reached only through health-guarded calls (timeouts, offline mode).
    source: Arc<GuardedSource>,
    pub(crate) cache: CacheStore,
    pub inodes: InodeTable,
    handles: Mutex<HashMap<u64, Arc<Handle>>>,
    dirs: Mutex<HashMap<u64, Arc<DirList>>>,
    /// Per (inode, lock owner): the source descriptor whose OFD locks stand for that
    /// owner's POSIX locks, so that locks hold on the source for every client. Shared
    /// with the lock calls using it: whoever lets go of it last closes it (guarded).
    locks: Mutex<HashMap<(u64, u64), Arc<SourceFile>>>,
    next_fh: AtomicU64,
    passthrough_ok: AtomicBool,
    /// Threads whose last open answered ESTALE, and when: their next open is the kernel's
    /// retry (`open`).
    estale_told: Mutex<HashMap<u32, Instant>>,
    pub stats: Stats,
    /// TTLs, the source watcher, leases, and the channel to the kernel's caches.
    pub coherence: Coherence,
    /// The cache's size estimate, limits and cleaner counters (`cleaner.rs`).
    pub usage: Arc<Usage>,
    pub pins: Arc<Pins>,
    /// Whether the source keeps a file's inode number for its life. FUSE sources (sshfs,
    /// rclone), SMB and 9p number files anew when their own caches forget them; there the
    /// identity leaves the inode number out, or every re-lookup would look like a change.
    stable_ino: bool,
    /// How coarse the source's timestamps are (`racy` identities, `recorded_identity`).
    timestamp_granularity: Duration,
    /// Inodes whose cache state is loaded (open through the mount): never evicted.
    loaded: Mutex<HashMap<u64, Arc<Inode>>>,
    /// Taken for reading while a loading state enters `loaded`, for writing while the
    /// cleaner evicts a file, so that no open file can load a record whose data is being
    /// removed (later evictions skip what `loaded` holds).
    evict_lock: RwLock<()>,
    /// Directories whose listing is saved for offline use (`fs/offline.rs`).
    listed: Mutex<offline::Listed>,
    /// Held for reading across a rename (source, inode table, cache), for writing while
    /// the watcher reconciles a batch: the watcher must see our own renames whole, or it
    /// would apply them a second time.
    renames: RwLock<()>,
    /// The fetch engine's queue, budget and tunables (`crate::fetch`).
    pub fetcher: Fetcher,
    /// Changes made offline, waiting for replay (`oplog.rs`, `fs/reintegrate.rs`).
    oplog: Mutex<OpLog>,
    /// Handles open for writing offline: replay waits until they are closed.
    offline_writers: AtomicU64,
    /// Uploads finished (object stores): a stat of the store taken before one may show
    /// the older object after the upload has cleared the file's pending mark
    /// (`fs/object.rs`, `pending_attr`).
    uploads_done: AtomicU64,
    /// With `--kernel-opens`: handles kept for removed files, listings being read
    /// (`fs/kernel_opens.rs`).
    kernel_opens: Option<kernel_opens::KernelOpens>,
    /// Listings served to directories the kernel opened itself (`fs/kernel_opens.rs`).
    kernel_listings: Option<kernel_opens::KernelListings>,
    /// Serialises offline changes to the saved listings.
    offline_edits: Mutex<()>,
    /// Files closed with fills or writes waiting for one sync of the cache (`fs/commit.rs`).
    commits: commit::GroupCommit,
    /// Blocking lock requests and the pool of threads that waits for them
    /// (`fs/lock_waits.rs`).
    lock_waits: lock_waits::LockWaits,
    /// Writers' opens that wait for passthrough readers' releases, off the request
    /// threads (`fs/waiting_opens.rs`).
    waiting_opens: waiting_opens::WaitingOpens,
}

fn kind_of(mode: u32) -> FileType {
    match mode & libc::S_IFMT {
        libc::S_IFDIR => FileType::Directory,
        libc::S_IFLNK => FileType::Symlink,
        libc::S_IFIFO => FileType::NamedPipe,
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        _ => FileType::RegularFile,
    }
}

fn time(t: (i64, u32)) -> SystemTime {
    if t.0 >= 0 {
        UNIX_EPOCH + Duration::new(t.0 as u64, t.1)
    } else {
        UNIX_EPOCH - Duration::new((-t.0) as u64, 0) + Duration::new(0, t.1)
    }
}

pub fn attr_of(id: u64, st: &Stat) -> FileAttr {
    FileAttr {
        ino: fuser::INodeNo(id),
        size: st.size,
        blocks: st.blocks,
        atime: time(st.atime),
        mtime: time(st.mtime),
        ctime: time(st.ctime),
        crtime: time(st.ctime),
        kind: kind_of(st.mode),
        perm: (st.mode & 0o7777) as u16,
        nlink: st.nlink as u32,
        uid: st.uid,
        gid: st.gid,
        rdev: st.rdev as u32,
        blksize: st.blksize,
        flags: 0,
    }
}

fn child(parent: &Path, name: &OsStr) -> Result<PathBuf> {
    if name.is_empty() || name == "." || name == ".." || name.as_encoded_bytes().contains(&b'/') {
        return Err(Errno::EINVAL);
    }
    Ok(if parent.as_os_str().is_empty() {
        PathBuf::from(name)
    } else {
        parent.join(name)
    })
}

fn now_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl CachingFs {
    /// The core over `opened`, the source built from the configuration outside it
    /// (`health::open_source`).
    pub fn new(cfg: Config, cache: CacheStore, opened: OpenedSource) -> anyhow::Result<CachingFs> {
        let OpenedSource {
            source,
            info,
            root_stat,
        } = opened;
        let stable_ino = info.stable_ino;
        let caps = source.capabilities();
        let coherence = Coherence::new(&cfg, caps.watchable);
        if !stable_ino {
            tracing::info!("the source renumbers inodes: cache identity leaves them out");
        }
        if cfg.source_reads && source.health.timeout().is_some() {
            // A passthrough read of a hung source would wait in the kernel, past the
            // timeout (`fs/source_reads.rs`).
            tracing::warn!("source_reads is off: the source has a source timeout");
        }
        let oplog = cache
            .private_dir("oplog")
            .and_then(OpLog::open)
            .map_err(|e| anyhow::anyhow!("cannot open the offline log: {e}"))?;
        let usage = Usage::default();
        usage.set_cache_fs(cache.top().root_fd().try_clone_to_owned()?);
        let pins = Pins::load(cache.top().clone())?;
        let pending = oplog.pending().len();
        source
            .health
            .log_pending
            .store(pending as u64, Ordering::Relaxed);
        if pending > 0 {
            // The source gets them before anything else: the probe replays them.
            tracing::info!("{pending} offline change(s) wait for replay to the source");
            source.health.go_offline(
                &format!("{pending} offline change(s) wait for replay"),
                false,
            );
        }
        Ok(CachingFs {
            source: source.clone(),
            cache,
            inodes: InodeTable::new(&root_stat, InodeLimits::new(cfg.max_inodes)),
            handles: Mutex::default(),
            dirs: Mutex::default(),
            locks: Mutex::default(),
            next_fh: AtomicU64::new(1),
            passthrough_ok: AtomicBool::new(cfg.passthrough && !cfg.kernel_opens),
            estale_told: Mutex::default(),
            stats: Stats::default(),
            coherence,
            usage: Arc::new(usage),
            pins: Arc::new(pins),
            stable_ino,
            // sftp gives whole seconds and no ctime; NFS and SMB servers vary. Local file
            // systems stamp fine-grained ctimes when someone looks (multigrain timestamps),
            // and the watcher sees every write there; object stores have ETags.
            timestamp_granularity: cfg.timestamp_granularity.unwrap_or(
                if info.remote && !caps.exact_versions {
                    Duration::from_secs(1)
                } else {
                    Duration::ZERO
                },
            ),
            loaded: Mutex::default(),
            evict_lock: RwLock::new(()),
            listed: Mutex::default(),
            renames: RwLock::new(()),
            fetcher: Fetcher::new(
                cfg.fetch_window,
                cfg.fetch_inflight,
                cfg.fetch_fds,
                cfg.fetch_dir_prefetch,
            )
            .closing_through(source.clone()),
            oplog: Mutex::new(oplog),
            offline_writers: AtomicU64::new(0),
            uploads_done: AtomicU64::new(0),
            kernel_opens: cfg.kernel_opens.then(Default::default),
            kernel_listings: (cfg.kernel_opens || cfg.kernel_dir_opens).then(Default::default),
            offline_edits: Mutex::new(()),
            commits: Default::default(),
            lock_waits: Default::default(),
            waiting_opens: Default::default(),
            cfg,
        })
    }

    /// The cache's limits from the configuration and the size of its file system.
    pub fn initial_limits(cfg: &Config) -> anyhow::Result<Limits> {
        let st = rustix::fs::statvfs(&cfg.cache_dir)?;
        let fs_bytes = st.f_blocks * st.f_frsize;
        Ok(Limits {
            max_bytes: cfg
                .cache_size
                .unwrap_or(fs_bytes / 100 * cfg.cache_share as u64),
            high_pct: cfg.high_watermark,
            low_pct: cfg.low_watermark,
            min_free_bytes: cfg.min_free.unwrap_or(fs_bytes / 20),
        })
    }

    /// The identity of a source version as this mount compares it (see `stable_ino`).
    fn identity(&self, st: &Stat) -> SourceIdentity {
        let mut id = SourceIdentity::of(st);
        if !self.stable_ino {
            id.ino = 0;
        }
        id
    }

    /// What a cache entry's rules need of this file system (`entry.rs`).
    fn env(&self) -> Env<'_> {
        Env {
            cache: &self.cache,
            usage: &self.usage,
            stats: &self.stats.cache,
            chunk_size: self.cfg.chunk_size,
        }
    }

    /// `inode`'s attributes for a reply to the kernel, which takes the file's size from
    /// them: remembered (`Inode::told_kernel_size`), so that an open serving another size
    /// makes the kernel drop it (`finish_open`); and, for files the kernel opens itself,
    /// the version they show (`kernel_version_told`). Every reply that gives a node's
    /// attributes takes them from here (a listing's entry for its own directory aside).
    fn attr_told(&self, inode: &Inode, st: &Stat) -> FileAttr {
        inode.told_kernel_size(st.size);
        self.kernel_version_told(inode, st);
        attr_of(inode.id, st)
    }

    /// The identity to record for a version `st` whose bytes the mount wrote or kept (its
    /// own write, truncate or attribute change): racy when it was taken within the source's
    /// timestamp granularity of the file's last change, so that a rewrite in the same tick,
    /// which would look the same, cannot keep the old bytes trusted (a racy identity
    /// matches no stat: the next open compares the bytes, `racy_record_still_holds`).
    fn recorded_identity(&self, st: &Stat) -> SourceIdentity {
        self.identity_racy_within(st, self.timestamp_granularity)
    }

    /// The identity to record for a version `st` whose bytes are about to be read from the
    /// source (a fetch, a comparison; taken before the reads): racy also while a write
    /// that made this version may still be copying its bytes (`WRITE_IN_FLIGHT`). An
    /// object's ETag names its bytes exactly, and a GET never returns half of a PUT.
    fn fetched_identity(&self, st: &Stat) -> SourceIdentity {
        self.identity_racy_within(st, self.racy_window())
    }

    /// How long after a file's last change a version read from the source is racy
    /// (`fetched_identity`).
    fn racy_window(&self) -> Duration {
        if self.caps().exact_versions {
            self.timestamp_granularity
        } else {
            self.timestamp_granularity + WRITE_IN_FLIGHT
        }
    }

    /// `st`'s identity, racy if taken now, less than `window` after the file's last change.
    fn identity_racy_within(&self, st: &Stat, window: Duration) -> SourceIdentity {
        let id = self.identity(st);
        if window.is_zero() {
            return id;
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        id.checked_at((now.as_secs() as i64, now.subsec_nanos()), window)
    }

    /// A racy record (`recorded_identity`) of the version `st` still names: whether the
    /// bytes it holds are the source's, compared chunk by chunk (git's answer to a racily
    /// clean entry). If so the record is settled (stamped anew; racy again only while the
    /// granularity has not passed) and keeps serving; if not, or if the source cannot be
    /// read, the caller treats the file as changed. The bytes compared are those of the
    /// file `own` names (an `O_PATH` descriptor of the file `st` describes), whatever name
    /// leads to it now: the name may lead to another file by now (renamed over), whose
    /// bytes say nothing of this one's, and taking them for a change reset a state whose
    /// daemon handles then had no way left to read their version (`EIO`). Without `own`,
    /// the file at `path`, which must still be that version.
    fn racy_record_still_holds(
        &self,
        path: &Path,
        own: Option<std::os::fd::BorrowedFd<'_>>,
        files: &crate::cache::store::CacheFiles,
        rec: &mut CacheRecord,
        st: &Stat,
    ) -> bool {
        let now = self.identity(st);
        // The comparison reads the source through a descriptor.
        if !rec.identity.racy || !rec.identity.same_version(&now) || !self.caps().descriptors {
            return false;
        }
        // Stamped as of before the comparison's reads: they may race a write as a fetch can.
        let stamp = self.fetched_identity(st);
        let opened = match own {
            Some(fd) => self.source.reopen(fd, libc::O_RDONLY),
            None => self.source.open_file(path, libc::O_RDONLY),
        };
        let Ok(src) = opened else {
            return false;
        };
        let same = (0..rec.nchunks()).filter(|c| rec.is_present(*c)).all(|c| {
            let off = c * rec.chunk_size;
            let len = rec.chunk_size.min(rec.identity.size - off) as usize;
            let (mut a, mut b) = (vec![0u8; len], vec![0u8; len]);
            let a_ok = self
                .source
                .with_fd(src.as_fd(), move |f| {
                    use std::os::unix::fs::FileExt;
                    f.read_exact_at(&mut a, off).map(|_| a)
                })
                .ok();
            use std::os::unix::fs::FileExt;
            a_ok.is_some_and(|a| files.data.read_exact_at(&mut b, off).is_ok() && a == b)
        });
        // Read as the version the record names, nothing written meanwhile. Renamed over
        // or unlinked meanwhile moves only the ctime: its bytes are still the version's
        // (taking that for a change reset the cache of a file that had not changed).
        let after = self.source.fstat(src.as_fd());
        drop(src); // closed through the guard
        let unchanged = after.is_ok_and(|a| {
            let id = self.identity(&a);
            id.same_version(&now)
                || (a.nlink == 0 && (id.ino, id.size, id.mtime) == (now.ino, now.size, now.mtime))
        });
        if !same || !unchanged {
            return false;
        }
        rec.identity = stamp;
        true
    }

    /// `racy_record_still_holds` for a loaded state, whose record is stamped anew if so.
    pub(super) fn settle_racy(&self, path: &Path, state: &mut FileState, st: &Stat) -> bool {
        let Some(files) = state.files() else {
            return false;
        };
        let mut rec = state.record().clone();
        let own = state.path_fd.as_deref().map(AsFd::as_fd);
        if !self.racy_record_still_holds(path, own, files, &mut rec, st) {
            return false;
        }
        state.own_version(rec.identity);
        state.persist_record(&self.env(), false);
        true
    }

    /// A reader of the source file at `path` for fetching into a cache of version `expect`.
    /// On a POSIX source the file is opened by name, and the name may lead to another
    /// version by now (renamed over, rewritten): its bytes must never be cached as
    /// `expect`'s, so a file whose identity differs is refused with `ESTALE` (unless the
    /// stale check is off, which trusts the cache as it is). An object store checks the
    /// ETag itself.
    fn open_fetch_reader(&self, path: &Path, expect: &SourceIdentity) -> io::Result<SourceReader> {
        let reader = self.source.open_reader(path, expect)?;
        if let SourceReader::File(f) = &reader
            && self.stale_check()
        {
            let same =
                (self.source.fstat(f.as_fd())).map(|st| self.identity(&st).same_version(expect));
            if !matches!(same, Ok(true)) {
                self.source.close_later(reader);
                return Err(same
                    .err()
                    .unwrap_or(io::Error::from_raw_os_error(libc::ESTALE)));
            }
        }
        Ok(reader)
    }

    /// Installs the hook that passes notices to the kernel (FUSE notify).
    pub fn set_notifier(&mut self, f: impl Fn(Notice) + Send + Sync + 'static) {
        self.coherence.set_notifier(f);
    }

    /// Starts the source probe; when the mount comes back online, everything the kernel
    /// and the open files hold is revalidated (the source may have changed meanwhile).
    pub fn spawn_health_probe(self: &Arc<Self>) -> io::Result<crate::threads::Threads> {
        let weak = Arc::downgrade(self);
        self.source.health.set_on_switch(move |online| {
            if online && let Some(fs) = weak.upgrade() {
                fs.invalidate_everything();
            }
        });
        let weak = Arc::downgrade(self);
        self.source
            .health
            .set_reconnector(move |manual| match weak.upgrade() {
                Some(fs) => fs.reconnect(manual),
                None => Ok(()),
            });
        crate::health::spawn_probe(self.source.clone())
    }

    /// Stops the source workers at shutdown (`run.rs`), waiting until `deadline`.
    pub fn stop_source_workers(&self, deadline: std::time::Instant) {
        self.source.stop_workers(deadline);
    }

    /// Watches the root directory, whose entries the kernel learns first.
    pub fn watch_root(&self) {
        self.coherence.watch_dir(crate::inode::ROOT_ID, || {
            self.source.dir(Path::new("")).ok()
        });
    }

    /// The entry TTL of names in `parent` (readdirplus gives one TTL for name and
    /// attributes: `linked_file_ttl` shortens it per file).
    pub fn dir_entry_ttl(&self, parent: u64) -> Duration {
        self.coherence
            .tunables
            .entry(self.coherence.watched(parent))
    }

    /// Entry and attribute TTLs for `attr`'s entry in directory `parent`.
    pub fn entry_ttls(&self, parent: u64, attr: &FileAttr) -> (Duration, Duration) {
        let w = self.coherence.watched(parent);
        let t = &self.coherence.tunables;
        (t.entry(w), self.linked_file_ttl(t.attr(w), attr))
    }

    /// How long the kernel may remember that a name in `parent` does not exist.
    pub fn negative_ttl(&self, parent: u64) -> Duration {
        self.coherence
            .tunables
            .negative(self.coherence.watched(parent))
    }

    /// Attribute TTL for node `attr.ino`: long if changes to it are reported.
    pub fn attr_ttl(&self, attr: &FileAttr) -> Duration {
        let id = attr.ino.0;
        let watched = self.inodes.get(id).is_some_and(|i| {
            self.coherence.watched(i.parent())
                || (i.file_type == libc::S_IFDIR && self.coherence.watched(id))
        });
        self.linked_file_ttl(self.coherence.tunables.attr(watched), attr)
    }

    /// `ttl`, or for a regular file with more than one link no longer than where nothing
    /// is watched: a write through a link in another directory (outside the source, or
    /// unwatched) raises no event in the watched one, so only the kernel's next look at
    /// the file's attributes finds it (with `--kernel-opens`, that look is what drops its
    /// pages; otherwise it keeps `stat` from showing an old size for a watched TTL).
    pub fn linked_file_ttl(&self, ttl: Duration, attr: &FileAttr) -> Duration {
        if attr.kind == FileType::RegularFile && attr.nlink > 1 {
            ttl.min(self.coherence.tunables.attr(false))
        } else {
            ttl
        }
    }

    /// Open flags for directory `id`: the kernel keeps its listing across opens while a
    /// watch reports changes to it (and drops it on our notice).
    pub fn dir_open_flags(&self, id: u64) -> FopenFlags {
        if self.coherence.watched(id) {
            FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE
        } else {
            FopenFlags::empty()
        }
    }

    fn stale_check(&self) -> bool {
        self.coherence.tunables.stale_check.load(Ordering::Relaxed)
    }

    /// Called when the kernel turns out not to support passthrough.
    pub fn disable_passthrough(&self) {
        self.passthrough_ok.store(false, Ordering::Relaxed);
    }

    /// What the source can do (`source::Capabilities`).
    pub fn caps(&self) -> Capabilities {
        self.source.capabilities()
    }

    pub fn passthrough_enabled(&self) -> bool {
        self.passthrough_ok.load(Ordering::Relaxed)
    }

    fn inode(&self, id: u64) -> Result<Arc<Inode>> {
        self.inodes.get(id).ok_or(Errno::ESTALE)
    }

    /// The path of node `id`; ENOENT when every name of it is gone (see `Inode::path`).
    fn path_of(&self, id: u64) -> Result<PathBuf> {
        self.inode(id)?.path().ok_or(Errno::ENOENT)
    }

    fn handle(&self, fh: u64) -> Result<Arc<Handle>> {
        self.handles
            .lock()
            .unwrap()
            .get(&fh)
            .cloned()
            .ok_or(Errno::EBADF)
    }

    fn new_fh(&self) -> u64 {
        self.next_fh.fetch_add(1, Ordering::Relaxed)
    }

    /// `uncache`, done off the caller's path (`cache/removals.rs`): for names gone from
    /// the source.
    fn uncache_later(&self, rel: &Path) {
        let usage = self.usage.clone();
        self.cache
            .remove_entry_later(rel, Box::new(move |removed| usage.removed(removed)));
    }

    /// `uncache_later` for a name the watcher saw gone from the source: by the time the
    /// removal is done a file may have been made under it again (through the mount, whose
    /// create makes its cache entry after the source's file), so the source is asked again
    /// then, and an entry is removed only while the name is still gone.
    fn uncache_later_while_gone(&self, rel: &Path) {
        let usage = self.usage.clone();
        let source = self.source.clone();
        let path = rel.to_path_buf();
        let still_gone = Box::new(
            move || matches!(source.stat(&path), Err(e) if e.raw_os_error() == Some(libc::ENOENT)),
        );
        self.cache.remove_entry_later_if(
            rel,
            still_gone,
            Box::new(move |removed| usage.removed(removed)),
        );
    }

    /// Removes whatever the cache holds for `rel` (`CacheStore::remove_entry`), counting
    /// what that frees.
    fn uncache(&self, rel: &Path) -> io::Result<()> {
        self.usage.removed(self.cache.remove_entry(rel)?);
        Ok(())
    }
}

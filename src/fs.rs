//! `CachingFs`: the file system's semantics, independent of how requests arrive.
//!
//! Every namespace operation and every write goes to the source first and returns only once
//! the source has answered (write-through); the cache is then brought in line, and any cache
//! failure only drops cached data, never fails the request. Reads are served from the cache
//! file, fetching missing chunks from the source first; reads of fully cached files opened
//! read-only go through FUSE passthrough and never reach the daemon.
//!
//! Lock order: inode table, then `Inode::names`, then `Inode::file`, then `CachingFs::handles`;
//! a file's in-flight table and its flights come after `Inode::file` (`crate::fetch`). No lock
//! is held while waiting for another request; reads and fetches hold `Inode::file` only to
//! plan and to mark chunks present, never across source I/O (the exceptions: `fetch_all`,
//! used while passthrough opens exist, and reopening the fetch descriptor after a reset).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fuser::{BackingId, Errno, FileAttr, FileType, FopenFlags};

mod changes;
mod commit;
mod entry;
mod fetch;
mod object;
mod offline;
mod reintegrate;
pub use changes::spawn_coherence_threads;
pub use commit::spawn_committer;
pub use fetch::spawn_fetch_workers;

use crate::cache::record::chunk_count;
use crate::cache::source_info::SourceInfo;
use crate::cache::store::{CacheFiles, read_record, write_record};
use crate::cache::{CacheRecord, CacheStore, SourceIdentity};
use crate::cleaner::{EvictTarget, Limits, Pins, Usage};
use crate::coherence::{Coherence, Notice};
use crate::config::Config;
use crate::fetch::{FileFetch, HandleFetch};
use crate::health::{GuardedSource, Health};
use crate::inode::InodeLimits;
use crate::object_tree::SourceReader;
use crate::oplog::OpLog;
use crate::source::{BeneathRoot, SetAttr, Stat, fstat};
use crate::stats::{Snapshot, Stats};

pub type Result<T> = std::result::Result<T, Errno>;

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

/// Source call timeout where none is configured and the source is a network or FUSE file
/// system: long enough for a slow server, short enough that a dead one is noticed.
const DEFAULT_REMOTE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often an open looks at a file again whose record is older than the source while
/// an own change may be under way (a millisecond apart while one is).
const OWN_CHANGE_TRIES: u32 = 50;

/// How long after an open answered ESTALE its thread's next open counts as the kernel's
/// retry of it (`CachingFs::open`): the retry follows at once, but a loaded machine may
/// delay it. Bounds a mark the kernel did not follow with a retry.
const ESTALE_RETRY: Duration = Duration::from_secs(1);

/// How long a writer waits for passthrough readers whose release is still on its way.
const PASSTHROUGH_RELEASE_WAIT: Duration = Duration::from_millis(500);

use entry::Env;
pub use entry::FileState;

/// A node of this file system: the inode table's entry, holding a regular file's cache
/// state while it is open.
pub type Inode = crate::inode::Inode<FileState>;
/// The inode table of this file system (`inode.rs`).
pub type InodeTable = crate::inode::InodeTable<FileState>;
/// The fetch workers' queue, whose jobs name this file system's nodes (`fetch_pool.rs`).
pub type Fetcher = crate::fetch_pool::Fetcher<Inode>;

/// An open regular file.
#[derive(Debug)]
pub struct Handle {
    pub inode: Arc<Inode>,
    /// The source file opened with the caller's access mode (absent for passthrough opens).
    source: Option<File>,
    writable: bool,
    passthrough: Option<Arc<BackingId>>,
    /// Sequential detection and the short-path hint.
    fetch: HandleFetch,
    /// Where its writes go, decided at open.
    writes: Writes,
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
    /// `O_PATH` descriptor of the directory (none on an object store).
    fd: Option<OwnedFd>,
    pub entries: Vec<ListEntry>,
    /// The namespace generation (`offline::Listed`) before the listing was read.
    generation: u64,
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
    /// owner's POSIX locks, so that locks hold on the source for every client.
    locks: Mutex<HashMap<(u64, u64), File>>,
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
    /// Taken for reading while a cache state loads, for writing while the cleaner evicts a
    /// file, so that no open file can load a record whose data is being removed.
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
    /// Serialises offline changes to the saved listings.
    offline_edits: Mutex<()>,
    /// Files closed with fills or writes waiting for one sync of the cache (`fs/commit.rs`).
    commits: commit::GroupCommit,
}

/// Longest wait for the source's root at start: a dead network mount can hang any call
/// on its path.
const SOURCE_OPEN_WAIT: Duration = Duration::from_secs(10);

/// Opens the source's root (waiting at most `SOURCE_OPEN_WAIT`) and checks it against what
/// the cache recorded of it; the error says why it cannot be used.
fn open_source(
    path: &Path,
    recorded: Option<&SourceInfo>,
) -> std::result::Result<(BeneathRoot, SourceInfo), String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = path.to_path_buf();
    std::thread::spawn(move || {
        let r = BeneathRoot::open(&p).and_then(|root| {
            let info = SourceInfo::of(root.root_fd())?;
            Ok((root, info))
        });
        let _ = tx.send(r);
    });
    let (root, info) = match rx.recv_timeout(SOURCE_OPEN_WAIT) {
        Ok(Ok(opened)) => opened,
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err(format!("no answer within {SOURCE_OPEN_WAIT:?}")),
    };
    if let Some(why) = recorded.and_then(|r| r.mismatch(&info)) {
        return Err(why);
    }
    Ok((root, info))
}

/// Opens an object-store source and checks that it answers (a stat of its root); one that
/// does not is used offline when the cache holds an earlier mount of it.
#[cfg(feature = "s3")]
fn open_object_source(
    cfg: &Config,
    url: &crate::object_source::ObjectUrl,
    cache: &CacheStore,
    recorded: Option<&SourceInfo>,
) -> anyhow::Result<(crate::object_tree::ObjectTree, SourceInfo, Option<String>)> {
    let name = cfg.source.display();
    let opts = crate::object_source::S3Options {
        endpoint: cfg.s3.endpoint.clone(),
        region: cfg.s3.region.clone(),
        virtual_hosted: cfg.s3.virtual_hosted,
        allow_http: cfg
            .s3
            .endpoint
            .as_deref()
            .is_some_and(|e| e.starts_with("http://")),
        ..Default::default()
    };
    let store = crate::object_source::ObjectSource::open(url, opts)
        .map_err(|e| anyhow::anyhow!("cannot use the source {name}: {e}"))?;
    let tree = crate::object_tree::ObjectTree::new(store);
    let object_recorded =
        recorded.filter(|r| r.fs_type == crate::cache::source_info::OBJECT_STORE_TYPE);
    if recorded.is_some() && object_recorded.is_none() {
        anyhow::bail!(
            "the cache directory {} was filled from a directory source, not {name}",
            cache.root().display()
        );
    }
    match tree.check_root() {
        Ok(root) => {
            let info = SourceInfo::object(&root);
            if let Err(e) = info.save(cache.top()) {
                tracing::warn!("cannot record the source's kind in the cache: {e}");
            }
            Ok((tree, info, None))
        }
        Err(e) if crate::source::may_mean_unreachable(&e) && object_recorded.is_some() => {
            Ok((tree, *object_recorded.unwrap(), Some(e.to_string())))
        }
        Err(e) => anyhow::bail!("cannot use the source {name}: {e}"),
    }
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
    pub fn new(cfg: Config, cache: CacheStore) -> anyhow::Result<CachingFs> {
        let recorded = SourceInfo::load(cache.top());
        // Without the `s3` feature, `Config::check_values` refused an object-store source.
        #[cfg(feature = "s3")]
        if let Some(url) = cfg.object_url() {
            let (tree, info, unreachable) =
                open_object_source(&cfg, &url, &cache, recorded.as_ref())?;
            // Object-store calls carry their own timeouts (`S3Options`); a health timeout
            // shorter than an upload would take the mount offline in mid-upload.
            let timeout = cfg.source_timeout.filter(|t| !t.is_zero());
            let health = Arc::new(Health::new(timeout, cfg.start_offline));
            if let Some(why) = &unreachable {
                health.go_offline(&format!("the source is unavailable at start: {why}"), false);
            }
            let name = cfg.source.to_string_lossy().into_owned();
            let source = GuardedSource::new_object(tree, &name, health, &info);
            return Self::with_source(cfg, cache, Arc::new(source), info, info.root_stat());
        }
        let (root, info, unreachable) = match open_source(&cfg.source, recorded.as_ref()) {
            Ok((root, info)) => {
                if let Err(e) = info.save(cache.top()) {
                    tracing::warn!("cannot record the source's kind in the cache: {e}");
                }
                (Some(root), info, None)
            }
            // Disconnected operation from the start: the cache of an earlier mount.
            Err(why) => match recorded {
                Some(rec) => (None, rec, Some(why)),
                None => anyhow::bail!("cannot use the source {}: {why}", cfg.source.display()),
            },
        };
        let timeout = match cfg.source_timeout {
            None => info.remote.then_some(DEFAULT_REMOTE_TIMEOUT),
            Some(t) if t.is_zero() => None,
            Some(t) => Some(t),
        };
        let health = Arc::new(Health::new(timeout, cfg.start_offline));
        if let Some(why) = &unreachable {
            health.go_offline(&format!("the source is unavailable at start: {why}"), false);
        }
        let root_stat = match &root {
            Some(r) => fstat(r.root_fd())?,
            None => info.root_stat(),
        };
        let source = Arc::new(GuardedSource::new(root, &cfg.source, health, &info));
        Self::with_source(cfg, cache, source, info, root_stat)
    }

    fn with_source(
        cfg: Config,
        cache: CacheStore,
        source: Arc<GuardedSource>,
        info: SourceInfo,
        root_stat: Stat,
    ) -> anyhow::Result<CachingFs> {
        let stable_ino = info.stable_ino;
        let coherence = Coherence::new(&cfg, !info.remote);
        if !stable_ino {
            tracing::info!("the source renumbers inodes: cache identity leaves them out");
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
            source,
            cache,
            inodes: InodeTable::new(&root_stat, InodeLimits::new(cfg.max_inodes)),
            handles: Mutex::default(),
            dirs: Mutex::default(),
            locks: Mutex::default(),
            next_fh: AtomicU64::new(1),
            passthrough_ok: AtomicBool::new(cfg.passthrough),
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
                if info.remote && !cfg.is_object_source() {
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
            ),
            oplog: Mutex::new(oplog),
            offline_writers: AtomicU64::new(0),
            offline_edits: Mutex::new(()),
            commits: Default::default(),
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

    /// Changes a setting of the running mount (`hoardfs set`, parsed by the option table).
    /// `None` (`auto`) restores the default as the mount computes it at start.
    pub fn set(&self, setting: crate::options::Live) -> std::result::Result<(), String> {
        use crate::options::Live;
        use std::sync::atomic::Ordering::Relaxed;
        let (ttls, tun) = (&self.coherence.tunables, &self.fetcher.tun);
        // The cache's limits as the mount computes them without `--cache-size` and
        // `--min-free` (their `auto`).
        let computed = || {
            let mut cfg = self.cfg.clone();
            (cfg.cache_size, cfg.min_free) = (None, None);
            Self::initial_limits(&cfg).map_err(|e| format!("cannot compute the default: {e}"))
        };
        let cache_limits = |change: &dyn Fn(&mut Limits)| {
            let mut l = self.usage.limits().ok_or("the cache has no limits yet")?;
            change(&mut l);
            if l.low_pct >= l.high_pct {
                return Err("low_watermark must be below high_watermark".to_string());
            }
            self.usage.set_limits(Some(l));
            Ok(())
        };
        let mut inodes = self.inodes.limits();
        let inode_defaults = InodeLimits::new(inodes.max_inodes);
        match setting {
            Live::EntryTtl(t) => ttls.set_entry(t),
            Live::AttrTtl(t) => ttls.set_attr(t),
            Live::NegativeTtl(t) => ttls.set_negative(t),
            Live::StaleCheck(on) => ttls.stale_check.store(on, Relaxed),
            Live::Watch(on) => ttls.watch.store(on, Relaxed),
            Live::SourceTimeout(t) => self.source.health.set_timeout(match t {
                // As `new` chooses it: object stores time their own calls.
                None if !self.cfg.is_object_source() && self.source.is_remote() => {
                    Some(DEFAULT_REMOTE_TIMEOUT)
                }
                t => t.filter(|t| !t.is_zero()),
            }),
            Live::Online(true) => return self.reconnect(true),
            Live::Online(false) => self.source.health.go_offline("switched off by hand", true),
            Live::FetchWindow(v) => tun.window.store(v, Relaxed),
            Live::FetchInflight(v) => tun.inflight.store(v, Relaxed),
            Live::FetchFds(v) => tun.fds.store(v, Relaxed),
            Live::FetchDirPrefetch(v) => tun.dir_prefetch.store(v, Relaxed),
            Live::CacheSize(v) => {
                let v = v.map_or_else(|| computed().map(|d| d.max_bytes), Ok)?;
                cache_limits(&|l| l.max_bytes = v)?
            }
            Live::MinFree(v) => {
                let v = v.map_or_else(|| computed().map(|d| d.min_free_bytes), Ok)?;
                cache_limits(&|l| l.min_free_bytes = v)?
            }
            Live::HighWatermark(p) => cache_limits(&|l| l.high_pct = p)?,
            Live::LowWatermark(p) => cache_limits(&|l| l.low_pct = p)?,
            Live::MaxInodes(n) => inodes.max_inodes = n.max(1),
            Live::InodeFreeMin(n) => inodes.free_min = n.unwrap_or(inode_defaults.free_min),
            Live::InodeMinAge(t) => inodes.min_age = t.unwrap_or(inode_defaults.min_age),
            Live::InodeMaxAge(t) => inodes.max_age = t.unwrap_or(inode_defaults.max_age),
            Live::InodeFreeing(on) => inodes.freeing = on,
            Live::Log(_) => return Err("log: the control socket sets the log filter".into()),
        }
        if inodes != self.inodes.limits() {
            self.inodes.set_limits(inodes);
        }
        Ok(())
    }

    /// Pins or unpins a path (relative to the mount) so the cleaner never evicts it.
    pub fn pin(&self, rel: &Path, on: bool) -> std::result::Result<(), String> {
        crate::source::check_relative(rel)
            .map_err(|_| format!("{}: not a path inside the mount", rel.display()))?;
        if on {
            self.source
                .stat(rel)
                .map_err(|e| format!("{}: {e}", rel.display()))?;
        }
        self.pins
            .set(rel, on)
            .map_err(|e| format!("cannot save pins: {e}"))
    }

    /// Runs a clean now, down to `to` bytes or the low watermark.
    pub fn clean(&self, to: Option<u64>) -> u64 {
        // Asked for by a person: down to the low watermark even if below the high one.
        let to = to.or(self.usage.limits().map(|l| l.low()));
        crate::cleaner::clean_once(&self.cache.trees(), &self.pins, &self.usage, to, self)
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

    /// The identity to record for the version `st` that is about to be cached (or was just
    /// written): racy when it was taken within the source's timestamp granularity of its
    /// mtime, so that a rewrite in the same tick, which would look the same, cannot keep
    /// the old bytes trusted (a racy identity matches no stat: the next open fetches again,
    /// and records a settled identity then).
    fn recorded_identity(&self, st: &Stat) -> SourceIdentity {
        let id = self.identity(st);
        if self.timestamp_granularity.is_zero() {
            return id;
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        id.checked_at(
            (now.as_secs() as i64, now.subsec_nanos()),
            self.timestamp_granularity,
        )
    }

    /// A racy record (`recorded_identity`) of the version `st` still names: whether the
    /// bytes it holds are the source's, compared chunk by chunk (git's answer to a racily
    /// clean entry). If so the record is settled (stamped anew; racy again only while the
    /// granularity has not passed) and keeps serving; if not, or if the source cannot be
    /// read, the caller treats the file as changed.
    fn racy_record_still_holds(
        &self,
        path: &Path,
        files: &crate::cache::store::CacheFiles,
        rec: &mut CacheRecord,
        st: &Stat,
    ) -> bool {
        let now = self.identity(st);
        if !rec.identity.racy || !rec.identity.same_version(&now) || self.source.is_object() {
            return false;
        }
        let Ok(src) = self.source.open_file(path, libc::O_RDONLY) else {
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
        // Read as the version the record names, nothing written meanwhile.
        let after = self.source.fstat(src.as_fd()).map(|a| self.identity(&a));
        self.source.close(src);
        if !same || !after.is_ok_and(|a| a.same_version(&now)) {
            return false;
        }
        rec.identity = self.recorded_identity(st);
        true
    }

    /// `racy_record_still_holds` for a loaded state, whose record is stamped anew if so.
    pub(super) fn settle_racy(&self, path: &Path, state: &mut FileState, st: &Stat) -> bool {
        let Some(files) = state.files.as_ref() else {
            return false;
        };
        let mut rec = state.record.clone();
        if !self.racy_record_still_holds(path, files, &mut rec, st) {
            return false;
        }
        state.record.identity = rec.identity;
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
            && !self.identity(&fstat(f.as_fd())?).same_version(expect)
        {
            return Err(io::Error::from_raw_os_error(libc::ESTALE));
        }
        Ok(reader)
    }

    /// Installs the hook that passes notices to the kernel (FUSE notify).
    pub fn set_notifier(&mut self, f: impl Fn(Notice) + Send + Sync + 'static) {
        self.coherence.set_notifier(f);
    }

    /// Starts the source probe; when the mount comes back online, everything the kernel
    /// and the open files hold is revalidated (the source may have changed meanwhile).
    pub fn spawn_health_probe(self: &Arc<Self>) -> io::Result<()> {
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

    /// Watches the root directory, whose entries the kernel learns first.
    pub fn watch_root(&self) {
        self.coherence.watch_dir(crate::inode::ROOT_ID, || {
            self.source.dir(Path::new("")).ok()
        });
    }

    /// Entry and attribute TTLs for an entry in directory `parent`.
    pub fn entry_ttls(&self, parent: u64) -> (Duration, Duration) {
        let w = self.coherence.watched(parent);
        let t = &self.coherence.tunables;
        (t.entry(w), t.attr(w))
    }

    /// How long the kernel may remember that a name in `parent` does not exist.
    pub fn negative_ttl(&self, parent: u64) -> Duration {
        self.coherence
            .tunables
            .negative(self.coherence.watched(parent))
    }

    /// Attribute TTL for node `id`: long if changes to it are reported.
    pub fn attr_ttl(&self, id: u64) -> Duration {
        let watched = self.inodes.get(id).is_some_and(|i| {
            self.coherence.watched(i.parent())
                || (i.file_type == libc::S_IFDIR && self.coherence.watched(id))
        });
        self.coherence.tunables.attr(watched)
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

    /// Whether the source is an object store (`object_tree.rs`).
    pub fn source_is_object(&self) -> bool {
        self.source.is_object()
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

    pub fn snapshot(&self) -> Snapshot {
        let (cache_bytes, cache_files) = (
            self.usage.bytes.load(Ordering::Relaxed),
            self.usage.files.load(Ordering::Relaxed),
        );
        Snapshot {
            mountpoint: self.cfg.mountpoint.display().to_string(),
            source: self.cfg.source.display().to_string(),
            cache_dir: self.cfg.cache_dir.display().to_string(),
            requests: self.stats.requests(),
            cache: self.stats.cache_snapshot(),
            inodes: self.inodes.len() as u64,
            inode_table: self.inodes.snapshot(),
            open_handles: self.handles.lock().unwrap().len() as u64,
            cache_bytes,
            cache_files,
            cleaner: self.usage.snapshot(),
            coherence: self.coherence.snapshot(),
            health: self.source.health.snapshot(),
        }
    }

    // ---------------------------------------------------------------- attributes & names

    /// Attributes of `inode`: from an open handle when there is one (the name may be gone),
    /// otherwise from its path.
    pub fn getattr(&self, id: u64, fh: Option<u64>) -> Result<FileAttr> {
        if !self.online() {
            return self.offline_getattr(&*self.inode(id)?);
        }
        match self.getattr_online(id, fh) {
            // The source failed and the mount went offline meanwhile: the cache answers.
            Err(_) if !self.online() => self.offline_getattr(&*self.inode(id)?),
            r => r,
        }
    }

    fn getattr_online(&self, id: u64, fh: Option<u64>) -> Result<FileAttr> {
        let mut st = self.getattr_source(id, fh)?;
        if let Ok(inode) = self.inode(id)
            && inode.is_retired()
            && let Some(state) = inode.file().as_ref()
        {
            // Handles that kept an old version see its size and times, as they read it.
            let kept = &state.record.identity;
            st.size = kept.size;
            st.blocks = kept.size.div_ceil(512);
            st.mtime = kept.mtime;
            st.ctime = kept.ctime;
        }
        Ok(attr_of(id, &st))
    }

    fn getattr_source(&self, id: u64, fh: Option<u64>) -> Result<Stat> {
        if let Some(h) = fh.and_then(|fh| self.handle(fh).ok())
            && let Some(src) = &h.source
        {
            return self.source.fstat(src.as_fd()).map_err(errno);
        }
        let inode = self.inode(id)?;
        let mut elsewhere = false;
        let stat = match inode.path() {
            Some(path) => self.source.stat(&path).and_then(|st| {
                if self.stable_ino && (st.dev, st.ino) != inode.key {
                    // The name leads to another object now (replaced behind the mount):
                    // its attributes are not this node's (a reader of this node's file
                    // would have its reads cut at the other file's size).
                    elsewhere = true;
                    return Err(io::Error::from_raw_os_error(libc::ENOENT));
                }
                Ok(st)
            }),
            None => Err(io::Error::from_raw_os_error(libc::ENOENT)),
        };
        match stat {
            Ok(mut st) => {
                self.pending_attr(id, &mut st);
                Ok(st)
            }
            // The node's name leads elsewhere: the kernel's dentry is stale (dropped now).
            // The node's own file answers while it is open (fstat of its handles, which
            // carries no handle in FUSE); otherwise ESTALE, and the kernel looks the name
            // up again.
            Err(_) if elsewhere => {
                if let Some(path) = inode.path()
                    && let Some(name) = path.file_name()
                {
                    let notice = Notice::Entry(inode.parent(), name.to_os_string());
                    self.coherence.notify(notice);
                }
                let own = self.open_source_fd(&inode);
                let mut st = own
                    .and_then(|f| fstat(f.as_fd()).ok())
                    .ok_or(Errno::ESTALE)?;
                self.pending_attr(id, &mut st);
                Ok(st)
            }
            // fstat of an open file whose name is gone: answer from an open descriptor.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                let st = self
                    .open_source_fd(&inode)
                    .and_then(|f| self.source.fstat(f.as_fd()).ok())
                    .or_else(|| inode.file().as_ref().and_then(|s| s.unlinked));
                // Nothing open: the kernel's dentry is stale (the name was renamed or
                // removed behind the mount). ESTALE makes the kernel look the name up again
                // and retry (a stat, or the permission check of an open), which then finds
                // what the name is now, or ENOENT.
                let mut st = st.ok_or_else(|| {
                    tracing::debug!(id, path = ?inode.path(), "getattr of a node whose name is gone");
                    Errno::ESTALE
                })?;
                self.pending_attr(id, &mut st);
                Ok(st)
            }
            Err(e) => Err(errno(e)),
        }
    }

    /// A descriptor of the source object behind an open inode, if one is open.
    fn open_source_fd(&self, inode: &Arc<Inode>) -> Option<OwnedFd> {
        if inode.file_type == libc::S_IFDIR {
            let dirs = self.dirs.lock().unwrap();
            let list = dirs.values().find(|l| l.dir_id == inode.id)?;
            return crate::source::dup_file(list.fd.as_ref()?.as_fd())
                .ok()
                .map(OwnedFd::from);
        }
        let guard = inode.file();
        let state = guard.as_ref()?;
        let fd = state.path_fd.as_ref().map(|f| f.as_fd()).or(state
            .fetch_src
            .as_ref()
            .and_then(|f| match &f.reader {
                SourceReader::File(file) => Some(file.as_fd()),
                SourceReader::Object { .. } => None,
            }))?;
        crate::source::dup_file(fd).ok().map(OwnedFd::from)
    }

    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<FileAttr> {
        if !self.online() {
            return self.offline_lookup(parent, name);
        }
        match self.lookup_online(parent, name) {
            Err(_) if !self.online() => self.offline_lookup(parent, name),
            r => r,
        }
    }

    fn lookup_online(&self, parent: u64, name: &OsStr) -> Result<FileAttr> {
        let dir = self.inode(parent)?;
        let dir_path = dir.path().ok_or(Errno::ENOENT)?;
        // Watch first: a change between our stat and the watch would go unseen.
        self.coherence
            .watch_dir(parent, || self.source.dir(&dir_path).ok());
        let path = child(&dir_path, name)?;
        let mut st = self.source.stat(&path).map_err(errno)?;
        let inode = self.inodes.lookup(parent, &path, &st);
        self.pending_attr(inode.id, &mut st);
        Ok(attr_of(inode.id, &st))
    }

    pub fn forget(&self, id: u64, n: u64) {
        self.inodes.forget(id, n);
    }

    /// Sets a new object's owner to the caller's, following the setgid-directory rule.
    fn own_new(&self, path: &Path, parent: &Path, uid: u32, gid: u32) -> Result<()> {
        if !rustix::process::geteuid().is_root() {
            return Ok(());
        }
        let pst = self.source.stat(parent).map_err(errno)?;
        let gid = if pst.mode & libc::S_ISGID != 0 {
            None
        } else {
            Some(gid)
        };
        self.source.chown_new(path, uid, gid).map_err(errno)
    }

    fn entry_after_create(&self, parent: u64, path: &Path) -> Result<FileAttr> {
        self.listing_changed(path.parent().unwrap_or(Path::new("")));
        let st = self.source.stat(path).map_err(errno)?;
        let inode = self.inodes.lookup(parent, path, &st);
        Ok(attr_of(inode.id, &st))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn mknod(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        rdev: u32,
        uid: u32,
        gid: u32,
    ) -> Result<FileAttr> {
        self.changes_allowed()?;
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        self.source.mknod(&path, mode, rdev as u64).map_err(errno)?;
        self.finish_create(parent, &path, &dir, mode, uid, gid)
    }

    /// Gives a new object to the caller; `chown` by root clears set-id bits, so they are
    /// put back afterwards.
    #[allow(clippy::too_many_arguments)]
    fn finish_create(
        &self,
        parent: u64,
        path: &Path,
        dir: &Path,
        mode: u32,
        uid: u32,
        gid: u32,
    ) -> Result<FileAttr> {
        if let Err(e) = self.own_new(path, dir, uid, gid) {
            let _ = self.source.unlink(path);
            return Err(e);
        }
        if mode & (libc::S_ISUID | libc::S_ISGID) != 0 && mode & libc::S_IFMT != libc::S_IFLNK {
            let set = SetAttr {
                mode: Some(mode & 0o7777),
                ..Default::default()
            };
            self.source
                .set_attr(Some(path), None, &set)
                .map_err(errno)?;
        }
        self.entry_after_create(parent, path)
    }

    pub fn mkdir(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        uid: u32,
        gid: u32,
    ) -> Result<FileAttr> {
        if self.offline_change()? {
            return self.offline_mkdir(parent, name, mode, uid, gid);
        }
        if self.source.is_object() {
            return self.object_mkdir(parent, name, mode, uid, gid);
        }
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        self.source.mkdir(&path, mode).map_err(errno)?;
        if let Err(e) = self.own_new(&path, &dir, uid, gid) {
            let _ = self.source.rmdir(&path);
            return Err(e);
        }
        self.entry_after_create(parent, &path)
    }

    pub fn symlink(
        &self,
        parent: u64,
        name: &OsStr,
        target: &Path,
        uid: u32,
        gid: u32,
    ) -> Result<FileAttr> {
        self.changes_allowed()?;
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        self.source.symlink(target, &path).map_err(errno)?;
        if let Err(e) = self.own_new(&path, &dir, uid, gid) {
            let _ = self.source.unlink(&path);
            return Err(e);
        }
        self.entry_after_create(parent, &path)
    }

    pub fn readlink(&self, id: u64) -> Result<Vec<u8>> {
        if !self.online() {
            return self.offline_readlink(&*self.inode(id)?);
        }
        match self.source.readlink(&self.path_of(id)?) {
            Err(_) if !self.online() => self.offline_readlink(&*self.inode(id)?),
            r => r.map_err(errno),
        }
    }

    pub fn unlink(&self, parent: u64, name: &OsStr) -> Result<()> {
        if self.offline_change()? {
            return self.offline_unlink(parent, name);
        }
        let path = child(&self.path_of(parent)?, name)?;
        let before = self.source.stat(&path).map_err(errno)?;
        let inode = self.find_inode(&path, &before);
        let uploads_held = self.hold_uploads(inode.as_deref());
        self.source.unlink(&path).map_err(errno)?;
        if let Some(inode) = &inode {
            inode.remove_name(&path);
        }
        drop(uploads_held);
        self.listing_changed(path.parent().unwrap_or(Path::new("")));
        if let Some(inode) = inode
            && before.nlink <= 1
        {
            self.inodes.unlinked(&inode);
            if let Some(state) = inode.file().as_mut() {
                state.unlinked = Some(Stat { nlink: 0, ..before });
            }
        }
        if let Err(e) = self.uncache(&path) {
            tracing::warn!(?path, "cannot drop cache entry: {e}");
        }
        Ok(())
    }

    fn find_inode(&self, path: &Path, st: &Stat) -> Option<Arc<Inode>> {
        self.inodes.find(path, st)
    }

    /// On an object store an open writer uploads under the file's current name (flush,
    /// fsync, release; a `fork` elsewhere can send a flush at any time). Holding its state
    /// across a delete or rename and the change of its name keeps such an upload from
    /// landing under the old name after the store's change, which would bring it back.
    fn hold_uploads<'a>(
        &self,
        inode: Option<&'a Inode>,
    ) -> Option<MutexGuard<'a, Option<FileState>>> {
        inode.filter(|_| self.source.is_object()).map(|i| i.file())
    }

    pub fn rmdir(&self, parent: u64, name: &OsStr) -> Result<()> {
        if self.offline_change()? {
            return self.offline_rmdir(parent, name);
        }
        let path = child(&self.path_of(parent)?, name)?;
        let before = self.source.stat(&path).ok();
        self.source.rmdir(&path).map_err(errno)?;
        self.listing_changed(path.parent().unwrap_or(Path::new("")));
        self.listing_changed(&path);
        if let Some(inode) = before.and_then(|st| self.inodes.find(&path, &st)) {
            inode.remove_name(&path);
        }
        if let Err(e) = self.uncache(&path) {
            tracing::warn!(?path, "cannot drop cache entry: {e}");
        }
        Ok(())
    }

    pub fn rename(
        &self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
    ) -> Result<()> {
        if self.offline_change()? {
            return self.offline_rename(parent, name, newparent, newname, flags);
        }
        let _whole = self.renames.read().unwrap();
        let from = child(&self.path_of(parent)?, name)?;
        let to = child(&self.path_of(newparent)?, newname)?;
        let before = self.source.stat(&from).ok();
        // The renamed file's ctime moves: opens meanwhile must not call that a change.
        let _changing = (before.as_ref())
            .filter(|b| b.is_file())
            .and_then(|b| self.find_inode(&from, b))
            .map(|i| i.own_change());
        let inode = (before.as_ref())
            .filter(|_| self.source.is_object())
            .and_then(|b| self.find_inode(&from, b));
        let uploads_held = self.hold_uploads(inode.as_deref());
        self.source.rename(&from, &to, flags).map_err(errno)?;
        let exchange = flags & libc::RENAME_EXCHANGE != 0;
        self.inodes.renamed(&from, &to, exchange, parent, newparent);
        drop(uploads_held);
        for dir in [&from, &to] {
            self.listing_changed(dir.parent().unwrap_or(Path::new("")));
            self.listing_changed(dir);
        }
        self.cache.rename(&from, &to, flags);
        if exchange {
            self.cache_renamed(&[&from, &to]);
        } else {
            self.cache_renamed(&[&to]);
        }
        // rename changes the file's ctime: keep its cache record matching (our own change).
        if let Some(before) = before.filter(|b| b.is_file())
            && let Ok(after) = self.source.stat(&to)
        {
            self.own_change(&to, &before, &after, false);
        }
        Ok(())
    }

    pub fn link(&self, id: u64, newparent: u64, newname: &OsStr) -> Result<FileAttr> {
        self.changes_allowed()?;
        let from = self.path_of(id)?;
        let to = child(&self.path_of(newparent)?, newname)?;
        let before = self.source.stat(&from).map_err(errno)?;
        let _changing = self.inode(id)?.own_change();
        self.source.link(&from, &to).map_err(errno)?;
        self.listing_changed(from.parent().unwrap_or(Path::new("")));
        self.listing_changed(to.parent().unwrap_or(Path::new("")));
        let st = self.source.stat(&to).map_err(errno)?;
        if before.is_file() {
            self.own_change(&from, &before, &st, false);
        }
        let inode = self.inodes.lookup(newparent, &to, &st);
        // Keep using the old name while it exists: the cache entry lives under it.
        inode.set_path(&from);
        inode.set_path(&to);
        inode.set_path(&from);
        Ok(attr_of(inode.id, &st))
    }

    pub fn setattr(&self, id: u64, fh: Option<u64>, attr: SetAttr) -> Result<FileAttr> {
        let inode = self.inode(id)?;
        if self.offline_change()? {
            return self.offline_setattr(&inode, &attr);
        }
        if self.source.is_object() {
            return self.object_setattr(&inode, attr);
        }
        let path = inode.path();
        let handle = fh.and_then(|fh| self.handle(fh).ok());
        // The caller's open file when it gave one: its name may be gone.
        let src_fd = handle.as_ref().and_then(|h| h.source.as_ref());
        let stat_now = || match (src_fd, &path) {
            (Some(f), _) => self.source.fstat(f.as_fd()),
            (None, Some(p)) => self.source.stat(p),
            (None, None) => Err(io::Error::from_raw_os_error(libc::ENOENT)),
        };
        let before = stat_now().map_err(errno)?;
        if let Some(p) = &path {
            self.listing_changed(p.parent().unwrap_or(Path::new("")));
        }
        if let Some(size) = attr.size {
            if !before.is_file() {
                return Err(if before.is_dir() {
                    Errno::EISDIR
                } else {
                    Errno::EINVAL
                });
            }
            return self.truncate(&inode, path.as_deref(), src_fd, size, attr);
        }
        let _changing = inode.own_change();
        self.source
            .set_attr(path.as_deref(), src_fd.map(|f| f.as_fd()), &attr)
            .map_err(errno)?;
        let after = stat_now().map_err(errno)?;
        if let (true, Some(path)) = (after.is_file(), &path) {
            self.own_change(path, &before, &after, attr.mtime.is_some());
        }
        Ok(attr_of(id, &after))
    }

    /// A change made through the mount that moved ctime/mtime but not the data (chmod,
    /// utimens, rename, link): the cached data stays valid, so its identity follows.
    /// The cache renamed the data files now at `paths` (a rename moves a file's ctime):
    /// their loaded states take the new identities as hoardfs's own (`FileFetch::own`).
    fn cache_renamed(&self, paths: &[&Path]) {
        let renamed: Vec<Arc<Inode>> = (self.loaded.lock().unwrap().values())
            .filter(|i| {
                i.names
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|n| paths.contains(&n.as_path()))
            })
            .cloned()
            .collect();
        for inode in renamed {
            if let Some(state) = inode.file().as_ref() {
                state.noted();
            }
        }
    }

    /// `mtime_set`: the change set the mtime itself (utimens). Anything else that moved the
    /// size or the mtime between `before` and `after` was a write meanwhile (by a handle
    /// of another node of the file), whose bytes the cache does not hold: then the record
    /// is left to be found stale.
    fn own_change(&self, path: &Path, before: &Stat, after: &Stat, mtime_set: bool) {
        // (An object store's metadata change is a copy, which moves the mtime; its data
        // changes are this mount's own uploads.)
        let data_kept = |after: &Stat| {
            before.size == after.size
                && (mtime_set || before.mtime == after.mtime || self.source.is_object())
        };
        let inode = self.find_inode(path, after);
        if let Some(inode) = &inode {
            let mut guard = inode.file();
            if let Some(state) = guard.as_mut() {
                // `after` was taken before the lock: a write through this node since then
                // is newer than it. Under the lock the file is looked at again (its own
                // descriptor: cheap, under the source guard).
                let now = (state.path_fd.as_ref())
                    .and_then(|fd| self.source.fstat(fd.as_fd()).ok())
                    .filter(|now| (now.dev, now.ino) == (after.dev, after.ino))
                    .unwrap_or(*after);
                if (data_kept(&now) && state.record.identity.same_version(&self.identity(before)))
                    || state.written
                {
                    state.record.identity = self.recorded_identity(&now);
                    if !state.written {
                        state.persist_record(&self.env(), false);
                    }
                }
                return;
            }
        }
        // Not open: update the record on disk if it matched the old version.
        let Some(files) = self.cache.open_existing(path) else {
            return;
        };
        if let Ok(Some(Ok(mut rec))) = read_record(&files)
            && !rec.dirty
            && rec.identity.same_version(&self.identity(before))
            && data_kept(after)
        {
            rec.identity = self.recorded_identity(after);
            let _ = write_record(&files, &rec, false);
        }
    }

    fn truncate(
        &self,
        inode: &Arc<Inode>,
        path: Option<&Path>,
        fd: Option<&File>,
        size: u64,
        attr: SetAttr,
    ) -> Result<FileAttr> {
        let mut guard = inode.file();
        if let Some(state) = guard.as_mut() {
            state.fetch.invalidate();
            state.mark_written(&self.env());
        }
        let r = self.source.set_attr(path, fd.map(|f| f.as_fd()), &attr);
        let after = match (fd, path) {
            (Some(f), _) => self.source.fstat(f.as_fd()),
            (None, Some(path)) => self.source.stat(path),
            (None, None) => Err(io::Error::from_raw_os_error(libc::ENOENT)),
        };
        match guard.as_mut() {
            Some(state) => match (&r, &after) {
                (Ok(()), Ok(after)) => {
                    let ok = state
                        .files
                        .as_ref()
                        .map(|f| entry::counted(&self.usage, &f.data, || f.data.set_len(size)))
                        .transpose()
                        .is_ok();
                    state.noted();
                    if ok && after.size == size {
                        state.record.resize(size);
                        state.record.identity = self.recorded_identity(after);
                    } else {
                        state.drop_cached();
                    }
                }
                _ => state.drop_cached(),
            },
            None => {
                if let Some(Err(e)) = path.map(|p| self.uncache(p)) {
                    tracing::warn!(?path, "cannot drop cache entry: {e}");
                }
            }
        }
        r.map_err(errno)?;
        Ok(attr_of(inode.id, &after.map_err(errno)?))
    }

    pub fn statfs(&self) -> Result<libc::statvfs> {
        if !self.online() {
            return self.offline_statfs();
        }
        self.source.statvfs().map_err(errno)
    }

    // ---------------------------------------------------------------- xattrs

    pub fn getxattr(&self, id: u64, name: &OsStr, size: u32) -> Result<Vec<u8>> {
        if !self.online() {
            return Err(Errno::ENODATA); // extended attributes are not kept offline
        }
        let path = self.path_of(id)?;
        self.source
            .getxattr(&path, name, size as usize)
            .map_err(errno)
    }

    pub fn listxattr(&self, id: u64, size: u32) -> Result<Vec<u8>> {
        if !self.online() {
            return Ok(Vec::new());
        }
        let path = self.path_of(id)?;
        self.source.listxattr(&path, size as usize).map_err(errno)
    }

    pub fn setxattr(&self, id: u64, name: &OsStr, value: &[u8], flags: i32) -> Result<()> {
        self.changes_allowed()?;
        let path = self.path_of(id)?;
        let before = self.source.stat(&path).ok();
        self.source
            .setxattr(&path, name, value, flags)
            .map_err(errno)?;
        if let (Some(b), Ok(a)) = (before.filter(|b| b.is_file()), self.source.stat(&path)) {
            self.own_change(&path, &b, &a, false);
        }
        Ok(())
    }

    pub fn removexattr(&self, id: u64, name: &OsStr) -> Result<()> {
        self.changes_allowed()?;
        let path = self.path_of(id)?;
        let before = self.source.stat(&path).ok();
        self.source.removexattr(&path, name).map_err(errno)?;
        if let (Some(b), Ok(a)) = (before.filter(|b| b.is_file()), self.source.stat(&path)) {
            self.own_change(&path, &b, &a, false);
        }
        Ok(())
    }

    // ---------------------------------------------------------------- directories

    pub fn opendir(&self, id: u64) -> Result<u64> {
        let inode = self.inode(id)?;
        // As in `open`: the kernel looks the name up again.
        let path = inode.path().ok_or(Errno::ESTALE)?;
        let offline = |path: &Path| {
            let list = self.offline_dir_list(id, path)?;
            let fh = self.new_fh();
            self.dirs.lock().unwrap().insert(fh, Arc::new(list));
            Ok(fh)
        };
        if !self.online() {
            return offline(&path);
        }
        match self.opendir_online(id, &path) {
            Err(_) if !self.online() => offline(&path),
            r => r,
        }
    }

    fn opendir_online(&self, id: u64, path: &Path) -> Result<u64> {
        let list = self.list_dir_online(id, path)?;
        let fh = self.new_fh();
        self.dirs.lock().unwrap().insert(fh, Arc::new(list));
        Ok(fh)
    }

    /// Reads directory `id` at `path` from the source for an open directory handle.
    fn list_dir_online(&self, id: u64, path: &Path) -> Result<DirList> {
        let generation = self.namespace_generation();
        let path = path.to_path_buf();
        // Kept for fstat of the open directory once its name is gone.
        let fd = if self.source.is_object() {
            None
        } else {
            let fd = self
                .source
                .openat(
                    &path,
                    rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY,
                    0,
                )
                .map_err(errno)?;
            self.coherence.watch_dir(id, || {
                crate::source::dup_file(fd.as_fd()).ok().map(OwnedFd::from)
            });
            Some(fd)
        };
        let entries = self.source.read_dir(&path).map_err(errno)?;
        self.save_listing(&path, &entries);
        let mut list = Vec::with_capacity(entries.len() + 2);
        list.push(ListEntry {
            ino: id,
            kind: FileType::Directory,
            name: ".".into(),
        });
        list.push(ListEntry {
            ino: id,
            kind: FileType::Directory,
            name: "..".into(),
        });
        for e in entries {
            list.push(ListEntry {
                ino: e.ino,
                kind: if e.file_type == 0 {
                    FileType::RegularFile
                } else {
                    kind_of(e.file_type)
                },
                name: e.name,
            });
        }
        // The order its files will be read in by a walk (`fetch::DirPrefetch`).
        if self.fetcher.tun.dir_prefetch.load(Ordering::Relaxed) > 0 {
            let files = list.iter().filter(|e| e.kind == FileType::RegularFile);
            self.fetcher
                .dirs
                .listed(&path, files.map(|e| e.name.clone()));
        }
        Ok(DirList {
            dir_id: id,
            path,
            fd,
            entries: list,
            generation,
        })
    }

    /// Attributes for a readdirplus batch. Each entry returned with `Some` counts as one
    /// kernel lookup of it (the caller must `forget` entries it could not send); `.` and
    /// `..` do not count, as the kernel does not link them.
    pub fn readdirplus_attrs(
        &self,
        list: &DirList,
        from: usize,
        max: usize,
    ) -> Vec<Option<FileAttr>> {
        if !self.online() {
            return self.offline_readdirplus_attrs(list, from, max);
        }
        let batch: Vec<&ListEntry> = list.entries.iter().skip(from).take(max).collect();
        let names: Vec<&OsStr> = batch.iter().map(|e| e.name.as_os_str()).collect();
        let Ok(stats) = self.source.stat_children(&list.path, &names) else {
            return vec![None; batch.len()];
        };
        batch
            .iter()
            .zip(stats)
            .map(|(e, st)| {
                let st = st.ok()?;
                if e.name == "." || e.name == ".." {
                    return Some(attr_of(list.dir_id, &st));
                }
                let path = child(&list.path, &e.name).ok()?;
                let inode = self.inodes.lookup(list.dir_id, &path, &st);
                Some(attr_of(inode.id, &st))
            })
            .collect()
    }

    /// The listing an open directory handle serves from `offset`. A listing that begins
    /// (offset 0) after a change of the namespace through the mount, or one the watcher
    /// reported, is read again: the kernel caches what a handle serves from offset 0 as the
    /// directory's listing for its current version, which includes that change, so a
    /// handle opened before the change must not serve its older listing then.
    pub fn dir_entries(&self, fh: u64, offset: u64) -> Result<Arc<DirList>> {
        let list = self
            .dirs
            .lock()
            .unwrap()
            .get(&fh)
            .cloned()
            .ok_or(Errno::EBADF)?;
        if offset != 0 || list.generation == self.namespace_generation() || !self.online() {
            return Ok(list);
        }
        match self.list_dir_online(list.dir_id, &list.path) {
            Ok(fresh) => {
                let fresh = Arc::new(fresh);
                self.dirs.lock().unwrap().insert(fh, fresh.clone());
                Ok(fresh)
            }
            Err(_) => Ok(list),
        }
    }

    pub fn releasedir(&self, fh: u64) {
        self.dirs.lock().unwrap().remove(&fh);
    }

    // ---------------------------------------------------------------- open files

    pub fn create(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
        uid: u32,
        gid: u32,
    ) -> Result<(FileAttr, Opened)> {
        if self.offline_change()? {
            return self.offline_create(parent, name, mode, flags, uid, gid);
        }
        if self.source.is_object() {
            return self.object_create(parent, name, mode, flags, uid, gid);
        }
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        // Exclusive first, so that we know we made it and may give it to the caller; a file
        // that appeared on the source meanwhile is opened as it is unless O_EXCL was asked.
        let (file, attr) =
            match self
                .source
                .create_file(&path, Self::source_flags(flags) | libc::O_EXCL, mode)
            {
                Ok(file) => {
                    let attr = self.finish_create(parent, &path, &dir, mode, uid, gid)?;
                    (file, attr)
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) && flags & libc::O_EXCL == 0 => {
                    let file = self
                        .source
                        .open_file(&path, Self::source_flags(flags) | (flags & libc::O_TRUNC))
                        .map_err(errno)?;
                    (file, self.entry_after_create(parent, &path)?)
                }
                Err(e) => return Err(errno(e)),
            };
        let inode = self.inode(attr.ino.0)?;
        let mut st = self.source.fstat(file.as_fd()).map_err(errno)?;
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        // A new file is fully known: cache it empty and complete.
        {
            let mut guard = inode.file();
            if guard.is_none() {
                let (mut state, _) = self.load_state(&inode, &path, &mut st, true);
                state.path_fd = crate::source::dup_file(file.as_fd())
                    .ok()
                    .map(OwnedFd::from);
                *guard = Some(state);
            }
            let state = guard.as_mut().unwrap();
            state.daemon_opens += 1;
            state.writers += u32::from(writable);
        }
        let fh = self.new_fh();
        self.handles.lock().unwrap().insert(
            fh,
            Arc::new(Handle {
                inode,
                source: Some(file),
                writable,
                passthrough: None,
                fetch: HandleFetch::default(),
                writes: Writes::Through,
            }),
        );
        Ok((
            attr,
            Opened {
                fh,
                flags: FopenFlags::empty(),
                backing: None,
            },
        ))
    }

    /// Flags for opening the source: the caller's access mode and sync flags. Offsets come
    /// from the kernel, so O_APPEND is not passed; O_TRUNC arrives as a setattr.
    fn source_flags(flags: i32) -> i32 {
        flags & (libc::O_ACCMODE | libc::O_SYNC | libc::O_DSYNC)
    }

    /// Opens a regular file for process `pid`. `make_backing` registers a cache file for
    /// passthrough.
    pub fn open(
        &self,
        id: u64,
        flags: i32,
        pid: u32,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Result<Opened> {
        // The kernel retries an open that failed with ESTALE once, at once, after looking
        // the name up again (`do_filp_open`), and the thread waits in that one syscall
        // meanwhile: when this thread's previous open answered ESTALE moments ago, this is
        // its retry. Every open takes the mark, so none outlives the retry it stands for.
        let first_estale = {
            let mut told = self.estale_told.lock().unwrap();
            told.retain(|_, at| at.elapsed() < ESTALE_RETRY);
            told.remove(&pid)
        };
        let r = self.open_node(id, flags, first_estale, make_backing);
        if first_estale.is_none() && matches!(r, Err(e) if e == Errno::ESTALE) {
            self.estale_told.lock().unwrap().insert(pid, Instant::now());
        }
        r
    }

    /// `open`; `first_estale`: when this thread's previous open, of which this one is the
    /// kernel's retry, answered ESTALE.
    fn open_node(
        &self,
        id: u64,
        flags: i32,
        first_estale: Option<Instant>,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Result<Opened> {
        let inode = self.inode(id)?;
        if inode.is_retired() {
            return self.open_retired(&inode, flags, first_estale, make_backing);
        }
        // No name leads here any more (unlinked, or another file took the name): the
        // kernel's dentry is stale, and on ESTALE it looks the name up again.
        let path = inode.path().ok_or(Errno::ESTALE)?;
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        let offline = || {
            if writable || flags & libc::O_TRUNC != 0 {
                return self.offline_open_write(&inode, &path, flags);
            }
            let mut guard = inode.file();
            if guard.is_none() {
                *guard = Some(self.offline_state(&inode, &path));
            }
            self.finish_open(&inode, guard, false, None, true, make_backing)
        };
        if !self.online() {
            return offline();
        }
        match self.open_online(&inode, &path, flags, make_backing) {
            Err(_) if !self.online() => offline(),
            r => r,
        }
    }

    /// An open of a retired node: an old version, kept for the handles open on it. The
    /// kernel looks the name up again on ESTALE and retries the open once, which then
    /// reaches the new entry. When the retry finds a retired node again (the file was
    /// replaced again meanwhile), failing would make an open of a name that always existed
    /// fail; it gets the version this node holds instead, whole, if an open saw that
    /// version current after this open's first try began: it was then the file's at an
    /// instant of this open. Retirement itself says nothing of when the source changed
    /// (without a watcher a change is found only by the next open), so a version last seen
    /// before the first try is never served, nor is a node reached with no lookup, as
    /// through `/proc/self/fd`.
    fn open_retired(
        &self,
        inode: &Arc<Inode>,
        flags: i32,
        first_estale: Option<Instant>,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Result<Opened> {
        let guard = inode.file();
        let during = match (first_estale, guard.as_ref().and_then(|s| s.confirmed)) {
            (Some(first), Some(confirmed)) => confirmed >= first,
            _ => false,
        };
        let whole = guard
            .as_ref()
            .is_some_and(|s| s.complete() && s.files.is_some());
        if !during
            || !whole
            || flags & libc::O_ACCMODE != libc::O_RDONLY
            || flags & libc::O_TRUNC != 0
        {
            return Err(Errno::ESTALE);
        }
        Stats::add(&self.stats.cache.retired_opens, 1);
        self.finish_open(inode, guard, false, None, true, make_backing)
    }

    /// `path` no longer leads to `inode`'s file: the node stops answering to it, and the
    /// kernel forgets its entry for it.
    fn drop_stale_name(&self, inode: &Inode, path: &Path) {
        let parent = inode.parent();
        inode.remove_name(path);
        if let Some(name) = path.file_name() {
            self.coherence
                .notify(Notice::Entry(parent, name.to_os_string()));
        }
    }

    fn open_online(
        &self,
        inode: &Arc<Inode>,
        path: &Path,
        flags: i32,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Result<Opened> {
        let (inode, path) = (inode.clone(), path.to_path_buf());
        let id = inode.id;
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        self.ensure_listed(path.parent().unwrap_or(Path::new("")));
        // Just before the look at the source: the version it shows was current then.
        let mut looked_at = Instant::now();
        let looked = if self.source.is_object() {
            self.source.stat(&path).map(|st| (None, st))
        } else {
            self.source
                .openat(&path, rustix::fs::OFlags::PATH, 0)
                .and_then(|fd| {
                    let st = self.source.fstat(fd.as_fd())?;
                    Ok((Some(fd), st))
                })
        };
        let (path_fd, st) = match looked {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                // The name this node knows the file by is gone, while the kernel reached
                // the node by a name it still holds: a listing read just before a rename
                // behind the mount can name the node last by the name renamed away. On
                // ESTALE the kernel looks its name up again, which names the node rightly
                // (or answers ENOENT if the file is gone).
                self.drop_stale_name(&inode, &path);
                return Err(Errno::ESTALE);
            }
            r => r.map_err(errno)?,
        };
        if self.stable_ino && (st.dev, st.ino) != inode.key {
            // Another file has the name now (renamed over it behind the mount, and no
            // watcher told the kernel yet). This node stays with the file it was looked up
            // as, whose open handles keep reading it; the kernel looks the name up again on
            // ESTALE and opens the node of the file the name leads to now.
            self.drop_stale_name(&inode, &path);
            return Err(Errno::ESTALE);
        }
        if !st.is_file() {
            return Err(Errno::EINVAL);
        }
        let mut st = st;
        let mut guard = inode.file();
        // The stat was taken before the lock: a change made through the mount meanwhile
        // (another handle's write, recorded under the lock) makes the record newer than
        // it. Only a source that holds still while looked at again has really changed.
        // An own change that moves only the ctime (a rename) is waited for, briefly.
        let look_again = || match &path_fd {
            Some(fd) => self.source.fstat(fd.as_fd()),
            None => self.source.stat(&path),
        };
        let mut tries = 0;
        // (A file not open is looked at again by `load_state`, on a mismatch only.)
        while let Some(state) = guard.as_ref() {
            let differs =
                self.stale_check() && !state.written && state.record.identity != self.identity(&st);
            tries += 1;
            if !differs || tries > OWN_CHANGE_TRIES {
                break;
            }
            let changing = inode.is_changing();
            drop(guard);
            if changing {
                std::thread::sleep(Duration::from_millis(1));
            }
            let before_again = Instant::now();
            let again = look_again().map_err(errno)?;
            looked_at = before_again;
            guard = inode.file();
            if !changing && self.identity(&again) == self.identity(&st) {
                break;
            }
            st = again;
        }
        let mut keep_cache = true;
        let seen = self.identity(&st);
        match guard.as_mut() {
            None => {
                let (mut state, reset) = self.load_state(&inode, &path, &mut st, false);
                state.path_fd = path_fd;
                keep_cache = !reset;
                if reset {
                    inode.content_changed();
                }
                *guard = Some(state);
            }
            Some(state) => {
                // Loaded by the directory prefetch, which keeps no `O_PATH` descriptor.
                if state.path_fd.is_none() {
                    state.path_fd = path_fd;
                }
                // Loaded but closed (waiting for its group commit, or for fetches): as at
                // a load, the data file is first checked to be as hoardfs left it.
                if state.daemon_opens + state.passthrough_opens + state.opening == 0
                    && !state.data_is_ours()
                {
                    state.discard_foreign_data(&self.env());
                    inode.content_changed();
                    keep_cache = false;
                }
                if self.stale_check()
                    && !state.written
                    && state.record.identity != self.identity(&st)
                    && !self.settle_racy(&path, state, &st)
                {
                    // Changed behind the mount while open, before the watcher or a lease
                    // acted on it.
                    let c = &self.coherence.counters;
                    c.changes_detected.fetch_add(1, Ordering::Relaxed);
                    if self.keep_version(&inode, state, &st) {
                        // The handles open on this node keep their version; the kernel
                        // retries the open on the name's new node.
                        return Err(Errno::ESTALE);
                    }
                    self.stale(state, &st, Some(&path));
                    inode.content_changed();
                    keep_cache = false;
                }
            }
        }
        // The state's version was the file's at `looked_at` (unless `load_state` looked
        // again and found another).
        if let Some(state) = guard.as_mut()
            && self.identity(&st) == seen
            && state.record.identity == seen
        {
            state.confirmed = Some(looked_at);
        }
        // Also after a reset at load: the kernel may hold pages from an earlier open, and
        // only a returned notice lets later opens keep pages again (`kernel_pages_current`).
        if !keep_cache {
            self.coherence.notify(Notice::Inode(id));
        }
        let was_complete = guard.as_ref().unwrap().complete() && keep_cache;
        if flags & libc::O_ACCMODE == libc::O_RDONLY {
            // Fetch the next files of its directory ahead of a reader going through them.
            self.dir_prefetch_open(&inode, &path, !was_complete);
        }

        if writable {
            // The kernel refuses a non-passthrough open while passthrough opens exist, and
            // passthrough writes would bypass the source. Wait for releases in flight.
            let deadline = Instant::now() + PASSTHROUGH_RELEASE_WAIT;
            while guard.as_ref().unwrap().passthrough_opens > 0 {
                if Instant::now() > deadline {
                    self.release_if_unused(&inode, &mut guard);
                    return Err(Errno::ETXTBSY);
                }
                drop(guard);
                std::thread::sleep(Duration::from_millis(2));
                guard = inode.file();
                if guard.is_none() {
                    let (state, _) = self.load_state(&inode, &path, &mut st, false);
                    *guard = Some(state);
                }
            }
        }
        let state = guard.as_mut().unwrap();
        if writable && self.source.is_object() {
            if let Err(e) = self.object_prepare_write(state, &path, flags) {
                self.release_if_unused(&inode, &mut guard);
                return Err(e);
            }
            state.daemon_opens += 1;
            drop(guard);
            return Ok(self.cache_write_handle(&inode, Writes::Uploaded));
        }

        if !state.complete() && state.fetch_src.is_none() {
            state.fetch_src = self
                .fetcher
                .open_source(|| self.open_fetch_reader(&path, &state.record.identity));
        }
        // A reader of a partially cached file reads through the fetch descriptor: one open
        // on the source, not two (each is a round trip on a network source).
        let source = if writable || (!state.complete() && state.fetch_src.is_none()) {
            let opened = self.source.open_file(&path, Self::source_flags(flags));
            // A reader's bytes must all be of the version this open validated: a name that
            // leads to another version by now (renamed over, rewritten since the stat)
            // makes the kernel retry the open.
            let opened = opened.and_then(|f| {
                let raced = !writable
                    && self.stale_check()
                    && !self.source.is_object()
                    && self.identity(&fstat(f.as_fd())?) != self.identity(&st);
                if raced {
                    return Err(io::Error::from_raw_os_error(libc::ESTALE));
                }
                Ok(f)
            });
            match opened {
                Ok(f) => Some(f),
                Err(e) => {
                    self.release_if_unused(&inode, &mut guard);
                    return Err(errno(e));
                }
            }
        } else {
            None
        };
        // Small files are fetched whole on first open (xCachefs' threshold; `fs/fetch.rs`),
        // so that this open can already be a passthrough one. While passthrough opens exist
        // the kernel takes only another passthrough open: fetched under the mutex then.
        let readable = flags & libc::O_ACCMODE != libc::O_WRONLY;
        if readable
            && state.files.is_some()
            && !state.record.is_complete()
            && state.record.identity.size <= self.cfg.whole_file_threshold
        {
            if state.passthrough_opens > 0 {
                self.fetch_all(state);
            } else if let Some(whole) = self.start_whole_fetch(&inode, state) {
                // Fetched by the workers and by this open, without the state mutex: other
                // openers join the same flights, readers of other handles proceed. The
                // state stays loaded meanwhile (`opening`).
                state.opening += 1;
                drop(guard);
                self.finish_whole_fetch(&inode, &whole);
                guard = inode.file();
                guard.as_mut().unwrap().opening -= 1;
            }
        }
        if was_complete {
            Stats::add(&self.stats.cache.open_hits, 1);
        } else {
            Stats::add(&self.stats.cache.open_misses, 1);
        }

        // A new version's notice may still be on its way to the kernel: until it has
        // been delivered, the kernel's pages may be of the old version.
        let keep_cache = keep_cache && inode.kernel_pages_current();
        self.finish_open(&inode, guard, writable, source, keep_cache, make_backing)
    }

    /// Answers an open whose cache state is loaded: passthrough when the file is whole in
    /// the cache and nobody has it open through the daemon, else served by the daemon.
    fn finish_open(
        &self,
        inode: &Arc<Inode>,
        mut guard: std::sync::MutexGuard<'_, Option<FileState>>,
        writable: bool,
        source: Option<File>,
        keep_cache: bool,
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Result<Opened> {
        let id = inode.id;
        let state = guard.as_mut().unwrap();
        let mut backing = None;
        if !writable && state.complete() && state.daemon_opens == 0 && self.passthrough_enabled() {
            let existing = state.backing.upgrade();
            let b = match existing {
                Some(b) => Some(b),
                None => match make_backing(&state.files.as_ref().unwrap().data) {
                    Ok(b) => {
                        let b = Arc::new(b);
                        state.backing = Arc::downgrade(&b);
                        Some(b)
                    }
                    Err(e) => {
                        tracing::warn!(
                            "passthrough unavailable ({e}); reads go through the daemon"
                        );
                        self.disable_passthrough();
                        None
                    }
                },
            };
            backing = b;
        }
        let fopen = if backing.is_some() {
            state.passthrough_opens += 1;
            Stats::add(&self.stats.cache.passthrough_opens, 1);
            FopenFlags::FOPEN_PASSTHROUGH
        } else {
            state.daemon_opens += 1;
            state.writers += u32::from(writable);
            if keep_cache {
                FopenFlags::FOPEN_KEEP_CACHE
            } else {
                FopenFlags::empty()
            }
        };
        drop(guard);
        let fh = self.new_fh();
        self.handles.lock().unwrap().insert(
            fh,
            Arc::new(Handle {
                inode: inode.clone(),
                source,
                writable,
                passthrough: backing.clone(),
                fetch: HandleFetch::default(),
                writes: Writes::Through,
            }),
        );
        self.grant_lease(id);
        Ok(Opened {
            fh,
            flags: fopen,
            backing,
        })
    }

    /// Drops a state that no handle uses (after a failed open).
    fn release_if_unused(&self, inode: &Inode, guard: &mut Option<FileState>) {
        self.unload_if_idle(inode, guard);
    }

    /// Drops the cache state of a file nobody has open any more.
    fn unload(&self, inode: &Inode, guard: &mut Option<FileState>) {
        if let Some(state) = guard.as_ref() {
            state.fetch.kill();
        }
        *guard = None;
        inode.former.lock().unwrap().clear();
        self.loaded.lock().unwrap().remove(&inode.id);
    }

    /// A state with nothing cached and no descriptors.
    fn empty_state(&self, identity: SourceIdentity) -> FileState {
        FileState::new(CacheRecord::empty(identity, self.cfg.chunk_size))
    }

    /// Loads the cache state of `path` from its record, checking it against `st`. Returns
    /// the state and whether cached data was discarded. With `new_file`, the file was
    /// just created by us and any old cache entry under its name is dropped.
    fn load_state(
        &self,
        inode: &Arc<Inode>,
        path: &Path,
        st: &mut Stat,
        new_file: bool,
    ) -> (FileState, bool) {
        let _no_eviction = self.evict_lock.read().unwrap();
        self.loaded.lock().unwrap().insert(inode.id, inode.clone());
        let mut identity = self.identity(st);
        let mut state = self.empty_state(identity);
        let files = match self.cache.open_files(path) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(?path, "cache unusable for this file: {e}");
                Stats::add(&self.stats.cache.cache_errors, 1);
                return (state, true);
            }
        };
        let data_len = files.data.metadata().map(|m| m.len()).ok();
        let mut reset = true;
        // Without a record nothing of this file can be served after a crash, so its first
        // empty record need not be durable (one fsync less per newly cached file).
        let mut had_record = true;
        match read_record(&files) {
            Ok(Some(Ok(mut rec))) if !new_file => {
                // `st` was taken before the caller's lock: a writer that closed since then
                // left a record of a newer version. Looked at again (only on a mismatch).
                if !rec.dirty
                    && rec.identity != identity
                    && let Ok(now) = self.source.stat(path)
                    && (now.dev, now.ino) == (st.dev, st.ino)
                {
                    *st = now;
                    identity = self.identity(st);
                }
                let matches = !rec.dirty
                    && data_len == Some(rec.identity.size)
                    && (rec.identity == identity
                        || !self.stale_check()
                        || self.racy_record_still_holds(path, &files, &mut rec, st));
                if matches {
                    state.record = rec;
                    reset = false;
                } else {
                    Stats::add(&self.stats.cache.stale_invalidations, 1);
                }
            }
            Ok(Some(Err(crate::cache::record::RecordError::OtherDataFile))) => {
                // The entry is being refilled by another open of an older or newer version
                // (a file replaced behind the mount), not damaged: discarded quietly.
                tracing::debug!(?path, "cache record of another data file");
                Stats::add(&self.stats.cache.stale_invalidations, 1);
            }
            Ok(Some(Err(crate::cache::record::RecordError::DataChanged)))
                if crate::cache::store::read_record_unchecked(&files.meta)
                    .is_ok_and(|r| matches!(r, Some(Ok(r)) if r.present_count() == 0)) =>
            {
                // A record that claims nothing: its data file is being fetched into by
                // another open of an older or newer version, not damaged.
                tracing::debug!(?path, "empty cache record of a changed data file");
                Stats::add(&self.stats.cache.stale_invalidations, 1);
            }
            Ok(Some(Err(e))) => {
                tracing::warn!(?path, "discarding cache record: {e}");
                Stats::add(&self.stats.cache.corrupt_records, 1);
            }
            Ok(None) => {
                had_record = false;
                self.usage.file_added();
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(?path, "cannot read cache record: {e}");
                Stats::add(&self.stats.cache.cache_errors, 1);
            }
        }
        state.fetch = Arc::new(FileFetch::new(files.data.try_clone().ok()));
        state.files = Some(files);
        if reset {
            // A file just created included: with no record before it, no crash can pair
            // its data file with a record that claims bytes (a later write marks the
            // record dirty durably, `mark_written`).
            state.reset_as(
                &self.env(),
                self.recorded_identity(st),
                had_record,
                Some(path),
            );
        } else {
            // As read_record found it: what the record vouches for.
            state.fetch.set_own(Some(state.record.data));
        }
        state.record.last_used = now_millis();
        (state, reset)
    }

    /// The source changed behind the mount while the file was open (and its handles
    /// cannot keep their version, `keep_version`): the cache follows the new version.
    fn stale(&self, state: &mut FileState, st: &Stat, path: Option<&Path>) {
        Stats::add(&self.stats.cache.stale_invalidations, 1);
        self.reset(state, st, path);
    }

    /// Empties the cache of a file for a new source version. The record is rewritten
    /// first (durably), so no crash can pair old bytes with the new version.
    fn reset(&self, state: &mut FileState, st: &Stat, path: Option<&Path>) {
        state.reset_as(&self.env(), self.recorded_identity(st), true, path);
    }

    /// The name of `inode` if it still leads to the inode's own source file: its cache entry
    /// is this file's. A name that leads to another file now (replaced behind the mount)
    /// has that file's cache entry, which this inode must not touch.
    fn own_path(&self, inode: &Inode) -> Option<PathBuf> {
        let path = inode.path()?;
        let st = self.source.stat(&path).ok()?;
        ((st.dev, st.ino) == inode.key || !self.stable_ino).then_some(path)
    }

    /// The source changed behind the mount while `inode` is open with its whole old version
    /// in the cache: the open handles keep that version (the session semantics of AFS and
    /// Coda), and the name gets a new entry for everything else. On disk the cache entry
    /// passes to the new version (an empty record and a new data file), while this state
    /// keeps the old data file through its descriptor and writes its record where nobody
    /// reads it. The inode is retired: lookups make a new one (a new kernel node, whose
    /// opens may use passthrough to the new data file: the kernel allows one backing file
    /// per node), and the kernel is asked to drop the name. Returns false, changing nothing,
    /// where the handles cannot keep their version (it is not whole in the cache, or writes
    /// through the mount are under way); the caller then resets the cache in place.
    fn keep_version(&self, inode: &Arc<Inode>, state: &mut FileState, st: &Stat) -> bool {
        let opens = state.daemon_opens + state.passthrough_opens;
        if opens == 0
            || state.writers > 0
            || !state.complete()
            || state.written
            || state.record.dirty
            || state.offline_base.is_some()
        {
            return false;
        }
        let Some(files) = state.files.as_mut() else {
            return false;
        };
        let scratch = match crate::cache::store::scratch_file() {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!("cannot keep an old version apart: {e}");
                return false;
            }
        };
        // From here on nothing this state writes reaches the entry's record.
        let meta = std::mem::replace(&mut files.meta, scratch);
        let path = self.own_path(inode);
        if let Some(path) = &path {
            let rec = CacheRecord::empty(self.recorded_identity(st), self.cfg.chunk_size);
            let moved = files.data.try_clone().and_then(|data| {
                let mut entry = CacheFiles { data, meta };
                entry::fresh_data(&self.env(), &mut entry, &rec, true, Some(path), true)
            });
            if let Err(e) = moved {
                // The old data file may still be the entry's: drop the entry (record
                // first), so that nothing ever writes to the file the old handles read.
                tracing::warn!(?path, "cannot cache the new version apart: {e}");
                Stats::add(&self.stats.cache.cache_errors, 1);
                if let Err(e) = self.cache.remove(path) {
                    tracing::warn!(?path, "cannot drop cache entry: {e}");
                }
            }
        }
        // Replaced by our rename: the old file's ctime moved with its link count.
        state.noted();
        inode.retire();
        Stats::add(&self.stats.cache.versions_kept, 1);
        if let Some(name) = path.as_deref().and_then(Path::file_name) {
            self.coherence
                .notify(Notice::Entry(inode.parent(), name.to_os_string()));
        }
        true
    }

    /// Removes whatever the cache holds for `rel` (`CacheStore::remove`), counting what
    /// that frees.
    fn uncache(&self, rel: &Path) -> io::Result<()> {
        let file = self.cache.has_record(rel);
        let bytes = self.cache.data_bytes(rel);
        self.cache.remove(rel)?;
        self.usage.sub(bytes);
        if file {
            self.usage.file_removed();
        }
        Ok(())
    }

    /// Fetches chunk `c` from the source into the cache file.
    fn fetch_chunk(&self, state: &mut FileState, c: u64) -> io::Result<()> {
        let cs = state.record.chunk_size;
        let size = state.record.identity.size;
        let off = c * cs;
        let len = cs.min(size - off) as usize;
        if !self.usage.may_grow(len as u64) {
            // The cache is full until the cleaner catches up: serve from the source.
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        let src = state
            .fetch_src
            .as_ref()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EIO))?;
        let buf = self.source.read_at(&src.reader, len, off)?;
        let n = buf.len();
        Stats::add(&self.stats.cache.bytes_from_source, n as u64);
        if n < len {
            // The source is shorter than the version we cache: it changed under us.
            return Err(io::Error::from_raw_os_error(libc::ESTALE));
        }
        let files = state
            .files
            .as_ref()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EIO))?;
        let w = files.data.write_all_at(&buf, off);
        state.fetch.note_written(&files.data);
        w?;
        self.usage.add(len as u64);
        state.filled(c);
        Stats::add(&self.stats.cache.chunks_fetched, 1);
        if state.unsynced >= self.cfg.checkpoint_chunks || state.record.is_complete() {
            state.checkpoint(&self.env());
        }
        Ok(())
    }

    fn fetch_all(&self, state: &mut FileState) {
        for c in 0..state.record.nchunks() {
            if state.files.is_none() {
                return;
            }
            if !state.record.is_present(c)
                && let Err(e) = self.fetch_chunk(state, c)
            {
                tracing::debug!("whole-file fetch stopped: {e}");
                return;
            }
        }
    }

    /// Writes `data` through to the source at `offset`, then to the cache file. With
    /// `kill_suidgid` (the writer lacks `CAP_FSETID`; the kernel leaves this to us under
    /// `FUSE_HANDLE_KILLPRIV_V2`) a set-user-ID bit, and a set-group-ID bit with group
    /// execute, are cleared as a local write would clear them: the daemon writes as root,
    /// for whom the source's kernel keeps them.
    pub fn write(&self, fh: u64, offset: u64, data: &[u8], kill_suidgid: bool) -> Result<u32> {
        let h = self.handle(fh)?;
        if h.writes_to_cache() {
            return self.offline_write(&h, offset, data);
        }
        self.changes_allowed()?;
        let src = h
            .source
            .as_ref()
            .filter(|_| h.writable)
            .ok_or(Errno::EBADF)?;
        let mut guard = h.inode.file();
        let state = guard.as_mut().ok_or(Errno::EBADF)?;
        // Fetches in flight read the source before this write: none may land after it.
        state.fetch.invalidate();
        state.mark_written(&self.env());
        let owned = data.to_vec();
        let written = self
            .source
            .with_fd(src.as_fd(), move |f| f.write_all_at(&owned, offset));
        if let Err(e) = written {
            // Part of the range may have reached the source: forget what we knew of it.
            state.drop_cached();
            return Err(errno(e));
        }
        Stats::add(&self.stats.cache.bytes_written, data.len() as u64);
        let mut after = self.source.fstat(src.as_fd()).map_err(errno)?;
        let privs = set_id_bits(after.mode);
        if kill_suidgid && privs != 0 {
            let mode = after.mode & 0o7777 & !privs;
            self.source
                .with_fd(src.as_fd(), move |f| {
                    use std::os::unix::fs::PermissionsExt;
                    f.set_permissions(std::fs::Permissions::from_mode(mode))
                })
                .map_err(errno)?;
            after = self.source.fstat(src.as_fd()).map_err(errno)?;
        }
        let end = offset + data.len() as u64;
        if state.files.is_some() {
            let files = state.files.as_ref().unwrap();
            let old_size = state.record.identity.size;
            let expected = old_size.max(end);
            // A full cache stops caching this file rather than grow past its limit.
            let admitted = self.usage.may_grow(data.len() as u64);
            let r = (|| -> io::Result<()> {
                if !admitted {
                    return Err(io::Error::from_raw_os_error(libc::ENOSPC));
                }
                // Counted by what the data file grew on disk: an overwrite adds nothing.
                entry::counted(&self.usage, &files.data, || {
                    if end > old_size {
                        files.data.set_len(end)?;
                    }
                    files.data.write_all_at(data, offset)
                })
            })();
            if r.is_err() || after.size != expected {
                // A cache error or a full cache, or someone else changed the source's size
                // meanwhile: keep nothing of this file but an empty record.
                if r.is_err() && admitted {
                    Stats::add(&self.stats.cache.cache_errors, 1);
                }
                state.drop_cached();
                if let Some(f) = state.files.as_ref() {
                    let _ = f.data.set_len(0).and_then(|_| f.data.set_len(after.size));
                }
                state.record.resize(after.size);
                for c in 0..state.record.nchunks() {
                    state.record.set_present(c, false);
                }
            } else {
                state.record.resize(end.max(old_size));
                // Chunks wholly covered by the write now hold the source's bytes.
                let cs = state.record.chunk_size;
                let first_full = offset.div_ceil(cs);
                let last_full = if end == after.size {
                    chunk_count(end, cs)
                } else {
                    end / cs
                };
                for c in first_full..last_full {
                    state.record.set_present(c, true);
                }
            }
            state.noted();
        }
        state.record.identity = self.recorded_identity(&after);
        Ok(data.len() as u32)
    }

    pub fn flush(&self, id: u64, fh: u64, lock_owner: u64) -> Result<()> {
        // close() drops the caller's POSIX locks on this file, as on a local file system.
        let lock = self.locks.lock().unwrap().remove(&(id, lock_owner));
        drop(lock);
        // Written offline: the content goes to the offline log on close (Coda's store).
        if let Ok(h) = self.handle(fh)
            && h.writes_to_cache()
            && let Some(state) = h.inode.file().as_mut()
        {
            if h.writes == Writes::Uploaded {
                return self.object_store(&h.inode, state);
            }
            return self.offline_store(&h.inode, state);
        }
        Ok(())
    }

    pub fn fsync(&self, fh: u64, datasync: bool) -> Result<()> {
        let h = self.handle(fh)?;
        let mut guard = h.inode.file();
        if let Some(src) = h.source.as_ref() {
            self.source
                .with_fd(src.as_fd(), move |f| {
                    if datasync {
                        f.sync_data()
                    } else {
                        f.sync_all()
                    }
                })
                .map_err(errno)?;
        }
        if let Some(state) = guard.as_mut() {
            if h.writes == Writes::Logged {
                return self.offline_store(&h.inode, state);
            }
            if h.writes == Writes::Uploaded {
                return self.object_store(&h.inode, state);
            }
            state.checkpoint(&self.env());
        }
        Ok(())
    }

    pub fn release(&self, fh: u64) -> Result<()> {
        let Some(h) = self.handles.lock().unwrap().remove(&fh) else {
            return Err(Errno::EBADF);
        };
        let mut guard = h.inode.file();
        if h.writes == Writes::Logged {
            if let Some(state) = guard.as_mut()
                && let Err(e) = self.offline_store(&h.inode, state)
            {
                tracing::warn!("cannot log a file written offline at release: {e:?}");
            }
            self.offline_writers.fetch_sub(1, Ordering::Relaxed);
        }
        if h.writes == Writes::Uploaded
            && let Some(state) = guard.as_mut()
            && let Err(e) = self.object_store(&h.inode, state)
        {
            tracing::warn!("cannot upload a written file at release: {e:?}");
        }
        if let Some(state) = guard.as_mut() {
            if h.passthrough.is_some() {
                state.passthrough_opens -= 1;
            } else {
                state.daemon_opens -= 1;
                if h.writable && !h.writes_to_cache() {
                    state.writers -= 1;
                }
            }
        }
        // Unloaded now, or by the last fetch still in flight for it (`fs/fetch.rs`).
        self.unload_if_idle(&h.inode, &mut guard);
        drop(guard);
        // The source descriptor is closed under the source guard, outside the file's lock
        // (a request still in flight on the handle closes it when done instead).
        if let Ok(h) = Arc::try_unwrap(h)
            && let Some(source) = h.source
        {
            self.source.close(source);
        }
        Ok(())
    }

    pub fn fallocate(&self, fh: u64, offset: u64, length: u64, mode: i32) -> Result<()> {
        let h = self.handle(fh)?;
        if h.writes_to_cache() {
            return self.offline_fallocate(&h, offset, length, mode);
        }
        self.changes_allowed()?;
        let src = h.source.as_ref().ok_or(Errno::EBADF)?;
        let mut guard = h.inode.file();
        if let Some(state) = guard.as_mut() {
            state.fetch.invalidate();
            state.mark_written(&self.env());
        }
        // Under the source guard: a hung source holds this file's lock no longer than the
        // source timeout.
        let res = self.source.with_fd(src.as_fd(), move |f| {
            let r = unsafe {
                libc::fallocate(
                    std::os::fd::AsRawFd::as_raw_fd(f),
                    mode,
                    offset as i64,
                    length as i64,
                )
            };
            if r < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        });
        if let Some(state) = guard.as_mut() {
            let after = self.source.fstat(src.as_fd());
            let same_on_cache = res.is_ok()
                && mode & (libc::FALLOC_FL_COLLAPSE_RANGE | libc::FALLOC_FL_INSERT_RANGE) == 0
                && state.files.as_ref().is_some_and(|f| unsafe {
                    libc::fallocate(
                        std::os::fd::AsRawFd::as_raw_fd(&f.data),
                        mode,
                        offset as i64,
                        length as i64,
                    ) == 0
                });
            match after {
                Ok(after) if same_on_cache => {
                    state.record.resize(after.size);
                    state.record.identity = self.recorded_identity(&after);
                }
                Ok(after) => {
                    state.drop_cached();
                    let _ = state.files.as_ref().map(|f| f.data.set_len(after.size));
                    state.record.resize(after.size);
                    for c in 0..state.record.nchunks() {
                        state.record.set_present(c, false);
                    }
                    state.record.identity = self.recorded_identity(&after);
                }
                Err(_) => state.drop_cached(),
            }
            state.noted();
        }
        res.map_err(errno)
    }

    /// SEEK_DATA / SEEK_HOLE answered by the source, which knows its holes.
    pub fn lseek(&self, fh: u64, offset: i64, whence: i32) -> Result<i64> {
        let h = self.handle(fh)?;
        if self.source.is_object() {
            // The kernel then seeks by itself (no holes to report): `fuse_lseek`.
            return Err(Errno::ENOSYS);
        }
        let owned;
        let src = match &h.source {
            Some(s) => s,
            None => {
                owned = self
                    .source
                    .open_file(&h.inode.path().ok_or(Errno::ENOENT)?, libc::O_RDONLY)
                    .map_err(errno)?;
                &owned
            }
        };
        self.source
            .with_fd(src.as_fd(), move |f| {
                let r = unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(f), offset, whence) };
                if r < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(r)
            })
            .map_err(errno)
    }

    // ---------------------------------------------------------------- locks

    fn lock_file(&self, id: u64, owner: u64, fh: u64) -> Result<File> {
        if self.source.is_object() {
            // No locks in an object store: the kernel keeps them, local to this machine.
            return Err(Errno::ENOSYS);
        }
        let mut locks = self.locks.lock().unwrap();
        if let Some(f) = locks.get(&(id, owner)) {
            return crate::source::dup_file(f.as_fd()).map_err(errno);
        }
        let h = self.handle(fh)?;
        // OFD locks need a descriptor open for the lock's type: read-write where possible.
        let path = h.inode.path().ok_or(Errno::ENOENT)?;
        let f = self
            .source
            .open_file(&path, libc::O_RDWR)
            .or_else(|_| self.source.open_file(&path, libc::O_RDONLY))
            .map_err(errno)?;
        let dup = crate::source::dup_file(f.as_fd()).map_err(errno)?;
        locks.insert((id, owner), f);
        Ok(dup)
    }

    fn flock_struct(start: u64, end: u64, typ: i32) -> libc::flock {
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = typ as i16;
        fl.l_whence = libc::SEEK_SET as i16;
        fl.l_start = start as i64;
        fl.l_len = if end == u64::MAX || end >= i64::MAX as u64 {
            0
        } else {
            (end - start + 1) as i64
        };
        fl
    }

    /// One OFD-lock `fcntl` on the source for `owner`'s POSIX lock on `id`.
    #[allow(clippy::too_many_arguments)]
    fn source_lock(
        &self,
        id: u64,
        fh: u64,
        owner: u64,
        start: u64,
        end: u64,
        typ: i32,
        cmd: i32,
    ) -> io::Result<libc::flock> {
        let f = self
            .lock_file(id, owner, fh)
            .map_err(|e| io::Error::from_raw_os_error(e.code()))?;
        let mut fl = Self::flock_struct(start, end, typ);
        let mut lock = move |f: &File| {
            let r = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(f), cmd, &mut fl) };
            if r < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(fl)
        };
        if cmd == libc::F_OFD_SETLKW {
            // A wait for another holder's lock may last as long as that holder wants: no
            // timeout (such waits run on their own threads, see `fuse_adapter`).
            return lock(&f);
        }
        self.source.with_fd(f.as_fd(), lock)
    }

    /// The first lock conflicting with the given one: (start, end, type).
    pub fn getlk(
        &self,
        id: u64,
        fh: u64,
        owner: u64,
        start: u64,
        end: u64,
        typ: i32,
    ) -> Result<(u64, u64, i32)> {
        let fl = self
            .source_lock(id, fh, owner, start, end, typ, libc::F_OFD_GETLK)
            .map_err(errno)?;
        let s = fl.l_start as u64;
        let e = if fl.l_len == 0 {
            u64::MAX
        } else {
            s + fl.l_len as u64 - 1
        };
        Ok((s, e, fl.l_type as i32))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn setlk(
        &self,
        id: u64,
        fh: u64,
        owner: u64,
        start: u64,
        end: u64,
        typ: i32,
        sleep: bool,
    ) -> Result<()> {
        let cmd = if sleep {
            libc::F_OFD_SETLKW
        } else {
            libc::F_OFD_SETLK
        };
        match self.source_lock(id, fh, owner, start, end, typ, cmd) {
            Ok(_) => Ok(()),
            // POSIX says EAGAIN or EACCES; the kernel's FUSE code expects EAGAIN.
            Err(e) if e.raw_os_error() == Some(libc::EACCES) => Err(Errno::EAGAIN),
            Err(e) => Err(errno(e)),
        }
    }
}

impl EvictTarget for CachingFs {
    fn settle(&self) {
        self.commit_now();
    }

    fn evict(&self, rel: &Path, chunks: Option<&[u64]>) -> u64 {
        let _exclusive = self.evict_lock.write().unwrap();
        // Open by name, or by a name it had while open (an open file whose name was taken
        // by a new file behind the mount: its data file may still be the entry's, and its
        // handles read it; punched chunks would read as zeros).
        let open = self.loaded.lock().unwrap().values().any(|i| {
            i.names.lock().unwrap().iter().any(|n| n == rel)
                || i.former.lock().unwrap().iter().any(|n| n == rel)
        });
        if open {
            return 0;
        }
        // Changed offline and not yet replayed: the offline view needs it (the log has
        // its content anyway). While a replay holds the log, nothing is evicted.
        if self.oplog.try_lock().map_or(true, |log| log.touches(rel)) {
            return 0;
        }
        if let Some(chunks) = chunks {
            return self.evict_chunks(rel, chunks);
        }
        let bytes = self.cache.data_bytes(rel);
        // The record goes first: without it the data is never served.
        match self.cache.remove(rel) {
            Ok(()) => bytes,
            Err(e) => {
                tracing::warn!(?rel, "cannot evict: {e}");
                0
            }
        }
    }

    fn cache_fs_free(&self) -> u64 {
        self.cache.fs_free().unwrap_or(u64::MAX)
    }
}

impl crate::control::Handler for CachingFs {
    fn stats(&self) -> Snapshot {
        self.snapshot()
    }

    fn set(&self, setting: crate::options::Live) -> std::result::Result<(), String> {
        CachingFs::set(self, setting)
    }

    fn clean(&self, to: Option<u64>) -> u64 {
        CachingFs::clean(self, to)
    }

    fn pin(&self, rel: &Path, on: bool) -> std::result::Result<(), String> {
        CachingFs::pin(self, rel, on)
    }
}

impl CachingFs {
    /// Drops some chunks of a file nobody has open (caller holds `evict_lock` for writing):
    /// the record stops claiming them (durably) before their bytes are punched out.
    fn evict_chunks(&self, rel: &Path, chunks: &[u64]) -> u64 {
        let Some(files) = self.cache.open_existing(rel) else {
            return 0;
        };
        let Ok(Some(Ok(mut rec))) = read_record(&files) else {
            return 0;
        };
        let mut freed = 0;
        for &c in chunks {
            if !rec.is_present(c) {
                continue;
            }
            rec.set_present(c, false);
            freed += rec.chunk_size.min(rec.identity.size - c * rec.chunk_size);
        }
        if freed == 0 {
            return 0;
        }
        if rec.present_count() == 0 {
            // Nothing left: drop the entry entirely.
            let bytes = self.cache.data_bytes(rel);
            return self.cache.remove(rel).map(|_| bytes).unwrap_or(0);
        }
        if write_record(&files, &rec, true).is_err() {
            return 0;
        }
        for &c in chunks {
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            let off = (c * rec.chunk_size) as i64;
            // Without hole punching the bytes stay until the file is evicted or refetched;
            // the record no longer claims them either way.
            unsafe {
                libc::fallocate(
                    std::os::fd::AsRawFd::as_raw_fd(&files.data),
                    punch,
                    off,
                    rec.chunk_size as i64,
                )
            };
        }
        // Punching moved the data file's ctime: vouch for the punched file (a crash before
        // this only loses the file's cache, since the record no longer matches its data).
        let _ = write_record(&files, &rec, false);
        freed
    }
}

//! Validated configuration of one mount. Defaults carry their reasons.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// Files up to this size are fetched whole on first open; larger files chunk by chunk.
/// 8 MiB: most source files people open whole (code, documents, configs) are below it,
/// and fetching them in one go costs one round trip instead of one per chunk.
pub const DEFAULT_WHOLE_FILE_THRESHOLD: u64 = 8 << 20;
/// Unit of caching for large files. 1 MiB keeps the presence bitmap tiny (128 bytes per
/// GiB) and a random 4 KiB read over a slow link fetches at most 1 MiB extra.
pub const DEFAULT_CHUNK_SIZE: u64 = 1 << 20;
/// Unit of caching on an object store, where a chunk is one ranged GET: each request
/// costs a round trip and the server's per-request work. Cold 1 GiB reads over a loopback
/// MinIO: 1 MiB chunks ~400 MiB/s, 8 MiB ~600-630, 16 MiB no better (docs/SEMANTICS.md);
/// 8 MiB is also the part size mountpoint-s3 and the AWS SDKs use.
pub const OBJECT_CHUNK_SIZE: u64 = 8 << 20;

/// The chunk size when none is given: `OBJECT_CHUNK_SIZE` for an `s3://` source.
pub fn default_chunk_size(source: &Path) -> u64 {
    if source.to_str().is_some_and(|s| s.starts_with("s3://")) {
        OBJECT_CHUNK_SIZE
    } else {
        DEFAULT_CHUNK_SIZE
    }
}
/// Kernel entry and attribute TTL where nothing reports changes to the source. Opens
/// always revalidate against the source (close-to-open), so this only bounds how long a
/// `stat` may show old attributes.
pub const UNWATCHED_TTL: Duration = Duration::from_secs(1);
/// Kernel TTLs in directories the watcher covers: it invalidates what changes, so the TTL
/// only bounds how long a lost event could go unnoticed (the Coda MiniCache's long-lived
/// name and attribute caches).
pub const WATCHED_TTL: Duration = Duration::from_secs(60);
/// Chunks fetched since the last checkpoint before the bitmap is made durable.
pub const DEFAULT_CHECKPOINT_CHUNKS: u32 = 64;
/// Threads fetching in the background (rest of a chunk, prefetch, whole files). On a local
/// source one per CPU, 2 to 8: on the slow disk and the 100 Mbit/s link 1, 2 and 4 workers
/// read one file at the source's speed alike; on a fast local source with 2 CPUs 4 workers
/// were slower than 2 (801 vs 901 MiB/s: they compete with the request threads for the
/// CPUs). On a network or FUSE source (`remote`) 8 at least: there a worker mostly waits
/// for round trips, and the directory prefetch keeps one file per worker in flight (cold
/// `grep -r` over SSHFS: 2.26 s with 4 workers, 1.94 s with 8, 1.96 s with 16). See
/// docs/performance.md for the measurements behind these defaults.
pub fn default_fetch_workers(remote: bool) -> usize {
    let per_cpu = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 8);
    if remote {
        per_cpu.max(REMOTE_FETCH_WORKERS)
    } else {
        per_cpu
    }
}
/// Fetch workers at least, on network and FUSE sources.
pub const REMOTE_FETCH_WORKERS: usize = 8;
/// Largest prefetch window of a sequential reader, in chunks.
pub const DEFAULT_FETCH_WINDOW: u64 = 8;
/// Bytes of chunks queued for or being fetched by the workers.
pub const DEFAULT_FETCH_INFLIGHT: u64 = 64 << 20;
/// Source descriptors kept open for fetching (one per open, partially cached file).
pub const DEFAULT_FETCH_FDS: u64 = 256;
/// Files of a directory fetched whole ahead of a reader that opens them in listing order
/// (`grep -r`, `cp -r`, `tar`). See docs/performance.md for the measurements.
pub const DEFAULT_FETCH_DIR_PREFETCH: u64 = 16;

/// Estimated memory per inode-table entry: the daemon's entry (measured ~0.45 KiB with its
/// maps, queues and path: 1,000,000 entries, 450 MiB RSS) plus the kernel's FUSE inode and
/// dentry (~1 KiB) that every referenced entry stands for.
pub const INODE_ENTRY_COST: u64 = 1536;

/// The default soft maximum of the inode table: the entries that fit in 2 % of RAM (the
/// paper used 5 % for the kernel's vnodes alone), clamped to [16 Ki, 256 Ki] so that a walk
/// of millions of files keeps the daemon well under 256 MiB on any machine.
pub fn default_max_inodes() -> usize {
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    let ram = if unsafe { libc::sysinfo(&mut info) } == 0 {
        info.totalram as u64 * info.mem_unit as u64
    } else {
        0
    };
    (ram / 50 / INODE_ENTRY_COST).clamp(16 << 10, 256 << 10) as usize
}

#[derive(Clone, Debug)]
pub struct Config {
    pub source: PathBuf,
    pub mountpoint: PathBuf,
    pub cache_dir: PathBuf,
    pub whole_file_threshold: u64,
    pub chunk_size: u64,
    /// Kernel TTLs; `None`: chosen per directory by `coherence.rs` (long where a watcher
    /// reports changes, short where nothing does).
    pub entry_ttl: Option<Duration>,
    pub attr_ttl: Option<Duration>,
    pub negative_ttl: Option<Duration>,
    /// Whether to watch a local source for changes made behind the mount.
    pub watch: WatchMode,
    /// Longest wait for one source call; `None`: 10 s on network and FUSE sources, none on
    /// local ones; zero: none.
    pub source_timeout: Option<Duration>,
    /// The source's timestamp granularity (`None`: by source kind, `CachingFs::new`).
    pub timestamp_granularity: Option<Duration>,
    /// Start in disconnected mode (`hoardfs online` ends it).
    pub start_offline: bool,
    /// What changes made while disconnected do (`fs/reintegrate.rs`).
    pub offline_writes: OfflineWrites,
    pub stale_check: bool,
    /// Every open asks the source, even where a watcher's callback covers the file.
    pub close_to_open: bool,
    /// Where nothing is watched, how long a look at a file answers later opens for
    /// reading (`coherence::OpenLease`); zero: every open asks the source.
    pub open_lease: Duration,
    pub passthrough: bool,
    /// The kernel opens files itself and keeps their pages between opens
    /// (`fs/kernel_opens.rs`): no OPEN, FLUSH or RELEASE reaches the daemon.
    pub kernel_opens: bool,
    /// The kernel opens directories itself and keeps their listings between opens, while
    /// files are opened through the daemon as usual (`fs/kernel_opens.rs`): no OPENDIR or
    /// RELEASEDIR reaches the daemon. Implied by `kernel_opens`.
    pub kernel_dir_opens: bool,
    /// Large files not yet cached are read by the kernel from the source file itself
    /// (passthrough to the source), and what was read is copied into the cache at close
    /// (`fs/source_reads.rs`). Sources without a source timeout only.
    pub source_reads: bool,
    /// Writers write to the source file themselves, by passthrough to it, and what they
    /// wrote is copied into the cache at the last writer's close (`fs/source_writes.rs`).
    /// Sources without a source timeout only.
    pub source_writes: bool,
    pub allow_other: bool,
    pub read_only: bool,
    /// Mount over a mount point that is not empty (hiding what it holds).
    pub nonempty: bool,
    pub foreground: bool,
    pub threads: usize,
    /// Serve FUSE requests over io_uring where the kernel allows it (`--fuse-ring`).
    pub fuse_ring: bool,
    pub checkpoint_chunks: u32,
    /// The fetch engine (`fetch.rs`): worker threads, largest prefetch window in chunks,
    /// bytes queued for workers, source descriptors kept for fetching, files of a
    /// directory fetched ahead of a reader going through it in order (0: none).
    /// `fetch_workers` `None`: chosen by the source's kind (`default_fetch_workers`).
    pub fetch_workers: Option<usize>,
    pub fetch_window: u64,
    pub fetch_inflight: u64,
    pub fetch_fds: u64,
    pub fetch_dir_prefetch: u64,
    /// Soft maximum of inode-table entries (`inode.rs`).
    pub max_inodes: usize,
    /// Cache size limit in bytes; `None`: `cache_share` percent of the cache's file system.
    pub cache_size: Option<u64>,
    pub cache_share: u8,
    /// The cleaner starts above `high_watermark` percent of the limit and stops at `low_watermark`.
    pub high_watermark: u8,
    pub low_watermark: u8,
    /// Free space kept on the cache's file system; `None`: 5 % of it.
    pub min_free: Option<u64>,
    /// Where to serve Prometheus metrics (`metrics.rs`); `None`: no endpoint.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// How to reach an `s3://` source (`object_source.rs`); unused for directories.
    pub s3: S3Settings,
}

/// The command line's say on reaching an object store; credentials come from the AWS
/// environment variables and profile files.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct S3Settings {
    /// `http[s]://host[:port]`; `None`: AWS, or `AWS_ENDPOINT_URL[_S3]`, or the profile's.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    /// `BUCKET.host` URLs instead of path style (`host/BUCKET`).
    pub virtual_hosted: bool,
}

/// Why a build without the `s3` feature refuses an `s3://` source.
pub const NO_S3: &str = "this hoardfs was built without the s3 feature; rebuild with --features s3";

impl Config {
    /// The configuration of a mount of `source` at `mountpoint` with every option at its
    /// default (`options::OPTIONS` holds the defaults' text; a unit test there checks that
    /// each parses to what this says). The cache directory is left empty: chosen once the
    /// options are known (`options::config`).
    pub fn new(source: PathBuf, mountpoint: PathBuf) -> Config {
        Config {
            cache_dir: PathBuf::new(),
            chunk_size: default_chunk_size(&source),
            source,
            mountpoint,
            whole_file_threshold: DEFAULT_WHOLE_FILE_THRESHOLD,
            entry_ttl: None,
            attr_ttl: None,
            negative_ttl: None,
            watch: WatchMode::Auto,
            source_timeout: None,
            timestamp_granularity: None,
            start_offline: false,
            offline_writes: OfflineWrites::Refuse,
            stale_check: true,
            close_to_open: false,
            open_lease: Duration::ZERO,
            passthrough: true,
            kernel_opens: false,
            kernel_dir_opens: false,
            source_reads: false,
            source_writes: false,
            allow_other: false,
            read_only: false,
            nonempty: false,
            foreground: false,
            threads: 4,
            fuse_ring: true,
            checkpoint_chunks: DEFAULT_CHECKPOINT_CHUNKS,
            fetch_workers: None,
            fetch_window: DEFAULT_FETCH_WINDOW,
            fetch_inflight: DEFAULT_FETCH_INFLIGHT,
            fetch_fds: DEFAULT_FETCH_FDS,
            fetch_dir_prefetch: DEFAULT_FETCH_DIR_PREFETCH,
            max_inodes: default_max_inodes(),
            cache_size: None,
            cache_share: DEFAULT_CACHE_SHARE,
            high_watermark: DEFAULT_HIGH_WATERMARK,
            low_watermark: DEFAULT_LOW_WATERMARK,
            min_free: None,
            metrics_addr: None,
            s3: S3Settings::default(),
        }
    }

    /// What the (validated) source argument names, for building the source
    /// (`health::open_source`).
    pub fn source_spec(&self) -> SourceSpec {
        #[cfg(feature = "s3")]
        if let Some(url) = (self.source.to_str())
            .filter(|s| s.starts_with("s3://"))
            .and_then(|s| crate::object_source::ObjectUrl::parse(s).ok())
        {
            return SourceSpec::Object(url);
        }
        SourceSpec::Dir(self.source.clone())
    }

    /// Whether the source names an object store (`s3://`), whether or not this build can
    /// reach one.
    pub fn is_object_source(&self) -> bool {
        self.source.to_str().is_some_and(|s| s.starts_with("s3://"))
    }
}

/// The kind of source the command line names, and where it is.
pub enum SourceSpec {
    /// A directory tree (`source::PosixTree`).
    Dir(PathBuf),
    /// An S3-compatible object store, `s3://BUCKET[/PREFIX]` (`object_tree::ObjectTree`);
    /// without the `s3` feature such a source is refused by `Config::check_values`.
    #[cfg(feature = "s3")]
    Object(crate::object_source::ObjectUrl),
}

/// Whether hoardfs watches the source (inotify) for changes made behind the mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WatchMode {
    /// Watch sources on local file systems; not network or FUSE ones, whose remote
    /// changes raise no events here.
    Auto,
    On,
    Off,
}

impl std::str::FromStr for WatchMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        <WatchMode as clap::ValueEnum>::from_str(s, true)
            .map_err(|_| format!("watch must be auto, on or off, not {s:?}"))
    }
}

/// What happens to changes made while the mount is disconnected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OfflineWrites {
    /// They fail with EROFS.
    Refuse,
    /// They are applied to the cache and logged durably, and replayed to the source when
    /// it is back (conflicts keep both versions).
    Log,
}

impl std::str::FromStr for OfflineWrites {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        <OfflineWrites as clap::ValueEnum>::from_str(s, true)
            .map_err(|_| format!("offline_writes must be refuse or log, not {s:?}"))
    }
}

/// Default share of the cache's file system that the cache may use.
pub const DEFAULT_CACHE_SHARE: u8 = 80;
/// xCachefs' cleaner: start at 90 %, clean down to 70 %.
pub const DEFAULT_HIGH_WATERMARK: u8 = 90;
pub const DEFAULT_LOW_WATERMARK: u8 = 70;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("source {0}: {1}")]
    Source(PathBuf, String),
    #[error("mount point {0}: {1}")]
    Mountpoint(PathBuf, String),
    #[error("cache directory {0}: {1}")]
    CacheDir(PathBuf, String),
    #[error("{0}")]
    Invalid(String),
}

fn canonical_dir(
    p: &Path,
    what: fn(PathBuf, String) -> ConfigError,
) -> Result<PathBuf, ConfigError> {
    let c = std::fs::canonicalize(p).map_err(|e| what(p.to_path_buf(), e.to_string()))?;
    if !c.is_dir() {
        return Err(what(p.to_path_buf(), "is not a directory".into()));
    }
    Ok(c)
}

/// The source's canonical path; a source that does not answer (a dead or hung network
/// mount) keeps its absolute path as given, so that the mount can start offline from the
/// cache (`fs.rs` decides). A path that does not exist or is no directory is an error.
fn canonical_source(p: &Path) -> Result<PathBuf, ConfigError> {
    let err = |e: String| ConfigError::Source(p.to_path_buf(), e);
    if let Some(s) = p.to_str().filter(|s| s.contains("://")) {
        if !s.starts_with("s3://") {
            return Err(err(
                "the only object-store sources are s3://BUCKET[/PREFIX]; give that or a directory"
                    .into(),
            ));
        }
        #[cfg(not(feature = "s3"))]
        return Err(err(NO_S3.into()));
        #[cfg(feature = "s3")]
        {
            crate::object_source::ObjectUrl::parse(s).map_err(err)?;
            return Ok(p.to_path_buf());
        }
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let q = p.to_path_buf();
    // Not owned: one that outlives its wait is stuck in a hung source and stays detached.
    std::thread::Builder::new()
        .name("canonicalize".into())
        .spawn(move || {
            let _ = tx.send(std::fs::canonicalize(&q).map(|c| {
                let dir = c.is_dir();
                (c, dir)
            }));
        })
        .map_err(|e| err(e.to_string()))?;
    let unreachable = |why: String| {
        tracing::warn!("the source {} does not answer ({why})", p.display());
        std::path::absolute(p).map_err(|e| err(e.to_string()))
    };
    match rx.recv_timeout(std::time::Duration::from_secs(10)) {
        Ok(Ok((c, true))) => Ok(c),
        Ok(Ok((_, false))) => Err(err("is not a directory".into())),
        Ok(Err(e)) if crate::source::may_mean_unreachable(&e) => unreachable(e.to_string()),
        Ok(Err(e)) => Err(err(e.to_string())),
        Err(_) => unreachable("no answer within 10 s".into()),
    }
}

/// The topmost ancestor of `p` (or `p` itself) that does not exist: what
/// `create_dir_all(p)` would create first. `None` when `p` exists.
fn first_missing(p: &Path) -> Option<PathBuf> {
    let mut top = None;
    for a in p.ancestors().filter(|a| !a.as_os_str().is_empty()) {
        if a.symlink_metadata().is_ok() {
            break;
        }
        top = Some(a.to_path_buf());
    }
    top
}

/// A mount over a directory that holds files hides them (`hoardfs EMPTY DATA`, arguments
/// swapped, would hide DATA): refused unless asked for with `--nonempty`. A directory that
/// cannot be listed is let through (the mount itself then decides).
fn check_empty(m: &Path) -> Result<(), ConfigError> {
    let Ok(mut entries) = std::fs::read_dir(m) else {
        return Ok(());
    };
    if entries.next().is_some() {
        return Err(ConfigError::Mountpoint(
            m.to_path_buf(),
            "is not empty: the mount would hide its files (SOURCE and MOUNTPOINT swapped?); \
             --nonempty (-o nonempty) mounts over it anyway"
                .into(),
        ));
    }
    Ok(())
}

/// The FUSE device must open for this user (fusermount3 opens it with the caller's rights
/// too): say what is wrong and how to fix it, before anything else is done.
fn check_dev_fuse() -> Result<(), ConfigError> {
    const DEV: &str = "/dev/fuse";
    match std::fs::OpenOptions::new().read(true).write(true).open(DEV) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(ConfigError::Invalid(format!(
            "{DEV} does not exist: load the FUSE module (modprobe fuse), or in a container \
             give it the device (docker run --device /dev/fuse)"
        ))),
        Err(e) if rustix::process::geteuid().is_root() => {
            Err(ConfigError::Invalid(format!("cannot open {DEV}: {e}")))
        }
        Err(e) => Err(ConfigError::Invalid(format!(
            "cannot open {DEV}: {e}; users other than root need read and write access to it: \
             its mode is normally 0666 (as root: chmod 0666 /dev/fuse), or mount as root"
        ))),
    }
}

/// The cache directory used when none is given: one per source, under the user's cache
/// home (`$XDG_CACHE_HOME/hoardfs`, `~/.cache/hoardfs`) or `/var/cache/hoardfs` for root.
pub fn default_cache_dir(source: &Path) -> PathBuf {
    let base = if rustix::process::geteuid().is_root() {
        PathBuf::from("/var/cache/hoardfs")
    } else if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        PathBuf::from(x).join("hoardfs")
    } else if let Some(h) = std::env::var_os("HOME") {
        PathBuf::from(h).join(".cache/hoardfs")
    } else {
        PathBuf::from("/tmp/hoardfs-cache")
    };
    // Readable name plus a hash of the full path, so /a/data and /b/data never collide.
    let s = source.as_os_str().to_string_lossy();
    let readable: String = s
        .trim_matches('/')
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let readable: String = readable
        .chars()
        .rev()
        .take(48)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    base.join(format!(
        "{}-{:08x}",
        if readable.is_empty() {
            "root".into()
        } else {
            readable
        },
        crc32fast::hash(s.as_bytes())
    ))
}

impl Config {
    /// Checks paths and values, canonicalising the paths. Catches the layouts that would
    /// make the mount recurse into itself or cache into its own source, a mount point
    /// whose files the mount would hide, and a `/dev/fuse` this user cannot open. Creates
    /// the cache directory if needed, and removes what it created when it fails.
    pub fn validate(mut self) -> Result<Config, ConfigError> {
        self.check_values()?;
        self.source = canonical_source(&self.source)?;
        self.mountpoint = canonical_dir(&self.mountpoint, ConfigError::Mountpoint)?;
        let created = first_missing(&self.cache_dir);
        if created.is_some() {
            std::fs::create_dir_all(&self.cache_dir).map_err(|e| {
                ConfigError::CacheDir(self.cache_dir.clone(), format!("cannot create: {e}"))
            })?;
        }
        let given = self.cache_dir.clone();
        let checked = self.check_layout().and_then(|c| {
            if !c.nonempty {
                check_empty(&c.mountpoint)?;
            }
            check_dev_fuse()?;
            Ok(c)
        });
        checked.inspect_err(|_| {
            // Leave no empty directory behind (only empty ones: remove_dir).
            if let Some(top) = created {
                for d in given.ancestors() {
                    if std::fs::remove_dir(d).is_err() || d == top {
                        break;
                    }
                }
            }
        })
    }

    /// `validate`'s checks of where the cache directory is (it exists by now).
    fn check_layout(mut self) -> Result<Config, ConfigError> {
        self.cache_dir = canonical_dir(&self.cache_dir, ConfigError::CacheDir)?;
        use rustix::fs::Access;
        rustix::fs::access(&self.cache_dir, Access::WRITE_OK | Access::EXEC_OK).map_err(|e| {
            ConfigError::CacheDir(self.cache_dir.clone(), std::io::Error::from(e).to_string())
        })?;
        if self.is_object_source() {
            let (m, c) = (&self.mountpoint, &self.cache_dir);
            if c.starts_with(m) || m.starts_with(c) {
                return Err(ConfigError::CacheDir(
                    c.clone(),
                    format!(
                        "must not be inside the mount point {} or contain it",
                        m.display()
                    ),
                ));
            }
            return Ok(self);
        }
        let (s, m, c) = (&self.source, &self.mountpoint, &self.cache_dir);
        if c.starts_with(s) || s.starts_with(c) {
            return Err(ConfigError::CacheDir(
                c.clone(),
                format!(
                    "must not be inside the source {} or contain it",
                    s.display()
                ),
            ));
        }
        if c.starts_with(m) || m.starts_with(c) {
            return Err(ConfigError::CacheDir(
                c.clone(),
                format!(
                    "must not be inside the mount point {} or contain it",
                    m.display()
                ),
            ));
        }
        if m == s {
            return Err(ConfigError::Mountpoint(
                m.clone(),
                "is the source itself".into(),
            ));
        }
        // The mount would show up inside its own source: walking into it sends the daemon
        // requests to itself, and a tree walk (find, du) wedges every request thread.
        if m.starts_with(s) {
            return Err(ConfigError::Mountpoint(
                m.clone(),
                format!("must not be inside the source {}", s.display()),
            ));
        }
        Ok(self)
    }

    /// The checks of `validate` that do not look at the file system (`hoardfs config
    /// check` runs them on a file meant for another machine).
    pub fn check_values(&self) -> Result<(), ConfigError> {
        if self.is_object_source() && !cfg!(feature = "s3") {
            return Err(ConfigError::Source(self.source.clone(), NO_S3.into()));
        }
        if self.is_object_source() && self.offline_writes == OfflineWrites::Log {
            return Err(ConfigError::Invalid(
                "offline_writes=log is not available for object-store sources yet".into(),
            ));
        }
        if self.is_object_source() && self.kernel_opens {
            return Err(ConfigError::Invalid(
                "kernel_opens is not available for object-store sources: they upload a \
                 written file when it is closed, and with kernel opens no close reaches \
                 hoardfs"
                    .into(),
            ));
        }
        if self.source_reads && (self.is_object_source() || self.kernel_opens || !self.passthrough)
        {
            return Err(ConfigError::Invalid(
                "source_reads needs a directory source and passthrough: not with an \
                 object-store source, kernel_opens or no_passthrough"
                    .into(),
            ));
        }
        if self.source_writes && (self.is_object_source() || self.kernel_opens || !self.passthrough)
        {
            return Err(ConfigError::Invalid(
                "source_writes needs a directory source and passthrough: not with an \
                 object-store source, kernel_opens or no_passthrough"
                    .into(),
            ));
        }
        if !self.chunk_size.is_power_of_two() || self.chunk_size < 4096 {
            return Err(ConfigError::Invalid(format!(
                "chunk size {} must be a power of two of at least 4 KiB",
                self.chunk_size
            )));
        }
        if !(1..=100).contains(&self.cache_share)
            || self.low_watermark >= self.high_watermark
            || self.high_watermark > 100
        {
            return Err(ConfigError::Invalid(format!(
                "watermarks must satisfy low < high <= 100 and the cache share 1..=100 \
                 (got low {}, high {}, share {})",
                self.low_watermark, self.high_watermark, self.cache_share
            )));
        }
        if self.max_inodes == 0 {
            return Err(ConfigError::Invalid("max_inodes must be at least 1".into()));
        }
        if self.threads == 0 {
            return Err(ConfigError::Invalid("threads must be at least 1".into()));
        }
        if self.fetch_workers.is_some_and(|n| n > 256) {
            return Err(ConfigError::Invalid(
                "fetch_workers must be at most 256".into(),
            ));
        }
        Ok(())
    }
}

/// Parses sizes like `4096`, `64K`, `1M`, `8MiB`, `2G`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num.parse().map_err(|_| format!("invalid size {s:?}"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(format!("invalid size unit in {s:?} (use K, M, G or T)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

/// Parses durations in seconds, fractions allowed (`1`, `0.5`, `30s`).
pub fn parse_secs(s: &str) -> Result<Duration, String> {
    let t = s.trim().trim_end_matches('s');
    let v: f64 = t
        .parse()
        .map_err(|_| format!("invalid duration {s:?} (seconds)"))?;
    if !(0.0..=1e9).contains(&v) {
        return Err(format!("duration {s:?} out of range"));
    }
    Ok(Duration::from_secs_f64(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("8MiB").unwrap(), 8 << 20);
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(parse_secs("0.5").unwrap(), Duration::from_millis(500));
        assert!(parse_secs("-1").is_err());
    }

    #[test]
    fn default_cache_dir_is_distinct_per_source() {
        let a = default_cache_dir(Path::new("/a/data"));
        let b = default_cache_dir(Path::new("/b/data"));
        assert_ne!(a, b);
        assert!(
            a.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("a_data-")
        );
    }
}

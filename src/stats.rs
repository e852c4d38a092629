//! Counters of everything that reaches the daemon (the Coda paper's metric: operations seen
//! by the user-level cache manager), plus cache hits, misses and bytes by origin.
//! All counters are relaxed atomics: one add per request, no locks on the hot path.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::{Deserialize, Serialize};

macro_rules! ops {
    ($($variant:ident => $name:literal),* $(,)?) => {
        /// A FUSE request type.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Op { $($variant),* }
        impl Op {
            pub const ALL: &'static [Op] = &[$(Op::$variant),*];
            pub fn name(self) -> &'static str {
                match self { $(Op::$variant => $name),* }
            }
        }
    };
}

ops! {
    Lookup => "lookup", Forget => "forget", Getattr => "getattr", Setattr => "setattr",
    Readlink => "readlink", Mknod => "mknod", Mkdir => "mkdir", Unlink => "unlink",
    Rmdir => "rmdir", Symlink => "symlink", Rename => "rename", Link => "link", Open => "open",
    Read => "read", Write => "write", Flush => "flush", Release => "release", Fsync => "fsync",
    Opendir => "opendir", Readdir => "readdir", Readdirplus => "readdirplus",
    Releasedir => "releasedir",
    Fsyncdir => "fsyncdir", Statfs => "statfs", Setxattr => "setxattr",
    Getxattr => "getxattr", Listxattr => "listxattr", Removexattr => "removexattr",
    Access => "access", Create => "create", Getlk => "getlk", Setlk => "setlk",
    Fallocate => "fallocate", Lseek => "lseek", Ioctl => "ioctl", Poll => "poll",
    CopyFileRange => "copy_file_range",
}

macro_rules! counters {
    ($($field:ident: $doc:literal),* $(,)?) => {
        /// Cache-level counters.
        #[derive(Debug, Default)]
        pub struct CacheCounters { $(#[doc = $doc] pub $field: AtomicU64),* }
        /// A snapshot of [`CacheCounters`].
        #[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
        pub struct CacheSnapshot { $(#[doc = $doc] pub $field: u64),* }
        impl CacheCounters {
            fn snapshot(&self) -> CacheSnapshot {
                CacheSnapshot { $($field: self.$field.load(Relaxed)),* }
            }
        }
        impl CacheSnapshot {
            pub fn rows(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($field), self.$field)),*]
            }
            /// Each counter's name and its one-line description.
            pub const DOCS: &'static [(&'static str, &'static str)] =
                &[$((stringify!($field), $doc)),*];
        }
    };
}

counters! {
    open_hits: "opens of regular files whose data was fully cached and valid",
    open_misses: "opens of regular files that needed data from the source",
    passthrough_opens: "opens answered with FUSE passthrough to the cache file",
    source_read_opens: "opens answered with FUSE passthrough to the source file (--source-reads: large files not cached whole)",
    source_write_opens: "opens for writing answered with FUSE passthrough to the source file (--source-writes)",
    direct_opens: "opens the kernel's page cache is bypassed for (FUSE direct I/O): write-only handles alone on their file, and the handles opened beside one",
    ring_requests: "requests that came over io_uring (FUSE over io_uring; the others came over /dev/fuse)",
    read_hits: "read requests served entirely from the cache",
    read_misses: "read requests that fetched from the source",
    bytes_from_cache: "bytes returned by the daemon from cache files",
    bytes_from_source: "bytes read from the source (fetches and uncached reads)",
    bytes_written: "bytes written through to the source",
    uploads: "files uploaded whole to an object-store source (on close, fsync or truncation)",
    bytes_uploaded: "bytes uploaded to an object-store source",
    chunks_fetched: "chunks fetched from the source into the cache",
    chunks_filled_behind: "chunks copied into the cache after a source read closed, from the source's pages in memory (counted in chunks_fetched too)",
    chunks_left_behind: "chunks the fill after a source read left absent: not wholly in the source's memory (or the file changed, or the source failed)",
    stale_invalidations: "cached files dropped because the source changed",
    versions_kept: "files changed behind the mount while open whole: open handles kept the old version, new opens got a new node",
    retired_opens: "opens that, retried by the kernel after ESTALE, found the file replaced again and got the version just replaced",
    corrupt_records: "cache records found torn or corrupt and discarded",
    cache_errors: "cache I/O errors (the request was served from the source)",
    checkpoints: "durable record updates",
    group_commits: "syncs of the cache that made the fills and writes of the files closed meanwhile durable at once",
    chunks_prefetched: "chunks fetched ahead of a sequential reader (included in chunks_fetched)",
    prefetch_hits: "chunks a read found already fetched by prefetch",
    fetch_waits: "reads that waited for bytes another reader or worker was fetching (a shared fetch)",
    early_returns: "reads answered before the rest of their chunk had arrived",
    hint_reads: "reads served by the short path (the handle's hint: a chunk known present)",
    whole_file_fetches: "small files whose whole-file fetch was started on open",
    dir_prefetch_files: "small files fetched whole in the background because earlier files of their directory were opened in listing order",
    dir_prefetch_hits: "opens of files the directory prefetch had fetched or was fetching",
    dir_prefetch_dropped: "files of the directory prefetch not fetched: the reader got there first, the order broke, or a bound (in-flight bytes, source files, cache watermark) said no",
    dir_warm_ahead: "cache entries of files cached before read into memory ahead of a reader opening their directory's files in listing order",
}

#[derive(Debug)]
pub struct Stats {
    ops: Vec<AtomicU64>,
    pub cache: CacheCounters,
    /// Time the daemon spent on each request type (`start`), for the metrics endpoint.
    pub latency: Vec<Histogram>,
    /// Failed requests by type and errno: `ERRNOS` slots per request type, the errno's
    /// number the slot (slot 0 takes numbers out of range).
    errors: Vec<AtomicU64>,
}

/// Errno slots per request type: Linux's errnos are 1..=133.
const ERRNOS: usize = 134;

impl Default for Stats {
    fn default() -> Self {
        Stats {
            ops: Op::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
            cache: CacheCounters::default(),
            latency: Op::ALL.iter().map(|_| Histogram::default()).collect(),
            errors: (0..Op::ALL.len() * ERRNOS)
                .map(|_| AtomicU64::new(0))
                .collect(),
        }
    }
}

/// The symbolic name of an errno (`ENOENT`), or `E<number>` for one not in this table,
/// which holds what file system requests answer; `other` for 0, the slot of the errnos
/// out of range in the error counts.
pub fn errno_name(errno: i32) -> String {
    use libc::*;
    let name = match errno {
        0 => "other",
        EPERM => "EPERM",
        ENOENT => "ENOENT",
        EINTR => "EINTR",
        EIO => "EIO",
        ENXIO => "ENXIO",
        E2BIG => "E2BIG",
        EBADF => "EBADF",
        EAGAIN => "EAGAIN",
        ENOMEM => "ENOMEM",
        EACCES => "EACCES",
        EFAULT => "EFAULT",
        EBUSY => "EBUSY",
        EEXIST => "EEXIST",
        EXDEV => "EXDEV",
        ENODEV => "ENODEV",
        ENOTDIR => "ENOTDIR",
        EISDIR => "EISDIR",
        EINVAL => "EINVAL",
        ENFILE => "ENFILE",
        EMFILE => "EMFILE",
        ENOTTY => "ENOTTY",
        ETXTBSY => "ETXTBSY",
        EFBIG => "EFBIG",
        ENOSPC => "ENOSPC",
        ESPIPE => "ESPIPE",
        EROFS => "EROFS",
        EMLINK => "EMLINK",
        ERANGE => "ERANGE",
        EDEADLK => "EDEADLK",
        ENAMETOOLONG => "ENAMETOOLONG",
        ENOLCK => "ENOLCK",
        ENOSYS => "ENOSYS",
        ENOTEMPTY => "ENOTEMPTY",
        ELOOP => "ELOOP",
        ENODATA => "ENODATA",
        EOVERFLOW => "EOVERFLOW",
        EOPNOTSUPP => "EOPNOTSUPP",
        ENOTCONN => "ENOTCONN",
        ETIMEDOUT => "ETIMEDOUT",
        EHOSTDOWN => "EHOSTDOWN",
        EHOSTUNREACH => "EHOSTUNREACH",
        ESTALE => "ESTALE",
        EDQUOT => "EDQUOT",
        ECANCELED => "ECANCELED",
        _ => return format!("E{errno}"),
    };
    name.to_string()
}

/// Upper bounds of the latency buckets: 2^k microseconds, 1 µs to 2^24 µs (16.8 s); one
/// more bucket catches the rest. Powers of two make bucketing a leading-zeros count.
pub const LATENCY_BUCKETS: usize = 25;

/// A fixed log2-bucket histogram of durations, in relaxed atomics (no lock per request).
#[derive(Debug, Default)]
pub struct Histogram {
    /// `buckets[k]` counts durations in (2^(k-1), 2^k] µs; the last one everything above.
    buckets: [AtomicU64; LATENCY_BUCKETS + 1],
    sum_us: AtomicU64,
}

impl Histogram {
    pub fn record(&self, d: std::time::Duration) {
        let us = d.as_micros().min(u64::MAX as u128) as u64;
        let k = if us <= 1 {
            0
        } else {
            (64 - (us - 1).leading_zeros()) as usize
        };
        self.buckets[k.min(LATENCY_BUCKETS)].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
    }

    /// Per-bucket counts (not cumulative; the last is above the largest bound) and the
    /// sum in microseconds.
    pub fn snapshot(&self) -> (Vec<u64>, u64) {
        (
            self.buckets.iter().map(|b| b.load(Relaxed)).collect(),
            self.sum_us.load(Relaxed),
        )
    }
}

/// Counts a request when made and records its duration when dropped: `let _timer =
/// stats.start(Op::Read);` at the top of a request handler times the whole handler.
#[must_use = "the request is timed until this guard is dropped"]
pub struct OpTimer<'a> {
    stats: &'a Stats,
    op: Op,
    started: std::time::Instant,
}

impl OpTimer<'_> {
    /// Counts the request as failed with `errno`.
    pub fn failed(&self, errno: i32) {
        self.stats.failed(self.op, errno);
    }

    pub fn op(&self) -> Op {
        self.op
    }
}

impl Drop for OpTimer<'_> {
    fn drop(&mut self) {
        self.stats.latency[self.op as usize].record(self.started.elapsed());
    }
}

/// What `hoardfs stats` shows.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Snapshot {
    pub mountpoint: String,
    pub source: String,
    pub cache_dir: String,
    pub requests: BTreeMap<String, u64>,
    /// Failed requests by type, then by errno name (`ENOENT`).
    #[serde(default)]
    pub errors: BTreeMap<String, BTreeMap<String, u64>>,
    pub cache: CacheSnapshot,
    pub inodes: u64,
    pub open_handles: u64,
    pub cache_bytes: u64,
    pub cache_files: u64,
    #[serde(default)]
    pub inode_table: InodeSnapshot,
    #[serde(default)]
    pub cleaner: crate::cleaner::CleanerSnapshot,
    #[serde(default)]
    pub coherence: crate::coherence::CoherenceSnapshot,
    #[serde(default)]
    pub health: crate::health::HealthSnapshot,
}

/// The inode table's size, counters and limits (`inode.rs`; the dynamic-vnodes paper's
/// counters).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(default)]
pub struct InodeSnapshot {
    /// Entries in the table: referenced by the kernel plus free.
    pub entries: u64,
    /// Entries the kernel holds (lookup count above zero).
    pub referenced: u64,
    /// Entries on the free list (forgotten, kept for reuse).
    pub free: u64,
    /// Most entries the table has held at once.
    pub peak: u64,
    pub allocations: u64,
    pub frees: u64,
    /// Lookups that revived an entry from the free list (same node id).
    pub reuses: u64,
    /// Lookups (and creates, links) served by the table.
    pub lookups: u64,
    /// New entries for an object whose entry had recently been freed.
    pub misses_after_free: u64,
    /// Entries the kernel was asked to drop (over the soft maximum).
    pub invalidations: u64,
    pub max_inodes: u64,
    pub free_min: u64,
    pub min_age_ms: u64,
    pub max_age_ms: u64,
    pub freeing: bool,
}

impl Stats {
    pub fn count(&self, op: Op) {
        self.ops[op as usize].fetch_add(1, Relaxed);
    }

    /// Counts `op` and times it until the returned guard is dropped.
    pub fn start(&self, op: Op) -> OpTimer<'_> {
        self.count(op);
        OpTimer {
            stats: self,
            op,
            started: std::time::Instant::now(),
        }
    }

    /// Requests of one type so far.
    pub fn op_count(&self, op: Op) -> u64 {
        self.ops[op as usize].load(Relaxed)
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    pub fn requests(&self) -> BTreeMap<String, u64> {
        Op::ALL
            .iter()
            .map(|op| (op.name().to_string(), self.ops[*op as usize].load(Relaxed)))
            .collect()
    }

    /// Counts a request of type `op` as failed with `errno`.
    pub fn failed(&self, op: Op, errno: i32) {
        let slot = usize::try_from(errno)
            .ok()
            .filter(|&e| e < ERRNOS)
            .unwrap_or(0);
        self.errors[op as usize * ERRNOS + slot].fetch_add(1, Relaxed);
    }

    /// Failed requests: (request type, errno) → count, for those that failed at all.
    pub fn errors(&self) -> Vec<(Op, i32, u64)> {
        let mut out = Vec::new();
        for op in Op::ALL {
            for errno in 0..ERRNOS {
                let n = self.errors[*op as usize * ERRNOS + errno].load(Relaxed);
                if n > 0 {
                    out.push((*op, errno as i32, n));
                }
            }
        }
        out
    }

    /// `errors` by request type and errno name, as `hoardfs stats` shows them.
    pub fn error_table(&self) -> BTreeMap<String, BTreeMap<String, u64>> {
        let mut out: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
        for (op, errno, n) in self.errors() {
            out.entry(op.name().to_string())
                .or_default()
                .insert(errno_name(errno), n);
        }
        out
    }

    pub fn cache_snapshot(&self) -> CacheSnapshot {
        self.cache.snapshot()
    }
}

impl Snapshot {
    /// The human-readable table of `hoardfs stats`.
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(s, "mount       {}", self.mountpoint);
        let h = &self.health;
        let state = if h.online {
            "online".to_string()
        } else {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            format!(
                "OFFLINE{} for {}s ({})",
                if h.manual { " (manual)" } else { "" },
                now.saturating_sub(h.since),
                h.reason
            )
        };
        let _ = writeln!(s, "source      {} — {state}", self.source);
        let _ = writeln!(s, "cache dir   {}", self.cache_dir);
        let _ = writeln!(
            s,
            "cache use   {} bytes in {} files; {} inodes, {} open handles",
            self.cache_bytes, self.cache_files, self.inodes, self.open_handles
        );
        let t = &self.inode_table;
        let _ = writeln!(
            s,
            "\ninode table: {} entries ({} referenced, {} free), peak {}",
            t.entries, t.referenced, t.free, t.peak
        );
        let _ = writeln!(
            s,
            "  limits: max {}, free min {}, min age {:.1}s, max age {:.1}s, freeing {}",
            t.max_inodes,
            t.free_min,
            t.min_age_ms as f64 / 1000.0,
            t.max_age_ms as f64 / 1000.0,
            if t.freeing { "on" } else { "off" }
        );
        for (name, n) in [
            ("allocations", t.allocations),
            ("frees", t.frees),
            ("reuses", t.reuses),
            ("lookups", t.lookups),
            ("misses_after_free", t.misses_after_free),
            ("invalidations", t.invalidations),
        ] {
            let _ = writeln!(s, "  {name:<20} {n:>12}");
        }
        let _ = writeln!(s, "\nrequests that reached the daemon:");
        for (name, n) in self.requests.iter().filter(|(_, n)| **n > 0) {
            let _ = writeln!(s, "  {name:<14} {n:>12}");
        }
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\nrequests that failed, by errno:");
            for (op, by_errno) in &self.errors {
                for (errno, n) in by_errno {
                    let _ = writeln!(s, "  {op:<14} {errno:<14} {n:>12}");
                }
            }
        }
        let _ = writeln!(s, "\ncache:");
        for (name, n) in self.cache.rows() {
            let _ = writeln!(s, "  {name:<20} {n:>12}");
        }
        let h = &self.coherence;
        let ttl = |v: Option<u64>| match v {
            Some(ms) => format!("{:.1}s", ms as f64 / 1000.0),
            None => "auto".into(),
        };
        let _ = writeln!(
            s,
            "\ncoherence: watcher {} ({} dirs), stale check {}, TTLs entry {} attr {} negative {}, open lease {}",
            if h.watching { "on" } else { "off" },
            h.watched_dirs,
            if h.stale_check { "on" } else { "off" },
            ttl(h.entry_ttl_ms),
            ttl(h.attr_ttl_ms),
            ttl(h.negative_ttl_ms),
            ttl(Some(h.open_lease_ms))
        );
        for (name, n) in [
            ("watcher_events", h.watcher_events),
            ("watcher_overflows", h.watcher_overflows),
            ("watch_failures", h.watch_failures),
            ("changes_detected", h.changes_detected),
            ("inval_inode", h.inval_inode),
            ("inval_entry", h.inval_entry),
            ("attr_drops", h.attr_drops),
            ("listing_drops", h.listing_drops),
            ("leases_active", h.leases_active),
            ("leases_granted", h.leases_granted),
            ("leases_expired", h.leases_expired),
            ("callbacks_granted", h.callbacks_granted),
            ("callbacks_broken", h.callbacks_broken),
            ("callback_hits", h.callback_hits),
            ("callback_names", h.callback_names),
            ("listing_hits", h.listing_hits),
            ("open_leases_granted", h.open_leases_granted),
            ("open_lease_hits", h.open_lease_hits),
            ("watched_files", h.watched_files),
        ] {
            let _ = writeln!(s, "  {name:<20} {n:>12}");
        }
        let h = &self.health;
        let _ = writeln!(
            s,
            "\nsource health: timeout {}",
            match h.timeout_ms {
                0 => "none".to_string(),
                ms => format!("{:.1}s", ms as f64 / 1000.0),
            }
        );
        for (name, n) in [
            ("went_offline", h.went_offline),
            ("went_online", h.went_online),
            ("timeouts", h.timeouts),
            ("stuck_calls", h.stuck_calls),
            ("probes", h.probes),
            ("offline_requests", h.offline_requests),
            ("log_pending", h.log_pending),
            ("log_replayed", h.log_replayed),
            ("conflicts", h.conflicts),
        ] {
            let _ = writeln!(s, "  {name:<20} {n:>12}");
        }
        let c = &self.cleaner;
        let _ = writeln!(
            s,
            "\ncleaner: limit {} bytes, high {} low {}, min free {}",
            c.limit_bytes, c.high_watermark_bytes, c.low_watermark_bytes, c.min_free_bytes
        );
        for (name, n) in [
            ("used_bytes", c.used_bytes),
            ("pinned_bytes", c.pinned_bytes),
            ("cleans", c.cleans),
            ("evicted_files", c.evicted_files),
            ("evicted_chunks", c.evicted_chunks),
            ("evicted_bytes", c.evicted_bytes),
            ("not_cached_when_full", c.chunks_not_cached_when_full),
        ] {
            let _ = writeln!(s, "  {name:<20} {n:>12}");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn latency_buckets_are_powers_of_two_microseconds() {
        let h = Histogram::default();
        for us in [0, 1, 2, 3, 4, 5, 1024, 1025] {
            h.record(Duration::from_micros(us));
        }
        h.record(Duration::from_secs(3600));
        let (b, sum) = h.snapshot();
        assert_eq!(&b[..4], &[2, 1, 2, 1], "<=1, <=2, <=4, <=8 µs");
        assert_eq!(b[10], 1, "1024 µs is in the 2^10 bucket");
        assert_eq!(b[11], 1, "1025 µs is in the 2^11 bucket");
        assert_eq!(b[LATENCY_BUCKETS], 1, "an hour is above every bound");
        assert_eq!(sum, 1 + 2 + 3 + 4 + 5 + 1024 + 1025 + 3_600_000_000);
    }

    #[test]
    fn a_timer_counts_and_times_its_request() {
        let s = Stats::default();
        drop(s.start(Op::Read));
        assert_eq!(s.op_count(Op::Read), 1);
        let (b, _) = s.latency[Op::Read as usize].snapshot();
        assert_eq!(b.iter().sum::<u64>(), 1);
    }

    #[test]
    fn failed_requests_are_counted_by_type_and_errno() {
        let s = Stats::default();
        for errno in [libc::ENOENT, libc::ENOENT, libc::EIO, 9999] {
            s.start(Op::Lookup).failed(errno);
        }
        s.start(Op::Read).failed(libc::ESTALE);
        let t = s.error_table();
        assert_eq!(t["lookup"]["ENOENT"], 2);
        assert_eq!(t["lookup"]["EIO"], 1);
        assert_eq!(t["lookup"]["other"], 1, "out of the table's range");
        assert_eq!(t["read"]["ESTALE"], 1);
        assert_eq!(t.len(), 2);
        assert_eq!(errno_name(libc::ENOTEMPTY), "ENOTEMPTY");
        assert_eq!(errno_name(200), "E200");
    }
}

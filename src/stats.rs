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
    Opendir => "opendir", Readdir => "readdir", Releasedir => "releasedir",
    Fsyncdir => "fsyncdir", Statfs => "statfs", Setxattr => "setxattr",
    Getxattr => "getxattr", Listxattr => "listxattr", Removexattr => "removexattr",
    Access => "access", Create => "create", Getlk => "getlk", Setlk => "setlk",
    Fallocate => "fallocate", Lseek => "lseek",
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
        }
    };
}

counters! {
    open_hits: "opens of regular files whose data was fully cached and valid",
    open_misses: "opens of regular files that needed data from the source",
    passthrough_opens: "opens answered with FUSE passthrough to the cache file",
    read_hits: "read requests served entirely from the cache",
    read_misses: "read requests that fetched from the source",
    bytes_from_cache: "bytes returned by the daemon from cache files",
    bytes_from_source: "bytes read from the source (fetches and uncached reads)",
    bytes_written: "bytes written through to the source",
    chunks_fetched: "chunks fetched from the source into the cache",
    stale_invalidations: "cached files dropped because the source changed",
    corrupt_records: "cache records found torn or corrupt and discarded",
    cache_errors: "cache I/O errors (the request was served from the source)",
    checkpoints: "durable record updates",
}

#[derive(Debug)]
pub struct Stats {
    ops: Vec<AtomicU64>,
    pub cache: CacheCounters,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            ops: Op::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
            cache: CacheCounters::default(),
        }
    }
}

/// What `hoardfs stats` shows.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Snapshot {
    pub mountpoint: String,
    pub source: String,
    pub cache_dir: String,
    pub requests: BTreeMap<String, u64>,
    pub cache: CacheSnapshot,
    pub inodes: u64,
    pub open_handles: u64,
    pub cache_bytes: u64,
    pub cache_files: u64,
}

impl Stats {
    pub fn count(&self, op: Op) {
        self.ops[op as usize].fetch_add(1, Relaxed);
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
        let _ = writeln!(s, "source      {}", self.source);
        let _ = writeln!(s, "cache dir   {}", self.cache_dir);
        let _ = writeln!(
            s,
            "cache use   {} bytes in {} files; {} inodes, {} open handles",
            self.cache_bytes, self.cache_files, self.inodes, self.open_handles
        );
        let _ = writeln!(s, "\nrequests that reached the daemon:");
        for (name, n) in self.requests.iter().filter(|(_, n)| **n > 0) {
            let _ = writeln!(s, "  {name:<14} {n:>12}");
        }
        let _ = writeln!(s, "\ncache:");
        for (name, n) in self.cache.rows() {
            let _ = writeln!(s, "  {name:<20} {n:>12}");
        }
        s
    }
}

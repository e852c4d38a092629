//! The persistent cache: a data tree that mirrors the source's names (browsable, readable
//! without hoardfs) and a parallel tree of per-file records (`record`).
//!
//! ```text
//! CACHE_DIR/FORMAT        "hoardfs cache 1"
//! CACHE_DIR/lock          flock'ed by the one daemon that uses this cache
//! CACHE_DIR/data/<path>   cached bytes at their source offsets (sparse where absent)
//! CACHE_DIR/meta/<path>   the record of data/<path> (see record.rs)
//! CACHE_DIR/dirs/<hash>   a directory's listing with attributes, for offline use (listing.rs)
//! CACHE_DIR/source.json   the kind of file system and root the cache was filled from
//! CACHE_DIR/oplog/        changes made offline, waiting for replay (oplog.rs)
//! CACHE_DIR/pins          paths the cleaner never evicts (cleaner.rs)
//! CACHE_DIR/hoardfs.log   the daemon's log (when it runs in the background)
//! CACHE_DIR/conflicts.log, lost+found/   what offline replay could not apply
//! ```
//!
//! The root is opened once and every entry above is reached beneath it without following
//! links, with modes 0600/0700 (`store.rs`; docs/security.md C1-C5).

pub mod files;
pub mod listing;
pub mod reaper;
pub mod record;
pub mod removals;
pub mod source_info;
pub mod store;
pub mod warm;

pub use record::{CacheRecord, SourceIdentity};
pub use store::CacheStore;

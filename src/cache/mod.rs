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
//! ```

pub mod listing;
pub mod record;
pub mod source_info;
pub mod store;

pub use record::{CacheRecord, SourceIdentity};
pub use store::CacheStore;

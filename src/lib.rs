//! hoardfs: a persistent caching file system. See docs/ARCHITECTURE.md for the tour.

pub mod cache;
pub mod cleaner;
pub mod cli;
pub mod coherence;
pub mod config;
pub mod config_file;
pub mod control;
pub mod descriptors;
pub mod fetch;
pub mod fetch_pool;
pub mod fs;
pub mod fuse_adapter;
pub mod health;
pub mod inode;
pub mod kernel_notify;
pub mod logging;
pub mod manpage;
pub mod metrics;
pub mod mounts;
/// Sources on S3-compatible object stores, with the `s3` feature: the client
/// (`object_source`) and the POSIX tree over it (`object_tree`, the object store's
/// `source::SourceTree`). Without the feature neither exists: the core knows sources only
/// as `SourceTree`s and their capabilities, and `Config::check_values` refuses an `s3://`
/// source.
#[cfg(feature = "s3")]
pub mod object_source;
#[cfg(feature = "s3")]
pub mod object_tree;
pub mod oplog;
pub mod options;
pub mod run;
pub mod sd_notify;
pub mod source;
pub mod stats;
pub mod sync;
pub mod threads;
pub mod warm;

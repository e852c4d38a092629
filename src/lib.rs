//! hoardfs: a persistent caching file system. See docs/ARCHITECTURE.md for the tour.

pub mod cache;
pub mod cleaner;
pub mod cli;
pub mod coherence;
pub mod config;
pub mod config_file;
pub mod control;
pub mod fetch;
pub mod fs;
pub mod fuse_adapter;
pub mod health;
pub mod inode;
pub mod logging;
pub mod manpage;
pub mod metrics;
pub mod mounts;
pub mod object_source;
pub mod object_tree;
pub mod oplog;
pub mod options;
pub mod run;
pub mod sd_notify;
pub mod source;
pub mod stats;
pub mod warm;

//! `object_tree` in a build without the `s3` feature (`cargo build --no-default-features`).
//!
//! `ObjectTree` is an enum without variants: no value of it can exist, so every object-store
//! branch of the core (`GuardedSource::is_object` is then always false) is statically
//! unreachable, and each method below is a `match` with no arms, which the compiler checks.
//! Nothing here answers a call: an `s3://` source is refused before mounting
//! (`Config::check_values`). The signatures are those of `object_tree.rs` that the core
//! calls: a change of one there must be made here too, or this build fails (`.ci/run`
//! builds it).

use std::ffi::OsStr;
use std::io;
use std::path::Path;
use std::time::SystemTime;

use crate::source::{DirEntry, SetAttr, Stat};

pub use crate::source::SourceReader;

/// An object-store source, which this build cannot have.
pub enum ObjectTree {}

impl ObjectTree {
    pub fn default_owner(&self) -> (u32, u32) {
        match *self {}
    }

    pub fn stat(&self, _rel: &Path) -> io::Result<Stat> {
        match *self {}
    }

    pub fn stat_children(&self, _dir: &Path, _names: &[&OsStr]) -> Vec<io::Result<Stat>> {
        match *self {}
    }

    pub fn read_dir(&self, _rel: &Path) -> io::Result<Vec<DirEntry>> {
        match *self {}
    }

    pub fn open_reader(
        &self,
        _rel: &Path,
        _size: u64,
        _ctime: (i64, u32),
    ) -> io::Result<SourceReader> {
        match *self {}
    }

    pub fn mkdir(&self, _rel: &Path, _mode: u32, _owner: (u32, u32)) -> io::Result<Stat> {
        match *self {}
    }

    pub fn unlink(&self, _rel: &Path) -> io::Result<()> {
        match *self {}
    }

    pub fn rmdir(&self, _rel: &Path) -> io::Result<()> {
        match *self {}
    }

    pub fn rename(&self, _from: &Path, _to: &Path, _flags: u32) -> io::Result<()> {
        match *self {}
    }

    pub fn set_attr(&self, _rel: &Path, _attr: &SetAttr) -> io::Result<Stat> {
        match *self {}
    }

    pub fn upload(
        &self,
        _rel: &Path,
        _file: &std::fs::File,
        _keep: Option<&Stat>,
        _mtime: SystemTime,
    ) -> io::Result<Stat> {
        match *self {}
    }

    pub fn read_at(
        &self,
        _rel: &Path,
        _etag: Option<&str>,
        _len: usize,
        _offset: u64,
    ) -> io::Result<Vec<u8>> {
        match *self {}
    }

    pub fn read_into(
        &self,
        _rel: &Path,
        _etag: Option<&str>,
        _len: usize,
        _offset: u64,
        _sink: &mut dyn FnMut(u64, &[u8]) -> io::Result<()>,
    ) -> io::Result<u64> {
        match *self {}
    }

    pub fn statvfs(&self) -> libc::statvfs {
        match *self {}
    }

    pub fn probe(&self) -> io::Result<()> {
        match *self {}
    }
}

//! An object store seen as a POSIX tree: the calls `GuardedSource` makes of a source,
//! answered over `ObjectSource` with `Stat`s and errnos (docs/SEMANTICS.md).
//!
//! It is the object store's `SourceTree`. The core caches it like a directory, with the
//! differences its `Capabilities` declare: there are no descriptors (a file is read by
//! ranged GETs that name the version they expect, `SourceReader::Object`), and a file
//! cannot be written in place, so written files are uploaded whole from the cache on close
//! and fsync (`fs/object.rs`). Everything else maps call for call; what cannot be
//! expressed answers a plain errno: hard links, symlinks and device nodes `EPERM`, a
//! directory rename `EXDEV` (so `mv` copies), extended attributes `EOPNOTSUPP`.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::SystemTime;

use std::fs::File;
use std::os::fd::{BorrowedFd, OwnedFd};

use rustix::fs::OFlags;

use crate::object_source::{ObjKind, ObjMeta, ObjStat, ObjectSource};
use crate::source::{Capabilities, DirEntry, SetAttr, SourceTree, Stat, TimeSpec};

/// HEADs in flight for one listing's attributes (readdirplus).
const STAT_PARALLEL: usize = 16;

fn errno(n: i32) -> io::Error {
    io::Error::from_raw_os_error(n)
}

pub use crate::source::SourceReader;

pub struct ObjectTree {
    pub store: ObjectSource,
    /// Owner of objects without s3fs/rclone owner metadata: the daemon's.
    owner: (u32, u32),
    /// The ETag behind the last stat of each path, keyed by what the stat showed (size and
    /// ctime, whose nanoseconds digest the ETag): a reader of the version a stat showed
    /// needs no HEAD of its own, and cannot be handed a newer version than the one the
    /// cache records. Bounded: cleared when full.
    etags: Mutex<HashMap<PathBuf, (Version, String)>>,
}

/// What a `Stat` shows of an object's version.
type Version = (u64, (i64, u32));

/// Paths whose ETag `ObjectTree` remembers at most.
const ETAGS_KEPT: usize = 16 << 10;

impl ObjectTree {
    pub fn new(store: ObjectSource) -> ObjectTree {
        let owner = (
            rustix::process::geteuid().as_raw(),
            rustix::process::getegid().as_raw(),
        );
        ObjectTree {
            store,
            owner,
            etags: Mutex::default(),
        }
    }

    pub fn default_owner(&self) -> (u32, u32) {
        self.owner
    }

    fn key(&self, rel: &Path) -> io::Result<String> {
        self.store.key_of(rel)
    }

    /// The POSIX view of `st`; a file's ETag is remembered for `open_reader`.
    fn posix(&self, rel: &Path, st: &ObjStat) -> io::Result<Stat> {
        let posix = st.posix(&self.key(rel)?, self.owner);
        if let (ObjKind::File, Some(etag)) = (st.kind, &st.etag) {
            let mut etags = self.etags.lock().unwrap();
            if etags.len() >= ETAGS_KEPT {
                etags.clear();
            }
            etags.insert(rel.to_path_buf(), ((posix.size, posix.ctime), etag.clone()));
        }
        Ok(posix)
    }

    /// At start: the bucket (and prefix) can be listed.
    pub fn check_root(&self) -> io::Result<Stat> {
        self.store.check_root()?;
        self.stat(Path::new(""))
    }

    pub fn stat(&self, rel: &Path) -> io::Result<Stat> {
        let st = self.store.stat(rel)?;
        self.posix(rel, &st)
    }

    /// One HEAD per name: a listing carries no user metadata, and the attributes a
    /// readdirplus hands out must be the ones a lookup gives. The HEADs of a large listing
    /// go out `STAT_PARALLEL` at a time: each is a round trip that mostly waits.
    pub fn stat_children(&self, dir: &Path, names: &[&OsStr]) -> Vec<io::Result<Stat>> {
        let stat_one = |n: &OsStr| match n.to_str() {
            Some(".") => self.stat(dir),
            Some("..") => self.stat(dir.parent().unwrap_or(Path::new(""))),
            _ => self.stat(&dir.join(n)),
        };
        if names.len() < 2 {
            return names.iter().map(|n| stat_one(n)).collect();
        }
        let next = AtomicUsize::new(0);
        let out: Vec<OnceLock<io::Result<Stat>>> = names.iter().map(|_| OnceLock::new()).collect();
        std::thread::scope(|s| {
            for _ in 0..STAT_PARALLEL.min(names.len()) {
                s.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(n) = names.get(i) else { return };
                        let _ = out[i].set(stat_one(n));
                    }
                });
            }
        });
        out.into_iter()
            .map(|r| r.into_inner().expect("every name was stat'ed"))
            .collect()
    }

    pub fn read_dir(&self, rel: &Path) -> io::Result<Vec<DirEntry>> {
        let entries = self.store.list_dir(rel)?;
        entries
            .into_iter()
            .map(|(name, st)| {
                let key = self.key(&rel.join(&name))?;
                Ok(DirEntry {
                    ino: crate::object_source::ino_of(&key, st.kind),
                    file_type: match st.kind {
                        ObjKind::File => libc::S_IFREG,
                        ObjKind::Dir => libc::S_IFDIR,
                    },
                    name: name.into(),
                })
            })
            .collect()
    }

    /// A reader of the version of `rel` that showed `size` and `ctime` (what the cache
    /// records of it): by the ETag the stat that showed it saw, else by a HEAD, which must
    /// show the same version (`ESTALE` if the object changed since).
    pub fn open_reader(
        &self,
        rel: &Path,
        size: u64,
        ctime: (i64, u32),
    ) -> io::Result<SourceReader> {
        let reader = |etag| SourceReader::Object {
            rel: rel.to_path_buf(),
            etag: Some(etag),
        };
        if let Some((v, etag)) = self.etags.lock().unwrap().get(rel)
            && *v == (size, ctime)
        {
            return Ok(reader(etag.clone()));
        }
        let st = self.stat(rel)?;
        if !st.is_file() {
            return Err(errno(libc::EISDIR));
        }
        if (st.size, st.ctime) != (size, ctime) {
            return Err(errno(libc::ESTALE));
        }
        match self.etags.lock().unwrap().get(rel) {
            Some((v, etag)) if *v == (size, ctime) => Ok(reader(etag.clone())),
            // A server that sends no ETag: reads cannot name the version.
            _ => Ok(SourceReader::Object {
                rel: rel.to_path_buf(),
                etag: None,
            }),
        }
    }

    pub fn mkdir(&self, rel: &Path, mode: u32, owner: (u32, u32)) -> io::Result<Stat> {
        let meta = ObjMeta {
            mode: Some(mode & 0o7777),
            uid: Some(owner.0),
            gid: Some(owner.1),
            mtime: Some(SystemTime::now()),
        };
        let st = self.store.mkdir(rel, &meta)?;
        self.posix(rel, &st)
    }

    /// S3 deletes missing keys without complaint: the stat first gives `ENOENT`/`EISDIR`.
    pub fn unlink(&self, rel: &Path) -> io::Result<()> {
        match self.store.stat(rel)?.kind {
            ObjKind::Dir => Err(errno(libc::EISDIR)),
            ObjKind::File => {
                self.store.delete(rel)?;
                self.keep_parent(rel)
            }
        }
    }

    /// A directory that is only a prefix (no `dir/` marker) vanishes with its last key;
    /// on a file system it stays, empty, until rmdir (which `rm -r` and `mv`'s copy
    /// fallback count on). So it gets a marker when its last entry leaves.
    fn keep_parent(&self, rel: &Path) -> io::Result<()> {
        let Some(parent) = rel.parent().filter(|p| !p.as_os_str().is_empty()) else {
            return Ok(());
        };
        match self.store.stat(parent) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                let meta = ObjMeta {
                    mtime: Some(SystemTime::now()),
                    ..Default::default()
                };
                match self.store.mkdir(parent, &meta) {
                    Err(e) if e.raw_os_error() != Some(libc::EEXIST) => Err(e),
                    _ => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }

    pub fn rmdir(&self, rel: &Path) -> io::Result<()> {
        self.store.rmdir(rel)?;
        self.keep_parent(rel)
    }

    /// Copy + delete of one file; `RENAME_EXCHANGE` cannot be expressed (`EINVAL`).
    pub fn rename(&self, from: &Path, to: &Path, flags: u32) -> io::Result<()> {
        if flags & libc::RENAME_EXCHANGE != 0 {
            return Err(errno(libc::EINVAL));
        }
        if flags & libc::RENAME_NOREPLACE != 0 {
            match self.store.stat(to) {
                Ok(_) => return Err(errno(libc::EEXIST)),
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(e),
            }
        }
        if from == to {
            return self.store.stat(from).map(|_| ());
        }
        self.store.rename_file(from, to)?;
        self.keep_parent(from)
    }

    /// Mode, owner and mtime as metadata (a copy of the object onto itself); atime is not
    /// kept. Sizes are the caller's business (the cache file is uploaded).
    pub fn set_attr(&self, rel: &Path, attr: &SetAttr) -> io::Result<Stat> {
        let mtime = attr.mtime.map(|t| match t {
            TimeSpec::Now => SystemTime::now(),
            TimeSpec::At(s, ns) => {
                if s >= 0 {
                    SystemTime::UNIX_EPOCH + std::time::Duration::new(s as u64, ns)
                } else {
                    SystemTime::UNIX_EPOCH - std::time::Duration::from_secs(s.unsigned_abs())
                        + std::time::Duration::from_nanos(ns.into())
                }
            }
        });
        let update = ObjMeta {
            mode: attr.mode.map(|m| m & 0o7777),
            uid: attr.uid,
            gid: attr.gid,
            mtime,
        };
        if update == ObjMeta::default() {
            return self.stat(rel);
        }
        let st = self.store.set_meta(rel, &update)?;
        self.posix(rel, &st)
    }

    /// Uploads `file` as `rel`, keeping the object's mode and owner and setting its mtime
    /// to `mtime`. Returns the new object's stat.
    pub fn upload(
        &self,
        rel: &Path,
        file: &std::fs::File,
        keep: Option<&Stat>,
        mtime: SystemTime,
    ) -> io::Result<Stat> {
        let meta = ObjMeta {
            mode: keep.map(|s| s.mode & 0o7777),
            uid: keep.map(|s| s.uid),
            gid: keep.map(|s| s.gid),
            mtime: Some(mtime),
        };
        let st = self.store.put(rel, file, &meta)?;
        self.posix(rel, &st)
    }

    pub fn read_at(
        &self,
        rel: &Path,
        etag: Option<&str>,
        len: usize,
        offset: u64,
    ) -> io::Result<Vec<u8>> {
        Ok(self
            .store
            .read_range(rel, offset, len as u64, etag)?
            .to_vec())
    }

    /// `read_at`, the bytes handed to `sink(offset, bytes)` as they arrive.
    pub fn read_into(
        &self,
        rel: &Path,
        etag: Option<&str>,
        len: usize,
        offset: u64,
        sink: &mut dyn FnMut(u64, &[u8]) -> io::Result<()>,
    ) -> io::Result<u64> {
        self.store
            .read_range_into(rel, offset, len as u64, etag, sink)
    }

    /// No sizes to report: a large, mostly free file system, so that `df` and writers
    /// checking free space carry on.
    pub fn statvfs(&self) -> libc::statvfs {
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        s.f_bsize = 1 << 20;
        s.f_frsize = 4096;
        s.f_blocks = 1 << 40 >> 12;
        s.f_bfree = s.f_blocks;
        s.f_bavail = s.f_blocks;
        s.f_files = 1 << 32;
        s.f_ffree = 1 << 32;
        s.f_favail = 1 << 32;
        s.f_namemax = 1024;
        s
    }

    pub fn probe(&self) -> io::Result<()> {
        self.store.probe()
    }
}

/// What an object store cannot express answers a plain errno here: descriptors `ENOTSUP`,
/// hard links, symlinks and device nodes `EPERM`, `readlink` `EINVAL` (there are no
/// symlinks), extended attributes `EOPNOTSUPP` (and an empty list).
impl SourceTree for ObjectTree {
    fn capabilities(&self) -> Capabilities {
        Capabilities::OBJECT_STORE
    }

    fn probe(&self) -> io::Result<()> {
        ObjectTree::probe(self)
    }

    fn stat(&self, rel: &Path) -> io::Result<Stat> {
        ObjectTree::stat(self, rel)
    }

    fn stat_children(&self, dir: &Path, names: &[&OsStr]) -> io::Result<Vec<io::Result<Stat>>> {
        Ok(ObjectTree::stat_children(self, dir, names))
    }

    fn read_dir(&self, rel: &Path) -> io::Result<Vec<DirEntry>> {
        ObjectTree::read_dir(self, rel)
    }

    fn statvfs(&self) -> io::Result<libc::statvfs> {
        Ok(ObjectTree::statvfs(self))
    }

    fn open_reader(&self, rel: &Path, size: u64, ctime: (i64, u32)) -> io::Result<SourceReader> {
        ObjectTree::open_reader(self, rel, size, ctime)
    }

    fn openat(&self, _rel: &Path, _flags: OFlags, _mode: u32) -> io::Result<OwnedFd> {
        Err(errno(libc::ENOTSUP))
    }

    fn dir(&self, _rel: &Path) -> io::Result<OwnedFd> {
        Err(errno(libc::ENOTSUP))
    }

    fn open_file(&self, _rel: &Path, _flags: i32) -> io::Result<File> {
        Err(errno(libc::ENOTSUP))
    }

    fn create_file(&self, _rel: &Path, _flags: i32, _mode: u32) -> io::Result<File> {
        Err(errno(libc::ENOTSUP))
    }

    fn mkdir(&self, rel: &Path, mode: u32) -> io::Result<()> {
        ObjectTree::mkdir(self, rel, mode, self.owner).map(|_| ())
    }

    fn mknod(&self, _rel: &Path, _mode: u32, _rdev: u64) -> io::Result<()> {
        Err(errno(libc::EPERM))
    }

    fn symlink(&self, _target: &Path, _rel: &Path) -> io::Result<()> {
        Err(errno(libc::EPERM))
    }

    fn readlink(&self, _rel: &Path) -> io::Result<Vec<u8>> {
        Err(errno(libc::EINVAL))
    }

    fn unlink(&self, rel: &Path) -> io::Result<()> {
        ObjectTree::unlink(self, rel)
    }

    fn rmdir(&self, rel: &Path) -> io::Result<()> {
        ObjectTree::rmdir(self, rel)
    }

    fn rename(&self, from: &Path, to: &Path, flags: u32) -> io::Result<()> {
        ObjectTree::rename(self, from, to, flags)
    }

    fn link(&self, _from: &Path, _to: &Path) -> io::Result<()> {
        Err(errno(libc::EPERM))
    }

    /// By name only: there is no descriptor to change.
    fn set_attr(
        &self,
        rel: Option<&Path>,
        _fd: Option<BorrowedFd<'_>>,
        attr: &SetAttr,
    ) -> io::Result<()> {
        let rel = rel.ok_or_else(|| errno(libc::ENOENT))?;
        ObjectTree::set_attr(self, rel, attr).map(|_| ())
    }

    fn chown_new(&self, rel: &Path, uid: u32, gid: Option<u32>) -> io::Result<()> {
        let attr = SetAttr {
            uid: Some(uid),
            gid,
            ..Default::default()
        };
        ObjectTree::set_attr(self, rel, &attr).map(|_| ())
    }

    fn getxattr(&self, _rel: &Path, _name: &OsStr, _size: usize) -> io::Result<Vec<u8>> {
        Err(errno(libc::EOPNOTSUPP))
    }

    fn listxattr(&self, _rel: &Path, _size: usize) -> io::Result<Vec<u8>> {
        Ok(Vec::new())
    }

    fn setxattr(&self, _rel: &Path, _name: &OsStr, _value: &[u8], _flags: i32) -> io::Result<()> {
        Err(errno(libc::EOPNOTSUPP))
    }

    fn removexattr(&self, _rel: &Path, _name: &OsStr) -> io::Result<()> {
        Err(errno(libc::EOPNOTSUPP))
    }

    fn mkdir_owned(&self, rel: &Path, mode: u32, owner: (u32, u32)) -> io::Result<Stat> {
        ObjectTree::mkdir(self, rel, mode, owner)
    }

    fn rewrite_attr(&self, rel: &Path, attr: &SetAttr) -> io::Result<Stat> {
        ObjectTree::set_attr(self, rel, attr)
    }

    fn upload(
        &self,
        rel: &Path,
        file: &File,
        keep: Option<&Stat>,
        mtime: SystemTime,
    ) -> io::Result<Stat> {
        ObjectTree::upload(self, rel, file, keep, mtime)
    }

    fn read_range(
        &self,
        rel: &Path,
        etag: Option<&str>,
        len: usize,
        offset: u64,
    ) -> io::Result<Vec<u8>> {
        self.read_at(rel, etag, len, offset)
    }

    fn read_range_into(
        &self,
        rel: &Path,
        etag: Option<&str>,
        len: usize,
        offset: u64,
        sink: &mut dyn FnMut(u64, &[u8]) -> io::Result<()>,
    ) -> io::Result<u64> {
        self.read_into(rel, etag, len, offset, sink)
    }
}

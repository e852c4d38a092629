//! One trait for every kind of source (`SourceTree`), whose calls `GuardedSource` wraps in
//! its single call path (timeout, offline refusal), and its implementation for a directory
//! tree (`PosixTree`, over `BeneathRoot`). The object store's is in `object_tree.rs`.
//!
//! The methods are the POSIX calls the core makes, with `BeneathRoot`'s signatures. A kind
//! that cannot do one answers a plain errno from its own implementation, and says so in
//! its `Capabilities`, which the core asks before it relies on one. The few calls only an
//! object store answers (whole uploads, reads by version, metadata rewrites) default to
//! `ENOTSUP`.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

use rustix::fs::OFlags;

use super::{BeneathRoot, Capabilities, DirEntry, SetAttr, SourceReader, Stat};

fn errno(n: i32) -> io::Error {
    io::Error::from_raw_os_error(n)
}

/// A source the cache mirrors, seen as a POSIX tree; paths are relative to its root.
pub trait SourceTree: Send + Sync {
    /// What this source can do; fixed for its life.
    fn capabilities(&self) -> Capabilities;

    /// Checks that the source answers (and, for a directory, that its path still leads to
    /// the tree mounted at start, taking up one mounted anew).
    fn probe(&self) -> io::Result<()>;

    fn stat(&self, rel: &Path) -> io::Result<Stat>;
    fn stat_children(&self, dir: &Path, names: &[&OsStr]) -> io::Result<Vec<io::Result<Stat>>>;
    fn read_dir(&self, rel: &Path) -> io::Result<Vec<DirEntry>>;
    fn statvfs(&self) -> io::Result<libc::statvfs>;

    /// A reader of the file at `rel` for fetching, of the version that showed `size` and
    /// `ctime` (what the cache records) where the source can name versions.
    fn open_reader(&self, rel: &Path, size: u64, ctime: (i64, u32)) -> io::Result<SourceReader>;

    // Descriptors (`Capabilities::descriptors`).
    fn openat(&self, rel: &Path, flags: OFlags, mode: u32) -> io::Result<OwnedFd>;
    fn dir(&self, rel: &Path) -> io::Result<OwnedFd>;
    fn open_file(&self, rel: &Path, flags: i32) -> io::Result<File>;
    fn create_file(&self, rel: &Path, flags: i32, mode: u32) -> io::Result<File>;

    // Names.
    fn mkdir(&self, rel: &Path, mode: u32) -> io::Result<()>;
    fn mknod(&self, rel: &Path, mode: u32, rdev: u64) -> io::Result<()>;
    fn symlink(&self, target: &Path, rel: &Path) -> io::Result<()>;
    fn readlink(&self, rel: &Path) -> io::Result<Vec<u8>>;
    fn unlink(&self, rel: &Path) -> io::Result<()>;
    fn rmdir(&self, rel: &Path) -> io::Result<()>;
    fn rename(&self, from: &Path, to: &Path, flags: u32) -> io::Result<()>;
    fn link(&self, from: &Path, to: &Path) -> io::Result<()>;

    // Attributes.
    fn set_attr(
        &self,
        rel: Option<&Path>,
        fd: Option<BorrowedFd<'_>>,
        attr: &SetAttr,
    ) -> io::Result<()>;
    fn chown_new(&self, rel: &Path, uid: u32, gid: Option<u32>) -> io::Result<()>;
    fn getxattr(&self, rel: &Path, name: &OsStr, size: usize) -> io::Result<Vec<u8>>;
    fn listxattr(&self, rel: &Path, size: usize) -> io::Result<Vec<u8>>;
    fn setxattr(&self, rel: &Path, name: &OsStr, value: &[u8], flags: i32) -> io::Result<()>;
    fn removexattr(&self, rel: &Path, name: &OsStr) -> io::Result<()>;

    // Where files are not written in place (`Capabilities::in_place_writes` false).

    /// Creates the directory `rel` owned by `owner`, in one request; its stat.
    fn mkdir_owned(&self, _rel: &Path, _mode: u32, _owner: (u32, u32)) -> io::Result<Stat> {
        Err(errno(libc::ENOTSUP))
    }

    /// Mode, owner and mtime of `rel` (a rewrite); the stat after it.
    fn rewrite_attr(&self, _rel: &Path, _attr: &SetAttr) -> io::Result<Stat> {
        Err(errno(libc::ENOTSUP))
    }

    /// Uploads `file` whole as `rel`, keeping `keep`'s mode and owner, with `mtime`.
    fn upload(
        &self,
        _rel: &Path,
        _file: &File,
        _keep: Option<&Stat>,
        _mtime: SystemTime,
    ) -> io::Result<Stat> {
        Err(errno(libc::ENOTSUP))
    }

    // Reads by request (`SourceReader::Object`, `Capabilities::reads_by_request`).

    /// Up to `len` bytes at `offset` of `rel` as of `etag` (fewer only at its end).
    fn read_range(
        &self,
        _rel: &Path,
        _etag: Option<&str>,
        _len: usize,
        _offset: u64,
    ) -> io::Result<Vec<u8>> {
        Err(errno(libc::ENOTSUP))
    }

    /// `read_range`, the bytes handed to `sink(offset, bytes)` as they arrive; how many.
    fn read_range_into(
        &self,
        _rel: &Path,
        _etag: Option<&str>,
        _len: usize,
        _offset: u64,
        _sink: &mut dyn FnMut(u64, &[u8]) -> io::Result<()>,
    ) -> io::Result<u64> {
        Err(errno(libc::ENOTSUP))
    }
}

/// A directory tree as the source: `BeneathRoot` calls, and the probe that notices a
/// vanished source and takes up one mounted anew.
pub struct PosixTree {
    /// Replaced when a network or FUSE source is mounted anew after a failure: the old
    /// descriptor then leads to a dead connection forever. `None` after an offline start
    /// with the source unreachable, until the probe finds it.
    root: RwLock<Option<Arc<BeneathRoot>>>,
    /// The source's path, and the (dev, ino) and file system type it led to.
    path: PathBuf,
    root_id: Mutex<(u64, u64)>,
    fs_type: i64,
    remote: bool,
}

impl PosixTree {
    /// The tree at `path`, open as `root` (`None`: unreachable at start), which led to
    /// `root_id` on a file system of `fs_type`; `remote`: a network or FUSE one.
    pub fn new(
        root: Option<BeneathRoot>,
        path: &Path,
        root_id: (u64, u64),
        fs_type: i64,
        remote: bool,
    ) -> PosixTree {
        PosixTree {
            root: RwLock::new(root.map(Arc::new)),
            path: path.to_path_buf(),
            root_id: Mutex::new(root_id),
            fs_type,
            remote,
        }
    }

    /// The root; `EIO` (as offline) while the source was never reached.
    fn root(&self) -> io::Result<Arc<BeneathRoot>> {
        self.root
            .read()
            .unwrap()
            .clone()
            .ok_or_else(|| errno(libc::EIO))
    }
}

impl SourceTree for PosixTree {
    fn capabilities(&self) -> Capabilities {
        Capabilities::posix(self.remote)
    }

    /// A network or FUSE source mounted anew at its path (a restarted sshfs) is taken up
    /// again; a local one only if it is the very directory the cache was filled from.
    fn probe(&self) -> io::Result<()> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(&self.path)?;
        if !m.is_dir() {
            return Err(io::Error::other("the source path is not a directory"));
        }
        let now = (m.dev(), m.ino(), rustix::fs::statfs(&self.path)?.f_type);
        let root_id = *self.root_id.lock().unwrap();
        let attached = self.root.read().unwrap().is_some();
        let through_root = self.root().and_then(|r| r.stat(Path::new("")));
        match through_root {
            Ok(st) if (st.dev, st.ino) == root_id && (now.0, now.1) == root_id => Ok(()),
            // Mounted anew (a restarted sshfs), or found after an offline start: a network
            // or FUSE source must be that kind of file system again (not the empty mount
            // point); a local one the very directory the cache was filled from.
            _ if (self.remote && now.2 == self.fs_type && (now.0, now.1) != root_id)
                || (!attached && (now.0, now.1) == root_id) =>
            {
                let fresh = BeneathRoot::open(&self.path)?;
                tracing::info!("the source is at {} again: using it", self.path.display());
                *self.root.write().unwrap() = Some(Arc::new(fresh));
                *self.root_id.lock().unwrap() = (now.0, now.1);
                Ok(())
            }
            _ if !attached => Err(io::Error::other(
                "the source path does not lead to the source yet",
            )),
            Ok(_) => Err(io::Error::other(
                "the source path no longer leads to the mounted source",
            )),
            Err(e) => Err(e),
        }
    }

    fn stat(&self, rel: &Path) -> io::Result<Stat> {
        self.root()?.stat(rel)
    }

    fn stat_children(&self, dir: &Path, names: &[&OsStr]) -> io::Result<Vec<io::Result<Stat>>> {
        self.root()?.stat_children(dir, names)
    }

    fn read_dir(&self, rel: &Path) -> io::Result<Vec<DirEntry>> {
        self.root()?.read_dir(rel)
    }

    fn statvfs(&self) -> io::Result<libc::statvfs> {
        self.root()?.statvfs()
    }

    /// A descriptor: the version is whatever the file holds (the core checks identities).
    fn open_reader(&self, rel: &Path, _size: u64, _ctime: (i64, u32)) -> io::Result<SourceReader> {
        self.open_file(rel, libc::O_RDONLY).map(SourceReader::File)
    }

    fn openat(&self, rel: &Path, flags: OFlags, mode: u32) -> io::Result<OwnedFd> {
        self.root()?.openat(rel, flags, mode)
    }

    fn dir(&self, rel: &Path) -> io::Result<OwnedFd> {
        self.root()?.dir(rel)
    }

    fn open_file(&self, rel: &Path, flags: i32) -> io::Result<File> {
        self.root()?.open_file(rel, flags)
    }

    fn create_file(&self, rel: &Path, flags: i32, mode: u32) -> io::Result<File> {
        self.root()?.create_file(rel, flags, mode)
    }

    fn mkdir(&self, rel: &Path, mode: u32) -> io::Result<()> {
        self.root()?.mkdir(rel, mode)
    }

    fn mknod(&self, rel: &Path, mode: u32, rdev: u64) -> io::Result<()> {
        self.root()?.mknod(rel, mode, rdev)
    }

    fn symlink(&self, target: &Path, rel: &Path) -> io::Result<()> {
        self.root()?.symlink(target, rel)
    }

    fn readlink(&self, rel: &Path) -> io::Result<Vec<u8>> {
        self.root()?.readlink(rel)
    }

    fn unlink(&self, rel: &Path) -> io::Result<()> {
        self.root()?.unlink(rel)
    }

    fn rmdir(&self, rel: &Path) -> io::Result<()> {
        self.root()?.rmdir(rel)
    }

    fn rename(&self, from: &Path, to: &Path, flags: u32) -> io::Result<()> {
        self.root()?.rename(from, to, flags)
    }

    fn link(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.root()?.link(from, to)
    }

    fn set_attr(
        &self,
        rel: Option<&Path>,
        fd: Option<BorrowedFd<'_>>,
        attr: &SetAttr,
    ) -> io::Result<()> {
        self.root()?.set_attr(rel, fd, attr)
    }

    fn chown_new(&self, rel: &Path, uid: u32, gid: Option<u32>) -> io::Result<()> {
        self.root()?.chown_new(rel, uid, gid)
    }

    fn getxattr(&self, rel: &Path, name: &OsStr, size: usize) -> io::Result<Vec<u8>> {
        self.root()?.getxattr(rel, name, size)
    }

    fn listxattr(&self, rel: &Path, size: usize) -> io::Result<Vec<u8>> {
        self.root()?.listxattr(rel, size)
    }

    fn setxattr(&self, rel: &Path, name: &OsStr, value: &[u8], flags: i32) -> io::Result<()> {
        self.root()?.setxattr(rel, name, value, flags)
    }

    fn removexattr(&self, rel: &Path, name: &OsStr) -> io::Result<()> {
        self.root()?.removexattr(rel, name)
    }
}

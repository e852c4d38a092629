//! The source operations `fs.rs` calls on `GuardedSource`, one method each, every one
//! guarded (`GuardedSource::call`, or the object store's `call_obj`).

use std::io;
use std::path::Path;
use std::time::SystemTime;

use super::GuardedSource;
use crate::cache::SourceIdentity;
use crate::object_tree::SourceReader;
use crate::source::Stat;

/// The source calls `fs.rs` makes, each guarded (`GuardedSource::call`). Arguments are
/// copied into the call, which may run on a source worker.
impl GuardedSource {
    pub fn stat(&self, rel: &Path) -> io::Result<Stat> {
        let rel = rel.to_path_buf();
        if self.is_object() {
            return self.call_obj(move |o| o.stat(&rel));
        }
        self.call(move |r| r.stat(&rel))
    }

    /// A reader of the file at `rel` for fetching (`fetch::SourceFd`). On an object store
    /// it reads only the version `expect` describes (the cache record's).
    pub fn open_reader(&self, rel: &Path, expect: &SourceIdentity) -> io::Result<SourceReader> {
        let rel = rel.to_path_buf();
        if self.is_object() {
            let (size, ctime) = (expect.size, expect.ctime);
            return self.call_obj(move |o| o.open_reader(&rel, size, ctime));
        }
        self.call(move |r| r.open_file(&rel, libc::O_RDONLY))
            .map(SourceReader::File)
    }

    /// Up to `len` bytes at `offset` of a reader's file (fewer only at its end).
    pub fn read_at(&self, reader: &SourceReader, len: usize, offset: u64) -> io::Result<Vec<u8>> {
        match reader {
            SourceReader::File(f) => {
                use std::os::fd::AsFd;
                self.with_fd(f.as_fd(), move |f| {
                    let mut buf = vec![0u8; len];
                    let n = crate::source::read_full(f, &mut buf, offset)?;
                    buf.truncate(n);
                    Ok(buf)
                })
            }
            SourceReader::Object { rel, etag } => {
                let (rel, etag) = (rel.clone(), etag.clone());
                self.call_obj(move |o| o.read_at(&rel, etag.as_deref(), len, offset))
            }
        }
    }

    /// Up to `len` bytes at `offset` of an object reader's object, handed to `sink(offset,
    /// bytes)` as they arrive (`ObjectSource::read_range_into`); returns how many.
    pub fn read_object_into(
        &self,
        reader: &SourceReader,
        len: usize,
        offset: u64,
        mut sink: impl FnMut(u64, &[u8]) -> io::Result<()> + Send + 'static,
    ) -> io::Result<u64> {
        let SourceReader::Object { rel, etag } = reader else {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        };
        let (rel, etag) = (rel.clone(), etag.clone());
        self.call_obj(move |o| o.read_into(&rel, etag.as_deref(), len, offset, &mut sink))
    }

    /// Creates the directory `rel` on an object store, owned by `owner`.
    pub fn object_mkdir(&self, rel: &Path, mode: u32, owner: (u32, u32)) -> io::Result<Stat> {
        let rel = rel.to_path_buf();
        self.call_obj(move |o| o.mkdir(&rel, mode, owner))
    }

    /// Mode, owner and mtime of `rel` on an object store.
    pub fn object_set_attr(&self, rel: &Path, attr: &crate::source::SetAttr) -> io::Result<Stat> {
        let (rel, attr) = (rel.to_path_buf(), *attr);
        self.call_obj(move |o| o.set_attr(&rel, &attr))
    }

    /// Uploads `file` whole as `rel` (`ObjectTree::upload`).
    pub fn object_upload(
        &self,
        rel: &Path,
        file: &std::fs::File,
        keep: Option<Stat>,
        mtime: SystemTime,
    ) -> io::Result<Stat> {
        let rel = rel.to_path_buf();
        let file = file.try_clone()?;
        self.call_obj(move |o| o.upload(&rel, &file, keep.as_ref(), mtime))
    }

    pub fn stat_children(
        &self,
        dir: &Path,
        names: &[&std::ffi::OsStr],
    ) -> io::Result<Vec<io::Result<Stat>>> {
        let dir = dir.to_path_buf();
        let names: Vec<std::ffi::OsString> = names.iter().map(|n| n.to_os_string()).collect();
        if self.is_object() {
            return self.call_obj(move |o| {
                let names: Vec<&std::ffi::OsStr> = names.iter().map(|n| n.as_os_str()).collect();
                Ok(o.stat_children(&dir, &names))
            });
        }
        self.call(move |r| {
            let names: Vec<&std::ffi::OsStr> = names.iter().map(|n| n.as_os_str()).collect();
            r.stat_children(&dir, &names)
        })
    }

    pub fn openat(
        &self,
        rel: &Path,
        flags: rustix::fs::OFlags,
        mode: u32,
    ) -> io::Result<std::os::fd::OwnedFd> {
        let rel = rel.to_path_buf();
        self.no_descriptors()?;
        self.call(move |r| r.openat(&rel, flags, mode))
    }

    pub fn dir(&self, rel: &Path) -> io::Result<std::os::fd::OwnedFd> {
        let rel = rel.to_path_buf();
        self.no_descriptors()?;
        self.call(move |r| r.dir(&rel))
    }

    pub fn open_file(&self, rel: &Path, flags: i32) -> io::Result<std::fs::File> {
        let rel = rel.to_path_buf();
        self.no_descriptors()?;
        self.call(move |r| r.open_file(&rel, flags))
    }

    pub fn create_file(&self, rel: &Path, flags: i32, mode: u32) -> io::Result<std::fs::File> {
        let rel = rel.to_path_buf();
        self.no_descriptors()?;
        self.call(move |r| r.create_file(&rel, flags, mode))
    }

    pub fn mkdir(&self, rel: &Path, mode: u32) -> io::Result<()> {
        let rel = rel.to_path_buf();
        if self.is_object() {
            return self.call_obj(move |o| o.mkdir(&rel, mode, o.default_owner()).map(|_| ()));
        }
        self.call(move |r| r.mkdir(&rel, mode))
    }

    pub fn mknod(&self, rel: &Path, mode: u32, rdev: u64) -> io::Result<()> {
        let rel = rel.to_path_buf();
        self.unsupported(libc::EPERM)?;
        self.call(move |r| r.mknod(&rel, mode, rdev))
    }

    pub fn symlink(&self, target: &Path, rel: &Path) -> io::Result<()> {
        let (target, rel) = (target.to_path_buf(), rel.to_path_buf());
        self.unsupported(libc::EPERM)?;
        self.call(move |r| r.symlink(&target, &rel))
    }

    pub fn readlink(&self, rel: &Path) -> io::Result<Vec<u8>> {
        let rel = rel.to_path_buf();
        self.unsupported(libc::EINVAL)?;
        self.call(move |r| r.readlink(&rel))
    }

    pub fn unlink(&self, rel: &Path) -> io::Result<()> {
        let rel = rel.to_path_buf();
        if self.is_object() {
            return self.call_obj(move |o| o.unlink(&rel));
        }
        self.call(move |r| r.unlink(&rel))
    }

    pub fn rmdir(&self, rel: &Path) -> io::Result<()> {
        let rel = rel.to_path_buf();
        if self.is_object() {
            return self.call_obj(move |o| o.rmdir(&rel));
        }
        self.call(move |r| r.rmdir(&rel))
    }

    pub fn rename(&self, from: &Path, to: &Path, flags: u32) -> io::Result<()> {
        let (from, to) = (from.to_path_buf(), to.to_path_buf());
        if self.is_object() {
            return self.call_obj(move |o| o.rename(&from, &to, flags));
        }
        self.call(move |r| r.rename(&from, &to, flags))
    }

    pub fn link(&self, from: &Path, to: &Path) -> io::Result<()> {
        let (from, to) = (from.to_path_buf(), to.to_path_buf());
        self.unsupported(libc::EPERM)?;
        self.call(move |r| r.link(&from, &to))
    }

    pub fn set_attr(
        &self,
        rel: Option<&Path>,
        fd: Option<std::os::fd::BorrowedFd<'_>>,
        attr: &crate::source::SetAttr,
    ) -> io::Result<()> {
        let rel = rel.map(Path::to_path_buf);
        if self.is_object() {
            let rel = rel.ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))?;
            return self.object_set_attr(&rel, attr).map(|_| ());
        }
        let fd = fd.map(crate::source::dup_file).transpose()?;
        let attr = *attr;
        self.call(move |r| {
            use std::os::fd::AsFd;
            r.set_attr(rel.as_deref(), fd.as_ref().map(|f| f.as_fd()), &attr)
        })
    }

    pub fn chown_new(&self, rel: &Path, uid: u32, gid: Option<u32>) -> io::Result<()> {
        let rel = rel.to_path_buf();
        if self.is_object() {
            let attr = crate::source::SetAttr {
                uid: Some(uid),
                gid,
                ..Default::default()
            };
            return self.object_set_attr(&rel, &attr).map(|_| ());
        }
        self.call(move |r| r.chown_new(&rel, uid, gid))
    }

    pub fn read_dir(&self, rel: &Path) -> io::Result<Vec<crate::source::DirEntry>> {
        let rel = rel.to_path_buf();
        if self.is_object() {
            return self.call_obj(move |o| o.read_dir(&rel));
        }
        self.call(move |r| r.read_dir(&rel))
    }

    pub fn getxattr(&self, rel: &Path, name: &std::ffi::OsStr, size: usize) -> io::Result<Vec<u8>> {
        let (rel, name) = (rel.to_path_buf(), name.to_os_string());
        self.unsupported(libc::EOPNOTSUPP)?;
        self.call(move |r| r.getxattr(&rel, &name, size))
    }

    pub fn listxattr(&self, rel: &Path, size: usize) -> io::Result<Vec<u8>> {
        let rel = rel.to_path_buf();
        if self.is_object() {
            return Ok(Vec::new());
        }
        self.call(move |r| r.listxattr(&rel, size))
    }

    pub fn setxattr(
        &self,
        rel: &Path,
        name: &std::ffi::OsStr,
        value: &[u8],
        flags: i32,
    ) -> io::Result<()> {
        let (rel, name, value) = (rel.to_path_buf(), name.to_os_string(), value.to_vec());
        self.unsupported(libc::EOPNOTSUPP)?;
        self.call(move |r| r.setxattr(&rel, &name, &value, flags))
    }

    pub fn removexattr(&self, rel: &Path, name: &std::ffi::OsStr) -> io::Result<()> {
        let (rel, name) = (rel.to_path_buf(), name.to_os_string());
        self.unsupported(libc::EOPNOTSUPP)?;
        self.call(move |r| r.removexattr(&rel, &name))
    }

    pub fn statvfs(&self) -> io::Result<libc::statvfs> {
        if self.is_object() {
            return self.call_obj(|o| Ok(o.statvfs()));
        }
        self.call(|r| r.statvfs())
    }

    /// Calls an object store cannot express answer `errno` there.
    fn unsupported(&self, errno: i32) -> io::Result<()> {
        if self.is_object() {
            return Err(io::Error::from_raw_os_error(errno));
        }
        Ok(())
    }

    /// Descriptor calls: an object store has none (`ENOTSUP`; callers that can do
    /// without one check `is_object` first).
    fn no_descriptors(&self) -> io::Result<()> {
        self.unsupported(libc::ENOTSUP)
    }

    /// `fstat` of a source descriptor.
    pub fn fstat(&self, fd: std::os::fd::BorrowedFd<'_>) -> io::Result<Stat> {
        self.with_fd(fd, |f| {
            use std::os::fd::AsFd;
            crate::source::fstat(f.as_fd())
        })
    }

    /// Runs `f` on a source descriptor, guarded like every other source call; the
    /// descriptor is duplicated only when the call runs on a worker.
    pub fn with_fd<T: Send + 'static>(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        f: impl FnOnce(&std::fs::File) -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        if self.health.online() && self.health.timeout().is_none() {
            let file = std::mem::ManuallyDrop::new(unsafe {
                use std::os::fd::{AsRawFd, FromRawFd};
                std::fs::File::from_raw_fd(fd.as_raw_fd())
            });
            let r = f(&file);
            if let Err(e) = &r {
                self.failed(e);
            }
            return r;
        }
        let file = crate::source::dup_file(fd)?;
        self.call(move |_| f(&file))
    }
}

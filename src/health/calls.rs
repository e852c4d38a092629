//! The source operations `fs.rs` calls on `GuardedSource`, one method each, every one
//! through the single guarded call path (`GuardedSource::call`). What a kind of source
//! cannot do it answers itself (`SourceTree`), with the errno its kind gives.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::SystemTime;

use super::{GuardedSource, OFFLINE, SourceFile};
use crate::cache::SourceIdentity;
use crate::source::{SourceReader, Stat};

/// The source calls `fs.rs` makes, each guarded (`GuardedSource::call`). Arguments are
/// copied into the call, which may run on a source worker.
impl GuardedSource {
    pub fn stat(&self, rel: &Path) -> io::Result<Stat> {
        let rel = rel.to_path_buf();
        self.call(move |t| t.stat(&rel))
    }

    /// A reader of the file at `rel` for fetching (`fetch::SourceFd`). On an object store
    /// it reads only the version `expect` describes (the cache record's).
    pub fn open_reader(&self, rel: &Path, expect: &SourceIdentity) -> io::Result<SourceReader> {
        let rel = rel.to_path_buf();
        let (size, ctime) = (expect.size, expect.ctime);
        self.call(move |t| t.open_reader(&rel, size, ctime))
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
                self.call(move |t| t.read_range(&rel, etag.as_deref(), len, offset))
            }
        }
    }

    /// Up to `len` bytes at `offset` of a reader's file if they are all in the source's
    /// page cache (`source::resident`, asked before anything is allocated or read); `None`
    /// if not, or for an object.
    pub fn read_resident_at(
        &self,
        reader: &SourceReader,
        len: usize,
        offset: u64,
    ) -> io::Result<Option<Vec<u8>>> {
        let SourceReader::File(f) = reader else {
            return Ok(None);
        };
        if !crate::source::resident(f, offset, len as u64) {
            return Ok(None);
        }
        self.read_at(reader, len, offset).map(Some)
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
        self.call(move |t| t.read_range_into(&rel, etag.as_deref(), len, offset, &mut sink))
    }

    /// Creates the directory `rel` owned by `owner`, in one request (an object store).
    pub fn mkdir_owned(&self, rel: &Path, mode: u32, owner: (u32, u32)) -> io::Result<Stat> {
        let rel = rel.to_path_buf();
        self.call(move |t| t.mkdir_owned(&rel, mode, owner))
    }

    /// Mode, owner and mtime of `rel` by a rewrite (an object store).
    pub fn rewrite_attr(&self, rel: &Path, attr: &crate::source::SetAttr) -> io::Result<Stat> {
        let (rel, attr) = (rel.to_path_buf(), *attr);
        self.call(move |t| t.rewrite_attr(&rel, &attr))
    }

    /// Uploads `file` whole as `rel` (`SourceTree::upload`).
    pub fn upload(
        &self,
        rel: &Path,
        file: &std::fs::File,
        keep: Option<Stat>,
        mtime: SystemTime,
    ) -> io::Result<Stat> {
        let rel = rel.to_path_buf();
        let file = file.try_clone()?;
        self.call(move |t| t.upload(&rel, &file, keep.as_ref(), mtime))
    }

    pub fn stat_children(
        &self,
        dir: &Path,
        names: &[&std::ffi::OsStr],
    ) -> io::Result<Vec<io::Result<Stat>>> {
        let dir = dir.to_path_buf();
        let names: Vec<std::ffi::OsString> = names.iter().map(|n| n.to_os_string()).collect();
        self.call(move |t| {
            let names: Vec<&std::ffi::OsStr> = names.iter().map(|n| n.as_os_str()).collect();
            t.stat_children(&dir, &names)
        })
    }

    pub fn openat(
        &self,
        rel: &Path,
        flags: rustix::fs::OFlags,
        mode: u32,
    ) -> io::Result<std::os::fd::OwnedFd> {
        let rel = rel.to_path_buf();
        self.call(move |t| t.openat(&rel, flags, mode))
    }

    /// The file an `O_PATH` descriptor names, opened anew with `flags` through its
    /// `/proc/self/fd` link: exactly that file, whatever name leads to it now.
    pub fn reopen(
        self: &Arc<Self>,
        fd: std::os::fd::BorrowedFd<'_>,
        flags: i32,
    ) -> io::Result<SourceFile> {
        let f = self.with_fd(fd, move |f| {
            use std::os::fd::AsRawFd;
            let own = format!("/proc/self/fd/{}", f.as_raw_fd());
            let flags =
                rustix::fs::OFlags::from_bits_retain(flags as u32) | rustix::fs::OFlags::CLOEXEC;
            Ok(std::fs::File::from(rustix::fs::open(
                own,
                flags,
                rustix::fs::Mode::empty(),
            )?))
        })?;
        Ok(SourceFile::new(self.clone(), f))
    }

    /// An `O_PATH` descriptor of the file at `rel` and its attributes, in one guarded call:
    /// an open's look at the source, one hand-off to a source worker instead of two.
    pub fn open_path_and_stat(&self, rel: &Path) -> io::Result<(std::os::fd::OwnedFd, Stat)> {
        let rel = rel.to_path_buf();
        self.call(move |t| {
            let fd = t.openat(&rel, rustix::fs::OFlags::PATH, 0)?;
            let st = crate::source::fstat(std::os::fd::AsFd::as_fd(&fd))?;
            Ok((fd, st))
        })
    }

    pub fn dir(&self, rel: &Path) -> io::Result<std::os::fd::OwnedFd> {
        let rel = rel.to_path_buf();
        self.call(move |t| t.dir(&rel))
    }

    /// The file at `rel`, closed through the guard when dropped.
    pub fn open_file(self: &Arc<Self>, rel: &Path, flags: i32) -> io::Result<SourceFile> {
        let rel = rel.to_path_buf();
        let f = self.call(move |t| t.open_file(&rel, flags))?;
        Ok(SourceFile::new(self.clone(), f))
    }

    pub fn create_file(
        self: &Arc<Self>,
        rel: &Path,
        flags: i32,
        mode: u32,
    ) -> io::Result<SourceFile> {
        let rel = rel.to_path_buf();
        let f = self.call(move |t| t.create_file(&rel, flags, mode))?;
        Ok(SourceFile::new(self.clone(), f))
    }

    pub fn mkdir(&self, rel: &Path, mode: u32) -> io::Result<()> {
        let rel = rel.to_path_buf();
        self.call(move |t| t.mkdir(&rel, mode))
    }

    pub fn mknod(&self, rel: &Path, mode: u32, rdev: u64) -> io::Result<()> {
        let rel = rel.to_path_buf();
        self.call(move |t| t.mknod(&rel, mode, rdev))
    }

    pub fn symlink(&self, target: &Path, rel: &Path) -> io::Result<()> {
        let (target, rel) = (target.to_path_buf(), rel.to_path_buf());
        self.call(move |t| t.symlink(&target, &rel))
    }

    pub fn readlink(&self, rel: &Path) -> io::Result<Vec<u8>> {
        let rel = rel.to_path_buf();
        self.call(move |t| t.readlink(&rel))
    }

    pub fn unlink(&self, rel: &Path) -> io::Result<()> {
        let rel = rel.to_path_buf();
        self.call(move |t| t.unlink(&rel))
    }

    pub fn rmdir(&self, rel: &Path) -> io::Result<()> {
        let rel = rel.to_path_buf();
        self.call(move |t| t.rmdir(&rel))
    }

    pub fn rename(&self, from: &Path, to: &Path, flags: u32) -> io::Result<()> {
        let (from, to) = (from.to_path_buf(), to.to_path_buf());
        self.call(move |t| t.rename(&from, &to, flags))
    }

    pub fn link(&self, from: &Path, to: &Path) -> io::Result<()> {
        let (from, to) = (from.to_path_buf(), to.to_path_buf());
        self.call(move |t| t.link(&from, &to))
    }

    pub fn set_attr(
        &self,
        rel: Option<&Path>,
        fd: Option<std::os::fd::BorrowedFd<'_>>,
        attr: &crate::source::SetAttr,
    ) -> io::Result<()> {
        let rel = rel.map(Path::to_path_buf);
        let fd = fd.map(crate::source::dup_file).transpose()?;
        let attr = *attr;
        self.call(move |t| {
            use std::os::fd::AsFd;
            t.set_attr(rel.as_deref(), fd.as_ref().map(|f| f.as_fd()), &attr)
        })
    }

    pub fn chown_new(&self, rel: &Path, uid: u32, gid: Option<u32>) -> io::Result<()> {
        let rel = rel.to_path_buf();
        self.call(move |t| t.chown_new(&rel, uid, gid))
    }

    pub fn read_dir(&self, rel: &Path) -> io::Result<Vec<crate::source::DirEntry>> {
        let rel = rel.to_path_buf();
        self.call(move |t| t.read_dir(&rel))
    }

    pub fn getxattr(&self, rel: &Path, name: &std::ffi::OsStr, size: usize) -> io::Result<Vec<u8>> {
        let (rel, name) = (rel.to_path_buf(), name.to_os_string());
        self.call(move |t| t.getxattr(&rel, &name, size))
    }

    pub fn listxattr(&self, rel: &Path, size: usize) -> io::Result<Vec<u8>> {
        let rel = rel.to_path_buf();
        self.call(move |t| t.listxattr(&rel, size))
    }

    pub fn setxattr(
        &self,
        rel: &Path,
        name: &std::ffi::OsStr,
        value: &[u8],
        flags: i32,
    ) -> io::Result<()> {
        let (rel, name, value) = (rel.to_path_buf(), name.to_os_string(), value.to_vec());
        self.call(move |t| t.setxattr(&rel, &name, &value, flags))
    }

    pub fn removexattr(&self, rel: &Path, name: &std::ffi::OsStr) -> io::Result<()> {
        let (rel, name) = (rel.to_path_buf(), name.to_os_string());
        self.call(move |t| t.removexattr(&rel, &name))
    }

    pub fn statvfs(&self) -> io::Result<libc::statvfs> {
        self.call(|t| t.statvfs())
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
        self.refuse_offline()?;
        if self.health.timeout().is_none() {
            return self.inline_on(fd, f);
        }
        let file = crate::source::dup_file(fd)?;
        self.call(move |_| f(&file))
    }

    /// Writes all of `data` at `offset` of a source descriptor. Inline (no timeout) it
    /// writes from the caller's buffer; a call on a worker writes from a copy, which
    /// must outlive a caller that stopped waiting for it.
    pub fn write_all_at(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        data: &[u8],
        offset: u64,
    ) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        if self.health.timeout().is_some() {
            let owned = data.to_vec();
            return self.with_fd(fd, move |f| f.write_all_at(&owned, offset));
        }
        self.refuse_offline()?;
        self.inline_on(fd, |f| f.write_all_at(data, offset))
    }

    /// Refuses a call on a descriptor while offline, before the descriptor is duplicated:
    /// closing a duplicate may wait for the source too.
    fn refuse_offline(&self) -> io::Result<()> {
        if self.health.online() {
            return Ok(());
        }
        self.health.offline_requests.fetch_add(1, Relaxed);
        Err(io::Error::from_raw_os_error(OFFLINE))
    }

    /// Runs `f` on the descriptor in this thread (source calls without a timeout).
    fn inline_on<T>(
        &self,
        fd: std::os::fd::BorrowedFd<'_>,
        f: impl FnOnce(&std::fs::File) -> io::Result<T>,
    ) -> io::Result<T> {
        let file = std::mem::ManuallyDrop::new(unsafe {
            use std::os::fd::{AsRawFd, FromRawFd};
            std::fs::File::from_raw_fd(fd.as_raw_fd())
        });
        let r = f(&file);
        if let Err(e) = &r {
            self.failed(e);
        }
        r
    }
}

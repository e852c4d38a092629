//! Source access: every operation on the slow source directory goes through here.
//!
//! The daemon usually runs as root over a tree it does not control, so no path is ever
//! resolved with plain `open(2)`: relative paths are resolved beneath the root with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`, and the final
//! component is always acted on with an `*at` call that does not follow symlinks. A symlink
//! planted in the source therefore can never lead the daemon out of it.
//!
//! Paths are relative to the root (`""` is the root). Paths longer than the kernel's
//! `PATH_MAX` (possible inside a FUSE mount, where a process may `chdir` deep) are walked in
//! pieces, one `openat2` per piece.

use std::ffi::{CStr, CString, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{AtFlags, Mode, OFlags, ResolveFlags};

mod caps;
mod tree;
pub use caps::Capabilities;
pub use tree::{PosixTree, SourceTree};

/// Bytes of a relative path handed to one `openat2` call; well below `PATH_MAX`.
const MAX_PATH_PIECE: usize = 3000;

const RESOLVE: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS);

/// A reader of one source file, kept while the file is not wholly cached.
#[derive(Debug)]
pub enum SourceReader {
    File(File),
    /// The object at `rel`, as of `etag` (`object_tree.rs`): reads of any other version
    /// fail with `ESTALE`.
    Object {
        rel: PathBuf,
        etag: Option<String>,
    },
}

/// Metadata of one source object, as `lstat` reports it (nanosecond times).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    pub dev: u64,
    pub ino: u64,
    pub mode: u32,
    pub nlink: u64,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    pub size: u64,
    pub blocks: u64,
    pub blksize: u32,
    pub atime: (i64, u32),
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    /// Birth time, `(0, 0)` where unknown (`fstat`, sources without it). Immutable for a
    /// file's life, so it tells a file from a later one given the same inode number.
    pub btime: (i64, u32),
}

impl Stat {
    /// From `statx`; the birth time where the file system reports it.
    pub fn from_statx(x: &libc::statx) -> Stat {
        let t = |t: &libc::statx_timestamp| (t.tv_sec, t.tv_nsec);
        Stat {
            dev: libc::makedev(x.stx_dev_major, x.stx_dev_minor),
            ino: x.stx_ino,
            mode: x.stx_mode as u32,
            nlink: x.stx_nlink as u64,
            uid: x.stx_uid,
            gid: x.stx_gid,
            rdev: libc::makedev(x.stx_rdev_major, x.stx_rdev_minor),
            size: x.stx_size,
            blocks: x.stx_blocks,
            blksize: x.stx_blksize,
            atime: t(&x.stx_atime),
            mtime: t(&x.stx_mtime),
            ctime: t(&x.stx_ctime),
            btime: if x.stx_mask & libc::STATX_BTIME != 0 {
                t(&x.stx_btime)
            } else {
                (0, 0)
            },
        }
    }

    pub fn from_libc(st: &libc::stat) -> Stat {
        Stat {
            dev: st.st_dev,
            ino: st.st_ino,
            mode: st.st_mode,
            nlink: st.st_nlink,
            uid: st.st_uid,
            gid: st.st_gid,
            rdev: st.st_rdev,
            size: st.st_size as u64,
            blocks: st.st_blocks as u64,
            blksize: st.st_blksize as u32,
            atime: (st.st_atime, st.st_atime_nsec as u32),
            mtime: (st.st_mtime, st.st_mtime_nsec as u32),
            ctime: (st.st_ctime, st.st_ctime_nsec as u32),
            btime: (0, 0),
        }
    }

    pub fn file_type(&self) -> u32 {
        self.mode & libc::S_IFMT
    }

    pub fn is_dir(&self) -> bool {
        self.file_type() == libc::S_IFDIR
    }

    pub fn is_file(&self) -> bool {
        self.file_type() == libc::S_IFREG
    }
}

/// One directory entry as read from the source.
#[derive(Clone, Debug)]
pub struct DirEntry {
    pub name: std::ffi::OsString,
    pub ino: u64,
    /// `S_IF*` type bits, or 0 when the file system does not say.
    pub file_type: u32,
}

/// What `setattr` asks to change; `None` leaves a field alone.
#[derive(Clone, Copy, Debug, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<TimeSpec>,
    pub mtime: Option<TimeSpec>,
}

#[derive(Clone, Copy, Debug)]
pub enum TimeSpec {
    Now,
    At(i64, u32),
}

impl TimeSpec {
    fn to_libc(self) -> libc::timespec {
        match self {
            TimeSpec::Now => libc::timespec {
                tv_sec: 0,
                tv_nsec: libc::UTIME_NOW,
            },
            TimeSpec::At(s, ns) => libc::timespec {
                tv_sec: s,
                tv_nsec: ns as i64,
            },
        }
    }
}

/// Converts a libc return value into an `io::Result`.
pub(crate) fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// Reads until `buf` is full or end of file; returns the bytes read.
pub fn read_full(f: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Whether every page of `[offset, offset + len)` of `f` is in the page cache (a range
/// past the end of the file has none; give lengths within it). Starts no I/O, unlike a
/// read with `RWF_NOWAIT`, which returns `EAGAIN` for a page not in memory but starts
/// its readahead all the same.
pub fn resident(f: &File, offset: u64, len: u64) -> bool {
    if len == 0 {
        return true;
    }
    // SAFETY: sysconf only reads a value.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as u64;
    let pages = (offset + len).div_ceil(page) - offset / page;
    cached_pages(f, offset, len).is_some_and(|n| n >= pages)
}

/// Pages of `f` in `[offset, offset + len)` that are in the page cache (`cachestat(2)`,
/// Linux 6.5), or `None` where the call is not there.
pub fn cached_pages(f: &File, offset: u64, len: u64) -> Option<u64> {
    use std::os::fd::AsRawFd;
    /// `__NR_cachestat`, the same on every architecture (the libc crate has no wrapper
    /// for it on glibc targets).
    const SYS_CACHESTAT: libc::c_long = 451;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct CacheStat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    let range = Range { off: offset, len };
    let mut stat = CacheStat::default();
    // SAFETY: both pointers are to live values of the layouts the kernel reads and writes.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            f.as_raw_fd(),
            &range as *const Range,
            &mut stat as *mut CacheStat,
            0u32,
        )
    };
    (r == 0).then_some(stat.nr_cache)
}

/// Network and FUSE file systems: changes made on other machines raise no inotify events.
pub fn is_remote(fd: BorrowedFd<'_>) -> bool {
    const NFS: i64 = 0x6969;
    const SMB: i64 = 0x517B;
    const CIFS: i64 = 0xFF53_4D42;
    const SMB2: i64 = 0xFE53_4D42;
    const FUSE: i64 = 0x6573_5546;
    const V9FS: i64 = 0x0102_1997;
    const CEPH: i64 = 0x00C3_6400;
    const AFS: i64 = 0x6B41_4653;
    const CODA: i64 = 0x7375_7245;
    const OCFS2: i64 = 0x7461_636F;
    const GFS2: i64 = 0x0116_1970;
    match rustix::fs::fstatfs(fd) {
        Ok(st) => matches!(
            st.f_type,
            NFS | SMB | CIFS | SMB2 | FUSE | V9FS | CEPH | AFS | CODA | OCFS2 | GFS2
        ),
        Err(_) => true,
    }
}

/// Errors that may mean the source is unreachable rather than that one object is wrong;
/// a probe of the root decides.
pub fn may_mean_unreachable(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::ENOTCONN
                | libc::ETIMEDOUT
                | libc::ECONNABORTED
                | libc::ECONNRESET
                | libc::ECONNREFUSED
                | libc::EHOSTUNREACH
                | libc::EHOSTDOWN
                | libc::ENETUNREACH
                | libc::ENETDOWN
                | libc::ESHUTDOWN
                | libc::ESTALE
                | libc::EIO
                | libc::ENODEV
        )
    )
}

/// `getxattr` of the object that `fd` (an `O_PATH` one too) names, through its /proc link:
/// `fgetxattr` refuses `O_PATH` descriptors.
pub fn getxattr_of(fd: BorrowedFd<'_>, name: &OsStr, size: usize) -> io::Result<Vec<u8>> {
    let p = CString::new(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    getxattr_at(&p, &cstr(name)?, size, true)
}

/// `getxattr` (`follow`) or `lgetxattr` of path `p`, into a buffer of `size` bytes.
fn getxattr_at(p: &CString, name: &CString, size: usize, follow: bool) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; size];
    let get = if follow {
        libc::getxattr
    } else {
        libc::lgetxattr
    };
    let n = unsafe { get(p.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), size) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // With size 0 the call only reports the length: answer a buffer of that length.
    buf.resize(n as usize, 0);
    Ok(buf)
}

fn cstr(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn rustix_err(e: rustix::io::Errno) -> io::Error {
    io::Error::from_raw_os_error(e.raw_os_error())
}

/// Splits a relative path into its parent and final name. The root has no parent.
pub fn split(rel: &Path) -> io::Result<(&Path, &OsStr)> {
    let name = rel
        .file_name()
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
    Ok((rel.parent().unwrap_or(Path::new("")), name))
}

/// Checks that a path is relative and has only normal components (no `..`, no `/`).
pub fn check_relative(rel: &Path) -> io::Result<()> {
    if rel.components().all(|c| matches!(c, Component::Normal(_))) {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(libc::EINVAL))
    }
}

/// A directory tree reached only beneath its root: used for both the source and the cache.
#[derive(Debug)]
pub struct BeneathRoot {
    root: OwnedFd,
    root_path: PathBuf,
}

impl BeneathRoot {
    pub fn open(path: &Path) -> io::Result<BeneathRoot> {
        let root = rustix::fs::open(
            path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(rustix_err)?;
        Ok(BeneathRoot {
            root,
            root_path: path.to_path_buf(),
        })
    }

    /// A tree rooted at an already open directory (`root_path` is for messages only).
    pub fn from_fd(root: OwnedFd, root_path: PathBuf) -> BeneathRoot {
        BeneathRoot { root, root_path }
    }

    pub fn root_path(&self) -> &Path {
        &self.root_path
    }

    pub fn root_fd(&self) -> BorrowedFd<'_> {
        self.root.as_fd()
    }

    /// Opens `rel` beneath the root with `flags`, never following a symlink on the way or
    /// at the end (`RESOLVE_NO_SYMLINKS` covers the final component too).
    pub fn openat(&self, rel: &Path, flags: OFlags, mode: u32) -> io::Result<OwnedFd> {
        check_relative(rel)?;
        let flags = flags | OFlags::CLOEXEC | OFlags::NOFOLLOW;
        let bytes = rel.as_os_str().as_bytes();
        if bytes.is_empty() {
            return rustix::fs::openat2(&self.root, ".", flags, Mode::from_raw_mode(mode), RESOLVE)
                .map_err(rustix_err);
        }
        if bytes.len() <= MAX_PATH_PIECE {
            return rustix::fs::openat2(&self.root, rel, flags, Mode::from_raw_mode(mode), RESOLVE)
                .map_err(rustix_err);
        }
        // Too long for one call: walk directories piece by piece.
        let mut dir: Option<OwnedFd> = None;
        let mut piece = PathBuf::new();
        let comps: Vec<_> = rel.components().collect();
        for (i, c) in comps.iter().enumerate() {
            let last = i + 1 == comps.len();
            if !last && piece.as_os_str().len() + c.as_os_str().len() < MAX_PATH_PIECE {
                piece.push(c);
                continue;
            }
            if last {
                piece.push(c);
            }
            let at = dir.as_ref().map(|d| d.as_fd()).unwrap_or(self.root.as_fd());
            let (f, m) = if last {
                (flags, Mode::from_raw_mode(mode))
            } else {
                (
                    OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
                    Mode::empty(),
                )
            };
            let fd = rustix::fs::openat2(at, &piece, f, m, RESOLVE).map_err(rustix_err)?;
            if last {
                return Ok(fd);
            }
            dir = Some(fd);
            piece = PathBuf::from(c.as_os_str());
        }
        unreachable!("a non-empty path has a last component")
    }

    /// Opens the directory `rel` as an `O_PATH` handle for `*at` calls.
    pub fn dir(&self, rel: &Path) -> io::Result<OwnedFd> {
        self.openat(rel, OFlags::PATH | OFlags::DIRECTORY, 0)
    }

    /// Parent directory handle and final name of `rel`, for `*at` calls on the last component.
    pub fn parent(&self, rel: &Path) -> io::Result<(OwnedFd, CString)> {
        let (parent, name) = split(rel)?;
        Ok((self.dir(parent)?, cstr(name)?))
    }

    pub fn stat(&self, rel: &Path) -> io::Result<Stat> {
        if rel.as_os_str().is_empty() {
            return fstat(self.root.as_fd());
        }
        let (dir, name) = self.parent(rel)?;
        lstat_at(dir.as_fd(), &name)
    }

    /// `lstat` of each name in the directory `dir`, opening the directory once.
    pub fn stat_children(&self, dir: &Path, names: &[&OsStr]) -> io::Result<Vec<io::Result<Stat>>> {
        let fd = self.dir(dir)?;
        Ok(names
            .iter()
            .map(|name| lstat_at(fd.as_fd(), &cstr(name)?))
            .collect())
    }

    pub fn open_file(&self, rel: &Path, flags: i32) -> io::Result<File> {
        let fd = self.openat(rel, OFlags::from_bits_retain(flags as u32), 0)?;
        Ok(File::from(fd))
    }

    /// Creates `rel` exclusively-or-not as `flags` say (`O_CREAT` is added).
    pub fn create_file(&self, rel: &Path, flags: i32, mode: u32) -> io::Result<File> {
        let flags = OFlags::from_bits_retain(flags as u32) | OFlags::CREATE;
        Ok(File::from(self.openat(rel, flags, mode)?))
    }

    pub fn mkdir(&self, rel: &Path, mode: u32) -> io::Result<()> {
        let (dir, name) = self.parent(rel)?;
        cvt(unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), mode) })?;
        Ok(())
    }

    pub fn mknod(&self, rel: &Path, mode: u32, rdev: u64) -> io::Result<()> {
        let (dir, name) = self.parent(rel)?;
        cvt(unsafe { libc::mknodat(dir.as_raw_fd(), name.as_ptr(), mode, rdev) })?;
        Ok(())
    }

    pub fn symlink(&self, target: &Path, rel: &Path) -> io::Result<()> {
        let (dir, name) = self.parent(rel)?;
        let target = cstr(target.as_os_str())?;
        cvt(unsafe { libc::symlinkat(target.as_ptr(), dir.as_raw_fd(), name.as_ptr()) })?;
        Ok(())
    }

    pub fn readlink(&self, rel: &Path) -> io::Result<Vec<u8>> {
        let (dir, name) = self.parent(rel)?;
        let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
        let n = unsafe {
            libc::readlinkat(
                dir.as_raw_fd(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        buf.truncate(n as usize);
        Ok(buf)
    }

    pub fn unlink(&self, rel: &Path) -> io::Result<()> {
        let (dir, name) = self.parent(rel)?;
        cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) })?;
        Ok(())
    }

    pub fn rmdir(&self, rel: &Path) -> io::Result<()> {
        let (dir, name) = self.parent(rel)?;
        cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) })?;
        Ok(())
    }

    /// `renameat2` with the caller's flags (`RENAME_NOREPLACE`, `RENAME_EXCHANGE`); the
    /// source's own answer (e.g. `EINVAL` where it lacks a flag) is returned unchanged.
    pub fn rename(&self, from: &Path, to: &Path, flags: u32) -> io::Result<()> {
        let (fdir, fname) = self.parent(from)?;
        let (tdir, tname) = self.parent(to)?;
        cvt(unsafe {
            libc::renameat2(
                fdir.as_raw_fd(),
                fname.as_ptr(),
                tdir.as_raw_fd(),
                tname.as_ptr(),
                flags,
            )
        })?;
        Ok(())
    }

    pub fn link(&self, from: &Path, to: &Path) -> io::Result<()> {
        let (fdir, fname) = self.parent(from)?;
        let (tdir, tname) = self.parent(to)?;
        rustix::fs::linkat(
            &fdir,
            fname.as_c_str(),
            &tdir,
            tname.as_c_str(),
            AtFlags::empty(),
        )
        .map_err(rustix_err)
    }

    /// Applies the owner, mode, times and size changes of `attr`: through `fd` when the
    /// caller has the file open (so that an open file whose name is gone still works),
    /// otherwise to `rel`, never following a symlink.
    pub fn set_attr(
        &self,
        rel: Option<&Path>,
        fd: Option<BorrowedFd<'_>>,
        attr: &SetAttr,
    ) -> io::Result<()> {
        // (dirfd, name, flags) naming the object for the *at calls.
        let held;
        let (at, name, flags) = match (fd, rel) {
            (Some(fd), _) => (fd.as_raw_fd(), CString::default(), libc::AT_EMPTY_PATH),
            (None, Some(rel)) if rel.as_os_str().is_empty() => {
                (self.root.as_raw_fd(), CString::new(".").unwrap(), 0)
            }
            (None, Some(rel)) => {
                let (dir, name) = self.parent(rel)?;
                held = dir;
                (held.as_raw_fd(), name, libc::AT_SYMLINK_NOFOLLOW)
            }
            (None, None) => return Err(io::Error::from_raw_os_error(libc::ENOENT)),
        };
        if attr.uid.is_some() || attr.gid.is_some() {
            let uid = attr.uid.unwrap_or(u32::MAX);
            let gid = attr.gid.unwrap_or(u32::MAX);
            cvt(unsafe { libc::fchownat(at, name.as_ptr(), uid, gid, flags) })?;
        }
        if let Some(mode) = attr.mode {
            let mode = mode & 0o7777;
            if flags == libc::AT_EMPTY_PATH {
                // fchmodat has no AT_EMPTY_PATH; the fd's /proc link names the object.
                let p = CString::new(format!("/proc/self/fd/{at}")).unwrap();
                cvt(unsafe { libc::chmod(p.as_ptr(), mode) })?;
            } else {
                // fchmodat has no working AT_SYMLINK_NOFOLLOW; symlinks have no mode to set.
                cvt(unsafe { libc::fchmodat(at, name.as_ptr(), mode, 0) })?;
            }
        }
        if let Some(size) = attr.size {
            match (fd, rel) {
                (Some(fd), _) => cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), size as i64) })?,
                (None, Some(rel)) => {
                    let f = self.openat(rel, OFlags::WRONLY, 0)?;
                    cvt(unsafe { libc::ftruncate(f.as_raw_fd(), size as i64) })?
                }
                (None, None) => unreachable!("checked above"),
            };
        }
        if attr.atime.is_some() || attr.mtime.is_some() {
            let omit = libc::timespec {
                tv_sec: 0,
                tv_nsec: libc::UTIME_OMIT,
            };
            let times = [
                attr.atime.map(TimeSpec::to_libc).unwrap_or(omit),
                attr.mtime.map(TimeSpec::to_libc).unwrap_or(omit),
            ];
            if flags == libc::AT_EMPTY_PATH {
                // futimens (utimensat with a null name) refuses `O_PATH` descriptors
                // (EBADF); the fd's /proc link names the object for either kind.
                let p = CString::new(format!("/proc/self/fd/{at}")).unwrap();
                cvt(unsafe { libc::utimensat(libc::AT_FDCWD, p.as_ptr(), times.as_ptr(), 0) })?;
            } else {
                cvt(unsafe { libc::utimensat(at, name.as_ptr(), times.as_ptr(), flags) })?;
            }
        }
        Ok(())
    }

    /// Sets the owner of a freshly created object to the caller (the daemon may be root).
    pub fn chown_new(&self, rel: &Path, uid: u32, gid: Option<u32>) -> io::Result<()> {
        let (dir, name) = self.parent(rel)?;
        cvt(unsafe {
            libc::fchownat(
                dir.as_raw_fd(),
                name.as_ptr(),
                uid,
                gid.unwrap_or(u32::MAX),
                libc::AT_SYMLINK_NOFOLLOW,
            )
        })?;
        Ok(())
    }

    pub fn read_dir(&self, rel: &Path) -> io::Result<Vec<DirEntry>> {
        let fd = self.openat(rel, OFlags::RDONLY | OFlags::DIRECTORY, 0)?;
        let mut dir = rustix::fs::Dir::read_from(&fd).map_err(rustix_err)?;
        let mut out = Vec::new();
        while let Some(ent) = dir.read() {
            let ent = ent.map_err(rustix_err)?;
            let name = OsStr::from_bytes(ent.file_name().to_bytes());
            if name == "." || name == ".." {
                continue;
            }
            let file_type = match ent.file_type() {
                rustix::fs::FileType::RegularFile => libc::S_IFREG,
                rustix::fs::FileType::Directory => libc::S_IFDIR,
                rustix::fs::FileType::Symlink => libc::S_IFLNK,
                rustix::fs::FileType::Fifo => libc::S_IFIFO,
                rustix::fs::FileType::Socket => libc::S_IFSOCK,
                rustix::fs::FileType::CharacterDevice => libc::S_IFCHR,
                rustix::fs::FileType::BlockDevice => libc::S_IFBLK,
                _ => 0,
            };
            out.push(DirEntry {
                name: name.to_os_string(),
                ino: ent.ino(),
                file_type,
            });
        }
        Ok(out)
    }

    /// Runs `f` with a path naming `rel` itself (`/proc/self/fd/<parent>/<name>`, used with
    /// the `l*xattr` calls), since the fd forms do not work on symlinks, fifos or devices.
    fn with_proc_path<T>(
        &self,
        rel: &Path,
        f: impl FnOnce(&CString, bool) -> io::Result<T>,
    ) -> io::Result<T> {
        if rel.as_os_str().is_empty() {
            let p = CString::new(format!("/proc/self/fd/{}", self.root.as_raw_fd())).unwrap();
            return f(&p, true);
        }
        let (dir, name) = self.parent(rel)?;
        let mut p = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
        p.extend_from_slice(name.as_bytes());
        f(&CString::new(p).unwrap(), false)
    }

    pub fn getxattr(&self, rel: &Path, name: &OsStr, size: usize) -> io::Result<Vec<u8>> {
        let name = cstr(name)?;
        self.with_proc_path(rel, |p, follow| getxattr_at(p, &name, size, follow))
    }

    pub fn listxattr(&self, rel: &Path, size: usize) -> io::Result<Vec<u8>> {
        self.with_proc_path(rel, |p, follow| {
            let mut buf = vec![0u8; size];
            let list = if follow {
                libc::listxattr
            } else {
                libc::llistxattr
            };
            let n = unsafe { list(p.as_ptr(), buf.as_mut_ptr().cast(), size) };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            // With size 0 the call only reports the length: answer a buffer of that length.
            buf.resize(n as usize, 0);
            Ok(buf)
        })
    }

    pub fn setxattr(&self, rel: &Path, name: &OsStr, value: &[u8], flags: i32) -> io::Result<()> {
        let name = cstr(name)?;
        self.with_proc_path(rel, |p, follow| {
            let set = if follow {
                libc::setxattr
            } else {
                libc::lsetxattr
            };
            cvt(unsafe {
                set(
                    p.as_ptr(),
                    name.as_ptr(),
                    value.as_ptr().cast(),
                    value.len(),
                    flags,
                )
            })?;
            Ok(())
        })
    }

    pub fn removexattr(&self, rel: &Path, name: &OsStr) -> io::Result<()> {
        let name = cstr(name)?;
        self.with_proc_path(rel, |p, follow| {
            let remove = if follow {
                libc::removexattr
            } else {
                libc::lremovexattr
            };
            cvt(unsafe { remove(p.as_ptr(), name.as_ptr()) })?;
            Ok(())
        })
    }

    pub fn statvfs(&self) -> io::Result<libc::statvfs> {
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // An O_PATH fd works with fstatvfs (fstatfs accepts O_PATH since 2.6.39).
        cvt(unsafe { libc::fstatvfs(self.root.as_raw_fd(), &mut st) })?;
        Ok(st)
    }
}

/// `statx` of `name` in `dir` with `flags`, asking for the birth time; `None` where the
/// kernel or a sandbox refuses `statx` (the caller falls back to the older call).
fn statx_at(dir: BorrowedFd<'_>, name: &CStr, flags: i32) -> io::Result<Option<Stat>> {
    let mut x: libc::statx = unsafe { std::mem::zeroed() };
    let r = unsafe {
        libc::statx(
            dir.as_raw_fd(),
            name.as_ptr(),
            flags | libc::AT_STATX_SYNC_AS_STAT,
            libc::STATX_BASIC_STATS | libc::STATX_BTIME,
            &mut x,
        )
    };
    if r == 0 {
        return Ok(Some(Stat::from_statx(&x)));
    }
    let e = io::Error::last_os_error();
    if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) {
        return Ok(None);
    }
    Err(e)
}

/// `lstat` of `name` in directory `dir`: `statx`, for the birth time, where the kernel has
/// it; `fstatat` otherwise.
fn lstat_at(dir: BorrowedFd<'_>, name: &CString) -> io::Result<Stat> {
    if let Some(st) = statx_at(dir, name, libc::AT_SYMLINK_NOFOLLOW)? {
        return Ok(st);
    }
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    cvt(unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })?;
    Ok(Stat::from_libc(&st))
}

/// `fstat` of `fd`: `statx`, for the birth time (which tells a file from a later one given
/// its inode number, `Inode::is_same_file`), where the kernel has it; `fstat` otherwise.
pub fn fstat(fd: BorrowedFd<'_>) -> io::Result<Stat> {
    if let Some(st) = statx_at(fd, c"", libc::AT_EMPTY_PATH)? {
        return Ok(st);
    }
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(Stat::from_libc(&st))
}

/// Duplicates a borrowed fd into an owned `File` (used to keep a handle past a lock).
pub fn dup_file(fd: BorrowedFd<'_>) -> io::Result<File> {
    let n = cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) })?;
    Ok(unsafe { File::from_raw_fd(n) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symlinks_never_lead_out_of_the_root() {
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"x").unwrap();
        let root = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join("escape")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.path().join("pw")).unwrap();
        let r = BeneathRoot::open(root.path()).unwrap();
        assert!(
            r.open_file(Path::new("escape/secret"), libc::O_RDONLY)
                .is_err()
        );
        assert!(r.open_file(Path::new("pw"), libc::O_RDONLY).is_err());
        assert!(r.stat(Path::new("escape/secret")).is_err());
        // The symlink itself is visible, as a symlink.
        let st = r.stat(Path::new("pw")).unwrap();
        assert_eq!(st.file_type(), libc::S_IFLNK);
        assert!(r.openat(Path::new("../x"), OFlags::RDONLY, 0).is_err());
    }

    #[test]
    fn long_paths_are_walked_in_pieces() {
        let root = tempfile::tempdir().unwrap();
        let r = BeneathRoot::open(root.path()).unwrap();
        let mut rel = PathBuf::new();
        let name = "d".repeat(200);
        for _ in 0..25 {
            rel.push(&name);
            r.mkdir(&rel, 0o755).unwrap();
        }
        assert!(rel.as_os_str().len() > 4096);
        let file = rel.join("f");
        let mut f = r.create_file(&file, libc::O_WRONLY, 0o644).unwrap();
        std::io::Write::write_all(&mut f, b"deep").unwrap();
        assert_eq!(r.stat(&file).unwrap().size, 4);
    }
}

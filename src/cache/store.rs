//! File-level operations on the cache directory. The cache root is opened once and every
//! path in it, top-level entries included, is resolved beneath that descriptor without
//! following symlinks, like the source's (the cache dir may be shared or tampered with; it
//! is never trusted to lead elsewhere). A file hoardfs writes is used only if it is a
//! regular file of its own with one link; anything else under its name is replaced, never
//! written through (docs/security.md, C1-C5).

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustix::fs::OFlags;

use super::listing::{self, DirListing};
use super::reaper::Reaper;

pub use super::files::{
    CacheFiles, LAST_USED_GRAIN_MS, first_page_resident, read_record, read_record_unchecked,
    scratch_file, write_record, write_record_unless_same,
};
pub use super::removals::remove_tree;
use super::removals::{Removals, Report, Scope, StillDue, remove_entry, remove_now};
use super::warm::Warmer;
use crate::source::{BeneathRoot, Stat, cvt, fstat};

const FORMAT_LINE: &str = "hoardfs cache 1\n";

/// How long opening waits for another daemon to release the cache directory.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The cache directory of one mount.
#[derive(Debug)]
pub struct CacheStore {
    /// The cache root itself, opened once: every top-level entry is reached beneath it.
    top: Arc<BeneathRoot>,
    data: Arc<BeneathRoot>,
    meta: Arc<BeneathRoot>,
    /// Directory listings for disconnected operation (`listing.rs`).
    dirs: BeneathRoot,
    /// New data files while they are made, before they are renamed into `data/`; emptied
    /// at start (what a crash left there belongs to nothing).
    tmp: BeneathRoot,
    root: PathBuf,
    /// Frees removed cache files' inodes off the caller's path.
    reaper: super::reaper::Reaper,
    /// Entries of names removed through the mount, removed off the request's path. Before
    /// `_lock`: dropping it finishes the queue while the cache is still ours.
    removals: Removals,
    /// Reads the next cache entries of a directory read in order (`warm.rs`).
    warmer: Warmer,
    /// Held for the life of the store: one daemon per cache directory.
    _lock: File,
}

/// What a removed cache entry held (`CacheStore::remove_entry`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// A record (a regular file) was there.
    pub record: bool,
    /// The bytes the data file (or whatever was in its place) took on disk.
    pub data_bytes: u64,
}

/// The cache's record and data trees, for the cleaner's scans.
#[derive(Clone, Debug)]
pub struct Trees {
    pub meta: Arc<BeneathRoot>,
    pub data: Arc<BeneathRoot>,
}

impl CacheStore {
    /// Opens (creating if needed) the cache at `root` and locks it for this process.
    ///
    /// The root is opened once (`O_DIRECTORY | O_NOFOLLOW`) and everything in it, top-level
    /// files and directories included, is reached beneath that descriptor without
    /// following any symlink (`BeneathRoot`). A directory that is refused (not ours, not a
    /// hoardfs cache) is left exactly as it was.
    pub fn open(root: &Path) -> anyhow::Result<CacheStore> {
        use anyhow::Context;
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(root)
            .with_context(|| format!("cannot create cache directory {}", root.display()))?;
        let fd = rustix::fs::open(
            root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .map_err(|e| io::Error::from_raw_os_error(e.raw_os_error()))
        .with_context(|| format!("cannot open cache directory {}", root.display()))?;
        rustix::fs::accessat(
            &fd,
            ".",
            rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK,
            rustix::fs::AtFlags::empty(),
        )
        .map_err(|e| io::Error::from_raw_os_error(e.raw_os_error()))
        .with_context(|| format!("cannot use cache directory {}", root.display()))?;
        let st = fstat(fd.as_fd())?;
        let euid = rustix::process::geteuid().as_raw();
        if st.uid != euid {
            anyhow::bail!(
                "cache directory {} belongs to uid {}, not to this user (uid {euid}); refusing \
                 to use it (its owner could plant links in it)",
                root.display(),
                st.uid
            );
        }
        let top = BeneathRoot::from_fd(fd, root.to_path_buf());
        match read_small_file(&top, Path::new("FORMAT")) {
            Ok(s) => check_format(&s).map_err(|found| {
                anyhow::anyhow!(
                    "cache directory {} holds an unknown format ({found}); use another --cache-dir or empty it",
                    root.display()
                )
            })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let is_empty = rustix::fs::Dir::read_from(top.root_fd())
                    .map_err(|e| io::Error::from_raw_os_error(e.raw_os_error()))?
                    .filter_map(|e| e.ok())
                    .all(|e| matches!(e.file_name().to_bytes(), b"." | b".."));
                if !is_empty {
                    anyhow::bail!(
                        "cache directory {} is not empty and is not a hoardfs cache; refusing to use it",
                        root.display()
                    );
                }
                // Written whole or not at all: a crash here must not leave a torn FORMAT
                // that makes the next mount refuse the directory.
                replace_file(&top, Path::new("FORMAT"), FORMAT_LINE.as_bytes())?;
            }
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("cannot read the FORMAT file of cache directory {}", root.display())
                });
            }
        }
        // Accepted: only now is anything changed. The cache holds copies of files other
        // users may not read, under their source names: only the daemon's user may enter it.
        if st.mode & 0o077 != 0 {
            rustix::fs::fchmod(top.root_fd(), rustix::fs::Mode::from_raw_mode(0o700))
                .map_err(|e| io::Error::from_raw_os_error(e.raw_os_error()))
                .with_context(|| format!("cannot restrict cache directory {}", root.display()))?;
        }
        let lock = private_file(&top, Path::new("lock"), OFlags::RDWR, true)?;
        // A daemon whose mount was just unmounted lets go as it exits: give it a moment,
        // so that `umount M && hoardfs S M` works.
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        while unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            if std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(20));
                continue;
            }
            anyhow::bail!(
                "cache directory {} is in use by another hoardfs mount",
                root.display()
            );
        }
        // A FORMAT.tmp left by a crash of a first mount.
        let _ = top.unlink(Path::new("FORMAT.tmp"));
        let sub = |name: &str| private_dir(&top, Path::new(name), true);
        // Emptied here: what a crash left there belongs to nothing (a symlink or file in
        // its place is replaced by `private_dir`, never followed).
        let tmp = sub("tmp")?;
        for e in tmp.read_dir(Path::new(""))? {
            remove_tree(&tmp, Path::new(&e.name))?;
        }
        let data = Arc::new(sub("data")?);
        let meta = Arc::new(sub("meta")?);
        let reaper = Reaper::inline();
        let removals = Removals::inline(remove_now(&meta, &data, &reaper));
        Ok(CacheStore {
            data,
            meta,
            dirs: sub("dirs")?,
            tmp,
            top: Arc::new(top),
            root: root.to_path_buf(),
            reaper,
            removals,
            warmer: Warmer::inline(),
            _lock: lock,
        })
    }

    /// Starts the threads that take work off the request path (the reaper, the queue of
    /// removals) or ahead of it (the warmer). Called in the process that serves the mount:
    /// a store opened before the daemon forks works without them until then, since threads
    /// do not survive a fork.
    pub fn start_workers(&mut self) {
        self.reaper = Reaper::start();
        self.removals = Removals::start(remove_now(&self.meta, &self.data, &self.reaper));
        self.warmer = Warmer::start(self.data.clone(), self.meta.clone());
    }

    /// Reads the entries of `paths` into memory soon, ahead of opens expected in that
    /// order (`warm.rs`); a hint that changes nothing.
    pub fn warm_ahead(&self, paths: impl IntoIterator<Item = PathBuf>) {
        self.warmer.warm(paths);
    }

    /// When reading ahead last found an entry out of memory (`Warmer::last_cold`).
    pub fn warm_last_cold(&self) -> Option<std::time::Instant> {
        self.warmer.last_cold()
    }

    /// The cache root, for entries beside the trees (`source.json`, `pins`, `oplog/`, ...).
    pub fn top(&self) -> &Arc<BeneathRoot> {
        &self.top
    }

    /// The record and data trees, for the cleaner. They may still hold entries whose
    /// removal is queued; the cleaner evicts through the store, which settles them.
    pub fn trees(&self) -> Trees {
        Trees {
            meta: self.meta.clone(),
            data: self.data.clone(),
        }
    }

    /// Creates (0700) or opens the directory `name` of the cache root (`oplog`,
    /// `lost+found`); anything else under that name is an error, never followed.
    pub fn private_dir(&self, name: &str) -> io::Result<BeneathRoot> {
        private_dir(&self.top, Path::new(name), false)
    }

    /// The daemon's log, `CACHE_DIR/hoardfs.log`, opened for appending (0600).
    pub fn open_log(&self) -> io::Result<File> {
        private_file(
            &self.top,
            Path::new("hoardfs.log"),
            OFlags::WRONLY | OFlags::APPEND,
            true,
        )
    }

    /// Free bytes on the cache's file system (for `min_free`).
    pub fn fs_free(&self) -> io::Result<u64> {
        fs_free(self.top.root_fd())
    }

    /// The data tree (the mirrored source names).
    pub fn data_dir(&self) -> &Arc<BeneathRoot> {
        &self.data
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Opens the data file and record of `rel`, creating them (and their directories).
    /// Whatever is found under their names that is not a regular file of ours with one
    /// link (a directory, symlink, device, or a hard link to a file elsewhere) is replaced,
    /// never written through.
    pub fn open_files(&self, rel: &Path) -> io::Result<CacheFiles> {
        self.removals.settle(rel, Scope::Entry);
        // The directories are nearly always there: the file is opened first, and they are
        // made (or repaired: a planted file or symlink in their place) only when that
        // fails for want of them.
        let open = |tree: &BeneathRoot| -> io::Result<File> {
            match private_file(tree, rel, OFlags::RDWR, true) {
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP)
                    ) =>
                {
                    if let Some(parent) = rel.parent() {
                        mkdir_p(tree, parent)?;
                    }
                    private_file(tree, rel, OFlags::RDWR, true)
                }
                r => r,
            }
        };
        Ok(CacheFiles::new(open(&self.data)?, open(&self.meta)?))
    }

    /// Puts a new data file of `len` bytes (a hole) at `rel` in place of the one there, and
    /// returns it. The old file is never written: whoever holds it (an open handle, the
    /// kernel's passthrough backing, a mapping) keeps reading its bytes whole. The new file
    /// is made in `tmp/` (mode 0600, exclusive) and renamed over the old one, so the name
    /// always leads to one whole file. The caller must write a record for the new file
    /// afterwards: the old record's data identity no longer matches (crash rule 4).
    pub fn replace_data(&self, rel: &Path, len: u64) -> io::Result<File> {
        self.removals.settle(rel, Scope::Entry);
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        if let Some(parent) = rel.parent() {
            mkdir_p(&self.data, parent)?;
        }
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = PathBuf::from(format!("new-{}-{n}", std::process::id()));
        let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL;
        let file = File::from(self.tmp.openat(&name, flags, 0o600)?);
        let (tdir, tname) = self.data.parent(rel)?;
        let (fdir, fname) = self.tmp.parent(&name)?;
        let placed = file.set_len(len).and_then(|_| {
            cvt(unsafe {
                libc::renameat(
                    fdir.as_raw_fd(),
                    fname.as_ptr(),
                    tdir.as_raw_fd(),
                    tname.as_ptr(),
                )
            })
            .map(|_| ())
        });
        if let Err(e) = placed {
            let _ = self.tmp.unlink(&name);
            return Err(e);
        }
        Ok(file)
    }

    /// Opens the data file and record of `rel` if both exist and are hoardfs's own (never
    /// creates anything; a planted link or special file counts as absent).
    pub fn open_existing(&self, rel: &Path) -> Option<CacheFiles> {
        self.removals.settle(rel, Scope::Entry);
        let open = |tree: &BeneathRoot| {
            let fd = tree.openat(rel, OFlags::RDWR | OFlags::NONBLOCK, 0).ok()?;
            let st = fstat(fd.as_fd()).ok()?;
            is_ours(&st, false).then(|| File::from(fd))
        };
        let meta = open(&self.meta)?;
        Some(CacheFiles::new(open(&self.data)?, meta))
    }

    /// Saves the listing of a directory, replacing the old one atomically.
    pub fn save_listing(&self, listing: &DirListing) -> io::Result<()> {
        let name = listing::file_name(&listing.path);
        let tmp = PathBuf::from(format!("{name}.tmp"));
        private_file(&self.dirs, &tmp, OFlags::WRONLY | OFlags::TRUNC, true)?
            .write_all(&listing.encode())?;
        self.dirs.rename(&tmp, Path::new(&name), 0)
    }

    /// The saved listing of directory `rel`, if there is a whole, valid one.
    pub fn load_listing(&self, rel: &Path) -> Option<DirListing> {
        let fd = self
            .dirs
            .openat(Path::new(&listing::file_name(rel)), OFlags::RDONLY, 0)
            .ok()?;
        let mut bytes = Vec::new();
        File::from(fd).read_to_end(&mut bytes).ok()?;
        DirListing::decode(&bytes).filter(|l| l.path == rel)
    }

    /// Forgets the listing of `rel` (its directory changed through the mount).
    pub fn drop_listing(&self, rel: &Path) {
        if let Err(e) = self.dirs.unlink(Path::new(&listing::file_name(rel)))
            && e.raw_os_error() != Some(libc::ENOENT)
        {
            tracing::debug!(?rel, "cannot drop listing: {e}");
        }
    }

    /// Removes the cache entry of `rel` (its record and data file; a directory there is
    /// removed whole) and says what it held. The files' inodes are freed by the reaper,
    /// which closes the descriptors held across their unlinks.
    pub fn remove_entry(&self, rel: &Path) -> io::Result<Removed> {
        self.removals.settle(rel, Scope::Subtree);
        remove_entry(&self.trees(), &self.reaper, rel)
    }

    /// Removes the cache entry of `rel` as `remove_entry` does, but off the caller's path
    /// (`removals.rs`): every operation of the store on that name waits for it.
    pub fn remove_entry_later(&self, rel: &Path, report: Report) {
        self.removals.remove_later(rel, report);
    }

    /// `remove_entry_later` for a removal asked on a finding that may be old when it is
    /// done: done only if `still_due` says so then (`removals::StillDue`).
    pub fn remove_entry_later_if(&self, rel: &Path, still_due: StillDue, report: Report) {
        self.removals.remove_later_if(rel, still_due, report);
    }

    /// Removes whatever the cache holds for `rel` (file or directory subtree).
    pub fn remove(&self, rel: &Path) -> io::Result<()> {
        self.removals.settle(rel, Scope::Subtree);
        remove_tree(&self.meta, rel)?;
        remove_tree(&self.data, rel)
    }

    /// Mirrors a rename of the source. On any failure both names are dropped from the cache,
    /// which is always safe.
    pub fn rename(&self, from: &Path, to: &Path, flags: u32) {
        self.removals.settle(from, Scope::Subtree);
        self.removals.settle(to, Scope::Subtree);
        // rename moves the data file's ctime: records that vouched for their data before
        // the rename are rewritten to vouch for it after.
        let valid_before = |rel: &Path| {
            self.open_existing(rel)
                .is_some_and(|f| matches!(read_record(&f), Ok(Some(Ok(_)))))
        };
        let exchange = flags & libc::RENAME_EXCHANGE != 0;
        let keep = [
            (valid_before(from), to),
            (exchange && valid_before(to), from),
        ];
        let result = (|| -> io::Result<()> {
            for tree in [&self.meta, &self.data] {
                if let Some(parent) = to.parent() {
                    mkdir_p(tree, parent)?;
                }
                match tree.rename(from, to, flags) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                        // Nothing cached under the old name: make sure the new one is clean.
                        if flags & libc::RENAME_EXCHANGE != 0 {
                            remove_tree(tree, from)?;
                        }
                        remove_tree(tree, to)?;
                    }
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })();
        if let Err(e) = result {
            tracing::warn!(?from, ?to, "cache rename failed ({e}); dropping both names");
            let _ = self.remove(from);
            let _ = self.remove(to);
            return;
        }
        for (valid, now_at) in keep {
            if let (true, Some(files)) = (valid, self.open_existing(now_at))
                && let Ok(Some(Ok(rec))) = read_record_unchecked(&files.meta)
                && write_record(&files, &rec, false).is_err()
            {
                let _ = self.remove(now_at);
            }
        }
    }

    /// Bytes the data file of `rel` occupies on disk.
    pub fn data_bytes(&self, rel: &Path) -> u64 {
        self.removals.settle(rel, Scope::Entry);
        self.data.stat(rel).map(|st| st.blocks * 512).unwrap_or(0)
    }
}

/// The first line of a valid `FORMAT` file's bytes; `Err` names what was found instead.
pub fn check_format(bytes: &[u8]) -> Result<(), String> {
    if bytes == FORMAT_LINE.as_bytes() {
        Ok(())
    } else {
        let shown: String = String::from_utf8_lossy(bytes).chars().take(40).collect();
        Err(format!("{:?}", shown.trim()))
    }
}

fn rustix_io(e: rustix::io::Errno) -> io::Error {
    io::Error::from_raw_os_error(e.raw_os_error())
}

/// Free bytes (for an unprivileged user) on the file system of the open directory `fd`.
pub fn fs_free(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<u64> {
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    cvt(unsafe { libc::fstatvfs(fd.as_raw_fd(), &mut st) })?;
    Ok(st.f_bavail * st.f_frsize)
}

/// Whether `st` is an entry hoardfs made: owned by this process's user and, for a file, a
/// regular file with one link (a second link would lead elsewhere: writing it would write
/// there).
pub fn is_ours(st: &Stat, dir: bool) -> bool {
    static EUID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let ty = st.mode & libc::S_IFMT;
    st.uid == *EUID.get_or_init(|| rustix::process::geteuid().as_raw())
        && if dir {
            ty == libc::S_IFDIR
        } else {
            ty == libc::S_IFREG && st.nlink == 1
        }
}

/// Opens the file `rel` beneath `tree` with `flags` (`O_APPEND`, `O_TRUNC` as asked),
/// creating it 0600 if missing; makes it 0600 if it was more open. Nothing is written
/// (nor truncated) before the file is known to be hoardfs's: a symlink, directory or
/// special file under its name is never hoardfs's and is removed (the name only, never
/// what it leads to) and the file made anew; a regular file with another link (which
/// would lead elsewhere) or of another user is replaced too with `replace`, and is an
/// error without (for files whose content must not be lost, such as the offline log).
pub fn private_file(
    tree: &BeneathRoot,
    rel: &Path,
    flags: OFlags,
    replace: bool,
) -> io::Result<File> {
    let trunc = flags.contains(OFlags::TRUNC);
    // Non-blocking: opening a planted FIFO must not hang the daemon.
    let flags = (flags - OFlags::TRUNC - OFlags::EXCL) | OFlags::CREATE | OFlags::NONBLOCK;
    let shown = tree.root_path().join(rel);
    // After a removal the file is made anew, exclusively.
    let mut excl = OFlags::empty();
    let (mut removed, mut raced) = (0, 0);
    while removed < 3 {
        let why = match tree.openat(rel, flags | excl, 0o600) {
            Ok(fd) => {
                let st = fstat(fd.as_fd())?;
                if st.nlink == 0 && st.mode & libc::S_IFMT == libc::S_IFREG && raced < 1000 {
                    // Replaced under us (a new version renamed over the name,
                    // `replace_data`) between the open and the fstat: the name leads to
                    // that new file now, which must not be removed. Open it again.
                    raced += 1;
                    continue;
                }
                if is_ours(&st, false) {
                    if st.mode & 0o7077 != 0 {
                        rustix::fs::fchmod(&fd, rustix::fs::Mode::from_raw_mode(0o600))
                            .map_err(rustix_io)?;
                    }
                    // (F_SETFL takes only the status flags of these: the access mode and
                    // creation flags are ignored.)
                    rustix::fs::fcntl_setfl(&fd, flags - OFlags::NONBLOCK).map_err(rustix_io)?;
                    let f = File::from(fd);
                    if trunc {
                        f.set_len(0)?;
                    }
                    return Ok(f);
                }
                if st.mode & libc::S_IFMT != libc::S_IFREG {
                    format!("not a regular file (mode {:o})", st.mode)
                } else if !replace {
                    return Err(io::Error::other(format!(
                        "{}: a file with {} links, of uid {}: not hoardfs's own; move it away",
                        shown.display(),
                        st.nlink,
                        st.uid
                    )));
                } else if st.nlink != 1 {
                    format!("a file with {} links", st.nlink)
                } else {
                    format!("a file of uid {}", st.uid)
                }
            }
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ELOOP | libc::EISDIR | libc::ENXIO | libc::EEXIST)
                ) =>
            {
                format!("not a regular file ({e})")
            }
            Err(e) => return Err(e),
        };
        tracing::warn!("{}: {why}: replacing it", shown.display());
        remove_tree(tree, rel)?;
        excl = OFlags::EXCL;
        removed += 1;
    }
    Err(io::Error::from_raw_os_error(libc::EEXIST))
}

/// Creates (0700) or opens the directory `rel` beneath `tree` as a tree of its own, and
/// makes it owner-only. A symlink or file under its name is never hoardfs's and is removed
/// (the name only) and the directory made anew; a directory of another user is replaced
/// too with `replace`, and is an error without.
pub fn private_dir(tree: &BeneathRoot, rel: &Path, replace: bool) -> io::Result<BeneathRoot> {
    let shown = tree.root_path().join(rel);
    for _ in 0..2 {
        match tree.mkdir(rel, 0o700) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(e),
        }
        let why = match tree.openat(rel, OFlags::RDONLY | OFlags::DIRECTORY, 0) {
            Ok(fd) => {
                let st = fstat(fd.as_fd())?;
                if is_ours(&st, true) {
                    if st.mode & 0o7077 != 0 {
                        rustix::fs::fchmod(&fd, rustix::fs::Mode::from_raw_mode(0o700))
                            .map_err(rustix_io)?;
                    }
                    return Ok(BeneathRoot::from_fd(fd, shown));
                }
                if !replace {
                    return Err(io::Error::other(format!(
                        "{}: a directory of uid {}, not hoardfs's own; move it away",
                        shown.display(),
                        st.uid
                    )));
                }
                format!("a directory of uid {}", st.uid)
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                "not a directory (a symlink or a file)".to_string()
            }
            Err(e) => return Err(e),
        };
        tracing::warn!("{}: {why}: replacing it", shown.display());
        remove_tree(tree, rel)?;
    }
    Err(io::Error::from_raw_os_error(libc::EEXIST))
}

/// The bytes of the regular file `rel` beneath `tree`. A link or special file under its
/// name is never hoardfs's and is never followed: it reads as absent (`NotFound`), and
/// `replace_file` replaces it.
pub fn read_small_file(tree: &BeneathRoot, rel: &Path) -> io::Result<Vec<u8>> {
    let not_ours = || {
        let shown = tree.root_path().join(rel);
        tracing::warn!("{}: not a regular file: ignoring it", shown.display());
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("{}: not a regular file", shown.display()),
        )
    };
    let fd = match tree.openat(rel, OFlags::RDONLY | OFlags::NONBLOCK, 0) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(not_ours()),
        Err(e) => return Err(e),
    };
    if fstat(fd.as_fd())?.mode & libc::S_IFMT != libc::S_IFREG {
        return Err(not_ours());
    }
    let mut buf = Vec::new();
    File::from(fd).read_to_end(&mut buf)?;
    Ok(buf)
}

/// Replaces the file `rel` beneath `tree` with `bytes`, durably and atomically (a fresh
/// 0600 temporary file renamed over it: nothing is ever written through a link).
pub fn replace_file(tree: &BeneathRoot, rel: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut tmp = rel.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = private_file(tree, &tmp, OFlags::WRONLY | OFlags::TRUNC, true)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    tree.rename(&tmp, rel, 0)?;
    let _ = rustix::fs::fsync(tree.root_fd());
    Ok(())
}

/// `mkdir -p` beneath `tree`, replacing any non-directory in the way (it is stale cache).
fn mkdir_p(tree: &BeneathRoot, rel: &Path) -> io::Result<()> {
    // Nearly always there already: one lookup (beneath the root, no symlink followed)
    // instead of a mkdir and a stat per component (issue 22: 8 failed mkdirs per file
    // created through the mount).
    if tree.stat(rel).is_ok_and(|st| st.is_dir()) {
        return Ok(());
    }
    // A new directory's parent nearly always exists: made from the bottom up, one mkdir
    // each for the missing ones (a tree unpacked through the mount made `depth` failed
    // mkdirs and stats per new directory, top down).
    if mkdir_up(tree, rel)? {
        return Ok(());
    }
    // Something other than a directory in the way (a link or file planted, or stale):
    // each component is made or replaced, top down.
    let mut cur = PathBuf::new();
    for c in rel.components() {
        cur.push(c);
        match tree.mkdir(&cur, 0o700) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                if !tree.stat(&cur)?.is_dir() {
                    tree.unlink(&cur)?;
                    tree.mkdir(&cur, 0o700)?;
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Makes the directory `rel` and its missing ancestors, from the bottom up. False if a
/// component is in the way (not a directory, or a link), which the caller replaces.
fn mkdir_up(tree: &BeneathRoot, rel: &Path) -> io::Result<bool> {
    let made = |r: io::Result<()>| match r {
        Ok(()) => Ok(true),
        Err(e) => match e.raw_os_error() {
            // Made meanwhile (another thread), or something else is there.
            Some(libc::EEXIST) => Ok(tree.stat(rel)?.is_dir()),
            Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP) => Ok(false),
            _ => Err(e),
        },
    };
    match tree.mkdir(rel, 0o700) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            match rel.parent().filter(|p| !p.as_os_str().is_empty()) {
                Some(parent) if mkdir_up(tree, parent)? => made(tree.mkdir(rel, 0o700)),
                _ => Ok(false),
            }
        }
        r => made(r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::record::{CacheRecord, SourceIdentity};
    use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};

    #[test]
    fn refuses_a_foreign_non_empty_directory_and_a_second_user() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("precious"), b"x").unwrap();
        let err = CacheStore::open(d.path()).unwrap_err().to_string();
        assert!(err.contains("not a hoardfs cache"), "{err}");

        let c = tempfile::tempdir().unwrap();
        let _first = CacheStore::open(c.path()).unwrap();
        let err = CacheStore::open(c.path()).unwrap_err().to_string();
        assert!(err.contains("in use"), "{err}");
    }

    #[test]
    fn files_records_and_type_conflicts() {
        let c = tempfile::tempdir().unwrap();
        let s = CacheStore::open(c.path()).unwrap();
        let f = s.open_files(Path::new("a/b/c.txt")).unwrap();
        assert!(read_record(&f).unwrap().is_none());
        let rec = CacheRecord::empty(
            SourceIdentity {
                size: 5,
                ..Default::default()
            },
            4,
        );
        write_record(&f, &rec, true).unwrap();
        let back = read_record(&f).unwrap().unwrap().unwrap();
        assert_eq!(back.identity, rec.identity);
        assert_eq!(back.data.ino, f.data.metadata().unwrap().ino());
        // Any change to the data file behind the record's back is caught.
        std::thread::sleep(std::time::Duration::from_millis(20));
        f.data.write_all_at(b"x", 0).unwrap();
        assert_eq!(
            read_record(&f).unwrap().unwrap(),
            Err(crate::cache::record::RecordError::DataChanged)
        );
        // A new version put in place under the name: the record is another file's.
        let mut f = f;
        f.data = s.replace_data(Path::new("a/b/c.txt"), 5).unwrap();
        assert_eq!(
            read_record(&f).unwrap().unwrap(),
            Err(crate::cache::record::RecordError::OtherDataFile)
        );
        // A file where a directory must go is replaced.
        s.open_files(Path::new("a/b/c.txt/d")).unwrap();
        // And a directory where a file must go.
        s.open_files(Path::new("a/b")).unwrap();
        s.rename(Path::new("a/b"), Path::new("x/y"), 0);
        assert!(c.path().join("data/x/y").is_file());
        s.remove(Path::new("x")).unwrap();
        assert!(!c.path().join("data/x").exists());
    }

    #[test]
    fn the_cache_is_private_and_renames_keep_records_valid() {
        let c = tempfile::tempdir().unwrap();
        let root = c.path().join("cache");
        std::fs::create_dir(&root).unwrap();
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
        let s = CacheStore::open(&root).unwrap();
        for d in ["", "data", "meta"] {
            let mode = std::fs::metadata(root.join(d))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o700, "{d:?}");
        }
        let f = s.open_files(Path::new("d/f")).unwrap();
        let rec = CacheRecord::empty(SourceIdentity::default(), 4);
        write_record(&f, &rec, true).unwrap();
        drop(f);
        std::thread::sleep(std::time::Duration::from_millis(20));
        s.rename(Path::new("d/f"), Path::new("e/g"), 0);
        let f = s.open_existing(Path::new("e/g")).unwrap();
        assert!(matches!(read_record(&f), Ok(Some(Ok(_)))));
    }

    /// Two openings of one entry (two states of one path at once): a shorter record
    /// written through one after a longer one was written through the other leaves no
    /// tail of the longer behind it (the session-18 regression: a length remembered from
    /// the first opening's read cut nothing, and the next read failed its checksum).
    #[test]
    fn a_shorter_record_after_another_openings_longer_one_reads_back_whole() {
        let c = tempfile::tempdir().unwrap();
        let s = CacheStore::open(&c.path().join("cache")).unwrap();
        let short = CacheRecord::empty(SourceIdentity::default(), 4);
        let one = s.open_files(Path::new("f")).unwrap();
        write_record(&one, &short, false).unwrap();
        assert!(matches!(read_record(&one), Ok(Some(Ok(_)))));
        let other = s.open_existing(Path::new("f")).unwrap();
        let mut long = short.clone();
        long.resize(4 << 20);
        write_record(&other, &long, false).unwrap();
        write_record(&one, &short, false).unwrap();
        let back = read_record(&other).unwrap().unwrap();
        assert_eq!(back.map(|r| r.identity), Ok(short.identity));
    }

    /// A record whose only change is a last use less than `LAST_USED_GRAIN_MS` later is
    /// not rewritten; any other change, a later use, or a data file changed since, is.
    #[test]
    fn a_record_is_not_rewritten_for_a_recent_last_use_alone() {
        let c = tempfile::tempdir().unwrap();
        let s = CacheStore::open(&c.path().join("cache")).unwrap();
        let f = s.open_files(Path::new("d/f")).unwrap();
        let mut rec = CacheRecord::empty(SourceIdentity::default(), 4);
        rec.last_used = 1_000_000;
        write_record(&f, &rec, false).unwrap();
        let on_disk = |f: &CacheFiles| read_record_unchecked(&f.meta).unwrap().unwrap().unwrap();
        rec.last_used += LAST_USED_GRAIN_MS - 1;
        assert!(!write_record_unless_same(&f, &rec).unwrap());
        assert_eq!(on_disk(&f).last_used, 1_000_000);
        // The same, read back by another opening of the entry (a load).
        drop(f);
        let f = s.open_existing(Path::new("d/f")).unwrap();
        assert!(matches!(read_record(&f), Ok(Some(Ok(_)))));
        assert!(!write_record_unless_same(&f, &rec).unwrap());
        rec.last_used = 1_000_000 + LAST_USED_GRAIN_MS;
        assert!(write_record_unless_same(&f, &rec).unwrap());
        assert_eq!(on_disk(&f).last_used, rec.last_used);
        rec.identity.size = 4;
        rec.resize(4);
        assert!(write_record_unless_same(&f, &rec).unwrap());
        assert_eq!(on_disk(&f).identity.size, 4);
        // Bytes written to the data file move its ctime: the record vouches anew.
        std::thread::sleep(std::time::Duration::from_millis(20));
        f.data.write_all_at(b"abcd", 0).unwrap();
        assert!(write_record_unless_same(&f, &rec).unwrap());
        assert!(matches!(read_record(&f), Ok(Some(Ok(_)))));
        // Unknown after the record file was swapped: written.
        let mut f = f;
        f.replace_meta(scratch_file().unwrap());
        assert!(write_record_unless_same(&f, &rec).unwrap());
    }

    #[test]
    fn planted_links_and_special_files_are_replaced_never_followed() {
        let outside = tempfile::tempdir().unwrap();
        let victim = outside.path().join("victim");
        std::fs::write(&victim, b"outside").unwrap();
        std::fs::set_permissions(outside.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let c = tempfile::tempdir().unwrap();
        let s = CacheStore::open(c.path()).unwrap();
        let top = s.top();
        std::os::unix::fs::symlink(&victim, c.path().join("link")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("new"), c.path().join("dangling")).unwrap();
        std::fs::hard_link(&victim, c.path().join("hard")).unwrap();
        let fifo =
            std::ffi::CString::new(c.path().join("fifo").into_os_string().into_encoded_bytes())
                .unwrap();
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        for name in ["link", "dangling", "hard", "fifo"] {
            let mut f = private_file(top, Path::new(name), OFlags::WRONLY | OFlags::TRUNC, true)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            f.write_all(b"mine").unwrap();
            let m = std::fs::symlink_metadata(c.path().join(name)).unwrap();
            assert!(m.is_file() && m.nlink() == 1, "{name}");
            assert_eq!(m.permissions().mode() & 0o7777, 0o600, "{name}");
        }
        // Content that must not be lost (the offline log) is never replaced silently.
        std::fs::hard_link(&victim, c.path().join("log")).unwrap();
        let err = private_file(top, Path::new("log"), OFlags::RDWR | OFlags::APPEND, false);
        assert!(err.unwrap_err().to_string().contains("links"));
        // A directory planted as a symlink or a file.
        std::os::unix::fs::symlink(outside.path(), c.path().join("d")).unwrap();
        std::fs::write(c.path().join("e"), b"x").unwrap();
        for name in ["d", "e"] {
            let d = private_dir(top, Path::new(name), false).unwrap();
            d.mkdir(Path::new("sub"), 0o700).unwrap();
            assert!(
                std::fs::symlink_metadata(c.path().join(name))
                    .unwrap()
                    .is_dir()
            );
        }
        assert_eq!(std::fs::read(&victim).unwrap(), b"outside");
        let names: Vec<_> = std::fs::read_dir(outside.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["victim"]);
        assert_eq!(
            std::fs::metadata(outside.path())
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o755,
            "the directory outside was chmodded"
        );
    }

    /// `open_files` opens the entry's files first and makes their directories only when
    /// that fails: a symlink or a file planted where a directory of the entry belongs is
    /// replaced by a directory, never followed.
    #[test]
    fn entries_under_planted_directories_are_made_in_real_ones() {
        let outside = tempfile::tempdir().unwrap();
        let c = tempfile::tempdir().unwrap();
        let s = CacheStore::open(c.path()).unwrap();
        std::os::unix::fs::symlink(outside.path(), c.path().join("data/a")).unwrap();
        std::fs::write(c.path().join("meta/a"), b"planted").unwrap();
        let files = s.open_files(Path::new("a/b/f")).unwrap();
        files.data.write_all_at(b"data", 0).unwrap();
        for tree in ["data", "meta"] {
            let dir = std::fs::symlink_metadata(c.path().join(tree).join("a")).unwrap();
            assert!(dir.is_dir(), "{tree}/a is a real directory now");
        }
        assert_eq!(std::fs::read(c.path().join("data/a/b/f")).unwrap(), b"data");
        assert_eq!(std::fs::read_dir(outside.path()).unwrap().count(), 0);
        // Opened again, by the short way.
        assert!(s.open_files(Path::new("a/b/f")).is_ok());
    }

    #[test]
    fn missing_directories_are_made_bottom_up_private() {
        use std::os::unix::fs::PermissionsExt;
        let c = tempfile::tempdir().unwrap();
        let s = CacheStore::open(c.path()).unwrap();
        s.open_files(Path::new("x/f")).unwrap();
        // Three levels missing under an existing one, then a sibling of the deepest.
        s.open_files(Path::new("x/y/z/w/f")).unwrap();
        s.open_files(Path::new("x/y/z/v/f")).unwrap();
        for tree in ["data", "meta"] {
            for d in ["x/y", "x/y/z", "x/y/z/w", "x/y/z/v"] {
                let m = std::fs::symlink_metadata(c.path().join(tree).join(d)).unwrap();
                assert!(m.is_dir(), "{tree}/{d}");
                assert_eq!(m.permissions().mode() & 0o7777, 0o700, "{tree}/{d}");
            }
            assert!(c.path().join(tree).join("x/y/z/v/f").is_file());
        }
    }

    /// An open of the data file that races a new version renamed over its name (another
    /// open of a file replaced behind the mount) may find the old file with no links left:
    /// it must open the name again, never remove it (that would unlink the new version's
    /// file under its owner).
    #[test]
    fn an_open_racing_replace_data_never_removes_the_new_file() {
        let c = tempfile::tempdir().unwrap();
        let s = std::sync::Arc::new(CacheStore::open(c.path()).unwrap());
        s.open_files(Path::new("f")).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let opener = {
            let (s, stop) = (s.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    s.open_files(Path::new("f")).unwrap();
                    n += 1;
                }
                n
            })
        };
        let mut unlinked = 0;
        let t0 = std::time::Instant::now();
        while t0.elapsed() < std::time::Duration::from_secs(2) {
            let new = s.replace_data(Path::new("f"), 10).unwrap();
            // Another's removal comes right after its open saw the old file.
            std::thread::yield_now();
            std::thread::sleep(std::time::Duration::from_micros(50));
            if fstat(new.as_fd()).unwrap().nlink == 0 {
                unlinked += 1;
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let opens = opener.join().unwrap();
        assert!(opens > 100, "{opens} opens");
        assert_eq!(unlinked, 0, "new data files unlinked by a racing open");
    }

    #[test]
    fn replace_data_leaves_the_old_file_whole_to_its_holders() {
        let c = tempfile::tempdir().unwrap();
        let s = CacheStore::open(c.path()).unwrap();
        let old = s.open_files(Path::new("d/f")).unwrap();
        old.data.write_all_at(b"old bytes", 0).unwrap();
        let new = s.replace_data(Path::new("d/f"), 5).unwrap();
        new.write_all_at(b"new", 0).unwrap();
        let mut buf = [0u8; 9];
        old.data.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"old bytes");
        assert_eq!(
            std::fs::read(c.path().join("data/d/f")).unwrap(),
            b"new\0\0"
        );
        let mode = std::fs::metadata(c.path().join("data/d/f")).unwrap().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(std::fs::read_dir(c.path().join("tmp")).unwrap().count(), 0);
        drop(s);
        // What a crash leaves in tmp/ goes at the next start; a symlink there is not
        // followed.
        std::fs::write(c.path().join("tmp/new-1-1"), b"x").unwrap();
        let s = CacheStore::open(c.path()).unwrap();
        assert_eq!(std::fs::read_dir(c.path().join("tmp")).unwrap().count(), 0);
        drop(s);
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("precious"), b"x").unwrap();
        std::fs::remove_dir(c.path().join("tmp")).unwrap();
        std::os::unix::fs::symlink(outside.path(), c.path().join("tmp")).unwrap();
        let _s = CacheStore::open(c.path()).unwrap();
        assert!(outside.path().join("precious").exists());
        assert!(
            std::fs::symlink_metadata(c.path().join("tmp"))
                .unwrap()
                .is_dir()
        );
    }

    #[test]
    fn format_file() {
        assert!(check_format(FORMAT_LINE.as_bytes()).is_ok());
        assert!(check_format(b"").is_err());
        assert!(check_format(b"hoardfs cache 1").is_err());
        assert!(check_format(&[0xff, 0xfe, b'\n']).is_err());
    }
}

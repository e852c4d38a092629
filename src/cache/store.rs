//! File-level operations on the cache directory. All paths are resolved beneath the cache
//! root without following symlinks, like the source's (the cache dir may be shared or
//! tampered with; it is never trusted to lead elsewhere).

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::OFlags;

use super::listing::{self, DirListing};
use super::record::CacheRecord;
use crate::source::{BeneathRoot, cvt};

const FORMAT_LINE: &str = "hoardfs cache 1\n";

/// How long opening waits for another daemon to release the cache directory.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The cache directory of one mount.
#[derive(Debug)]
pub struct CacheStore {
    data: BeneathRoot,
    meta: BeneathRoot,
    /// Directory listings for disconnected operation (`listing.rs`).
    dirs: BeneathRoot,
    root: PathBuf,
    /// Held for the life of the store: one daemon per cache directory.
    _lock: File,
}

/// The two open files of one cached source file.
#[derive(Debug)]
pub struct CacheFiles {
    pub data: File,
    pub meta: File,
}

impl CacheStore {
    /// Opens (creating if needed) the cache at `root` and locks it for this process.
    pub fn open(root: &Path) -> anyhow::Result<CacheStore> {
        use anyhow::Context;
        std::fs::create_dir_all(root)
            .with_context(|| format!("cannot create cache directory {}", root.display()))?;
        let format_path = root.join("FORMAT");
        match std::fs::read_to_string(&format_path) {
            Ok(s) if s == FORMAT_LINE => {}
            Ok(s) => anyhow::bail!(
                "cache directory {} holds an unknown format ({:?}); use another --cache-dir or empty it",
                root.display(),
                s.trim()
            ),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let is_empty = std::fs::read_dir(root)?.next().is_none();
                if !is_empty {
                    anyhow::bail!(
                        "cache directory {} is not empty and is not a hoardfs cache; refusing to use it",
                        root.display()
                    );
                }
                std::fs::write(&format_path, FORMAT_LINE)?;
            }
            Err(e) => return Err(e).context("cannot read the cache FORMAT file"),
        }
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(root.join("lock"))?;
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
        for sub in ["data", "meta", "dirs"] {
            std::fs::create_dir_all(root.join(sub))?;
        }
        Ok(CacheStore {
            data: BeneathRoot::open(&root.join("data"))?,
            meta: BeneathRoot::open(&root.join("meta"))?,
            dirs: BeneathRoot::open(&root.join("dirs"))?,
            root: root.to_path_buf(),
            _lock: lock,
        })
    }

    /// The data tree (the mirrored source names).
    pub fn data_dir(&self) -> &BeneathRoot {
        &self.data
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Opens the data file and record of `rel`, creating them (and their directories).
    pub fn open_files(&self, rel: &Path) -> io::Result<CacheFiles> {
        let open = |tree: &BeneathRoot| -> io::Result<File> {
            if let Some(parent) = rel.parent() {
                mkdir_p(tree, parent)?;
            }
            let flags = OFlags::RDWR | OFlags::CREATE;
            match tree.openat(rel, flags, 0o600) {
                Ok(fd) => Ok(File::from(fd)),
                // A directory (or symlink) sits where the file belongs: it is stale.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EISDIR | libc::ELOOP)) => {
                    remove_tree(tree, rel)?;
                    Ok(File::from(tree.openat(rel, flags, 0o600)?))
                }
                Err(e) => Err(e),
            }
        };
        Ok(CacheFiles {
            data: open(&self.data)?,
            meta: open(&self.meta)?,
        })
    }

    /// Opens the data file and record of `rel` if both exist (never creates anything).
    pub fn open_existing(&self, rel: &Path) -> Option<CacheFiles> {
        let open = |tree: &BeneathRoot| tree.openat(rel, OFlags::RDWR, 0).ok().map(File::from);
        Some(CacheFiles {
            meta: open(&self.meta)?,
            data: open(&self.data)?,
        })
    }

    /// Saves the listing of a directory, replacing the old one atomically.
    pub fn save_listing(&self, listing: &DirListing) -> io::Result<()> {
        let name = listing::file_name(&listing.path);
        let tmp = PathBuf::from(format!("{name}.tmp"));
        let fd = self
            .dirs
            .openat(&tmp, OFlags::WRONLY | OFlags::CREATE | OFlags::TRUNC, 0o600)?;
        File::from(fd).write_all(&listing.encode())?;
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

    /// Removes whatever the cache holds for `rel` (file or directory subtree).
    pub fn remove(&self, rel: &Path) -> io::Result<()> {
        remove_tree(&self.meta, rel)?;
        remove_tree(&self.data, rel)
    }

    /// Mirrors a rename of the source. On any failure both names are dropped from the cache,
    /// which is always safe.
    pub fn rename(&self, from: &Path, to: &Path, flags: u32) {
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
        }
    }

    /// Bytes the data file of `rel` occupies on disk.
    pub fn data_bytes(&self, rel: &Path) -> u64 {
        self.data.stat(rel).map(|st| st.blocks * 512).unwrap_or(0)
    }
}

/// Reads and checks a record. `Ok(None)` for an empty file (new entry); an error for a
/// record that is torn, corrupt or of another format (the caller discards the cache entry).
pub fn read_record(
    meta: &File,
) -> io::Result<Option<Result<CacheRecord, super::record::RecordError>>> {
    let mut buf = Vec::new();
    let mut f = meta;
    f.seek(SeekFrom::Start(0))?;
    f.read_to_end(&mut buf)?;
    if buf.is_empty() {
        return Ok(None);
    }
    Ok(Some(CacheRecord::decode(&buf)))
}

/// Overwrites the record in place; with `durable` it is on disk when this returns. A torn
/// in-place write is caught by the record's checksum.
pub fn write_record(meta: &File, rec: &CacheRecord, durable: bool) -> io::Result<()> {
    let bytes = rec.encode();
    let mut f = meta;
    f.seek(SeekFrom::Start(0))?;
    f.write_all(&bytes)?;
    meta.set_len(bytes.len() as u64)?;
    if durable {
        meta.sync_data()?;
    }
    Ok(())
}

/// `mkdir -p` beneath `tree`, replacing any non-directory in the way (it is stale cache).
fn mkdir_p(tree: &BeneathRoot, rel: &Path) -> io::Result<()> {
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

/// Removes `rel` beneath `tree`, recursively for directories, never following symlinks.
/// A missing entry is not an error.
pub fn remove_tree(tree: &BeneathRoot, rel: &Path) -> io::Result<()> {
    let (dir, name) = match tree.parent(rel) {
        Ok(x) => x,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOTDIR)) => return Ok(()),
        Err(e) => return Err(e),
    };
    remove_at(&dir, &name)
}

fn remove_at(dir: &OwnedFd, name: &CString) -> io::Result<()> {
    let r = unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) };
    if r == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::ENOENT) => Ok(()),
        Some(libc::EISDIR) => {
            let fd = unsafe {
                libc::openat(
                    dir.as_raw_fd(),
                    name.as_ptr(),
                    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                )
            };
            let sub = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(cvt(fd)?) };
            let names: Vec<CString> = {
                let mut d = rustix::fs::Dir::read_from(sub.as_fd())
                    .map_err(|e| io::Error::from_raw_os_error(e.raw_os_error()))?;
                let mut v = Vec::new();
                while let Some(ent) = d.read() {
                    let ent = ent.map_err(|e| io::Error::from_raw_os_error(e.raw_os_error()))?;
                    let n = ent.file_name();
                    if n.to_bytes() != b"." && n.to_bytes() != b".." {
                        v.push(n.to_owned());
                    }
                }
                v
            };
            for n in &names {
                remove_at(&sub, n)?;
            }
            cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) })?;
            Ok(())
        }
        _ => Err(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::record::SourceIdentity;

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
        assert!(read_record(&f.meta).unwrap().is_none());
        let rec = CacheRecord::empty(
            SourceIdentity {
                size: 5,
                ..Default::default()
            },
            4,
        );
        write_record(&f.meta, &rec, true).unwrap();
        assert_eq!(read_record(&f.meta).unwrap().unwrap().unwrap(), rec);
        // A file where a directory must go is replaced.
        s.open_files(Path::new("a/b/c.txt/d")).unwrap();
        // And a directory where a file must go.
        s.open_files(Path::new("a/b")).unwrap();
        s.rename(Path::new("a/b"), Path::new("x/y"), 0);
        assert!(c.path().join("data/x/y").is_file());
        s.remove(Path::new("x")).unwrap();
        assert!(!c.path().join("data/x").exists());
    }
}

//! What the cache remembers of its source (`CACHE_DIR/source.json`): the kind of file
//! system and the root it was filled from. A later mount uses it to start offline when the
//! source cannot be reached, and to refuse a path that now leads to another file system (a
//! network share that is not mounted leaves its empty mount point behind: serving that
//! would hide the cache, and writing there would put files in the wrong place).

use std::io;
use std::os::fd::BorrowedFd;
use std::path::Path;

use crate::source::BeneathRoot;

use serde::{Deserialize, Serialize};

const FILE: &str = "source.json";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceInfo {
    /// `statfs` type of the source's file system.
    pub fs_type: i64,
    /// A network or FUSE file system (`source::is_remote`).
    pub remote: bool,
    /// Whether it keeps a file's inode number for its life (see `fs.rs`).
    pub stable_ino: bool,
    pub root_dev: u64,
    pub root_ino: u64,
}

/// File systems whose inode numbers may change while a file exists (FUSE sources such as
/// sshfs and rclone, SMB, 9p number files anew when their own caches forget them).
fn renumbers_inodes(fs_type: i64) -> bool {
    const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;
    const CIFS_MAGIC: i64 = 0xFF53_4D42;
    const SMB2_MAGIC: i64 = 0xFE53_4D42;
    const V9FS_MAGIC: i64 = 0x0102_1997;
    matches!(
        fs_type,
        FUSE_SUPER_MAGIC | CIFS_MAGIC | SMB2_MAGIC | V9FS_MAGIC
    )
}

/// The `fs_type` recorded for an object-store source (no `statfs` type exists): "S3S3".
pub const OBJECT_STORE_TYPE: i64 = 0x5333_5333;

impl SourceInfo {
    /// An object-store source whose root (the bucket or prefix) stats as `root`.
    pub fn object(root: &crate::source::Stat) -> SourceInfo {
        SourceInfo {
            fs_type: OBJECT_STORE_TYPE,
            remote: true,
            stable_ino: true,
            root_dev: root.dev,
            root_ino: root.ino,
        }
    }

    /// The source whose root directory is open as `root`.
    pub fn of(root: BorrowedFd<'_>) -> io::Result<SourceInfo> {
        let fs_type = rustix::fs::fstatfs(root)?.f_type;
        let st = crate::source::fstat(root)?;
        Ok(SourceInfo {
            fs_type,
            remote: crate::source::is_remote(root),
            stable_ino: !renumbers_inodes(fs_type),
            root_dev: st.dev,
            root_ino: st.ino,
        })
    }

    /// What an earlier mount recorded in the cache root `cache`, if anything readable.
    pub fn load(cache: &BeneathRoot) -> Option<SourceInfo> {
        let bytes = super::store::read_small_file(cache, Path::new(FILE)).ok()?;
        serde_json::from_slice(&bytes)
            .inspect_err(|e| {
                tracing::warn!("ignoring {}: {e}", cache.root_path().join(FILE).display())
            })
            .ok()
    }

    pub fn save(&self, cache: &BeneathRoot) -> io::Result<()> {
        let bytes = serde_json::to_vec(self).expect("serialises");
        super::store::replace_file(cache, Path::new(FILE), &bytes)
    }

    /// Why a source now found at the path cannot be the one this cache was filled from,
    /// if so: a network or FUSE source whose path now leads to another kind of file system.
    pub fn mismatch(&self, now: &SourceInfo) -> Option<String> {
        (self.remote && now.fs_type != self.fs_type).then(|| {
            format!(
                "the path leads to another kind of file system (type {:#x}) than the network \
                 or FUSE source this cache was filled from ({:#x}): not mounted?",
                now.fs_type, self.fs_type
            )
        })
    }

    /// The root directory's attributes as last known (for an offline start).
    pub fn root_stat(&self) -> crate::source::Stat {
        crate::source::Stat {
            dev: self.root_dev,
            ino: self.root_ino,
            mode: libc::S_IFDIR | 0o755,
            nlink: 2,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: 0,
            blocks: 0,
            blksize: 4096,
            atime: (0, 0),
            mtime: (0, 0),
            ctime: (0, 0),
            btime: (0, 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn saved_and_loaded_and_a_local_path_never_mismatches() {
        let d = tempfile::tempdir().unwrap();
        let root = std::fs::File::open(d.path()).unwrap();
        let info = SourceInfo::of(root.as_fd()).unwrap();
        let cache = BeneathRoot::open(d.path()).unwrap();
        assert!(!info.remote && info.stable_ino);
        assert_eq!(SourceInfo::load(&cache), None);
        info.save(&cache).unwrap();
        assert_eq!(SourceInfo::load(&cache), Some(info));
        assert_eq!(info.mismatch(&info), None);
        let sshfs = SourceInfo {
            fs_type: 0x6573_5546,
            remote: true,
            stable_ino: false,
            ..info
        };
        assert!(sshfs.mismatch(&info).unwrap().contains("not mounted"));
        assert_eq!(sshfs.mismatch(&sshfs), None);
        std::fs::write(d.path().join(FILE), b"{garbage").unwrap();
        assert_eq!(SourceInfo::load(&cache), None);
    }
}

//! The daemon's inode table: kernel node ids to source objects.
//!
//! Node ids are our own monotonic counter, never the source's inode number (an inode number
//! reused by the source must never reach the kernel as a node it already knows, see go-fuse
//! #372). Entries follow the kernel's lookup counts exactly: `lookup`, `create`, `mkdir`,
//! `mknod`, `symlink` and `link` add one, `forget` subtracts; at zero the entry leaves the
//! table (open handles keep their `Arc<Inode>` alive until release). Hard links share one
//! entry through the `(dev, ino)` index.
//!
//! Each entry keeps the paths of the names it is known by (the last used first); renames
//! through the mount rewrite the paths of the renamed subtree, unlinks drop a name.
//!
//! Lock order: `InodeTable::inner` before `Inode::names` before `Inode::file`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::fs::FileState;
use crate::source::Stat;

pub const ROOT_ID: u64 = 1;

#[derive(Debug)]
pub struct Inode {
    /// Immutable identity.
    pub id: u64,
    /// `S_IF*` type bits; a name whose type changes gets a new inode.
    pub file_type: u32,
    pub key: (u64, u64),
    /// Paths (relative to the source root) of the names this inode is known by, the one
    /// last used first. More than one only for hard links.
    pub names: Mutex<Vec<PathBuf>>,
    /// Cache state of a regular file while it is open through the mount.
    pub file: Mutex<Option<FileState>>,
}

impl Inode {
    /// The path of the name last used to reach this inode.
    pub fn path(&self) -> PathBuf {
        self.names
            .lock()
            .unwrap()
            .first()
            .cloned()
            .unwrap_or_default()
    }

    /// Makes `path` the name used from now on.
    pub fn set_path(&self, path: &Path) {
        let mut names = self.names.lock().unwrap();
        names.retain(|n| n != path);
        names.insert(0, path.to_path_buf());
    }

    /// `path` no longer names this inode; another known name (a hard link) takes over.
    pub fn remove_name(&self, path: &Path) {
        let mut names = self.names.lock().unwrap();
        if names.len() > 1 {
            names.retain(|n| n != path);
        }
    }

    pub fn file(&self) -> MutexGuard<'_, Option<FileState>> {
        self.file.lock().unwrap()
    }
}

#[derive(Debug, Default)]
struct Inner {
    by_id: HashMap<u64, (Arc<Inode>, u64)>,
    by_key: HashMap<(u64, u64), u64>,
    next_id: u64,
}

#[derive(Debug)]
pub struct InodeTable {
    inner: Mutex<Inner>,
}

impl InodeTable {
    pub fn new(root: &Stat) -> InodeTable {
        let mut inner = Inner {
            next_id: ROOT_ID + 1,
            ..Default::default()
        };
        let key = (root.dev, root.ino);
        let inode = Arc::new(Inode {
            id: ROOT_ID,
            file_type: libc::S_IFDIR,
            key,
            names: Mutex::new(vec![PathBuf::new()]),
            file: Mutex::new(None),
        });
        // The root is never forgotten: its count starts at one and is never released.
        inner.by_id.insert(ROOT_ID, (inode, 1));
        inner.by_key.insert(key, ROOT_ID);
        InodeTable {
            inner: Mutex::new(inner),
        }
    }

    pub fn get(&self, id: u64) -> Option<Arc<Inode>> {
        self.inner
            .lock()
            .unwrap()
            .by_id
            .get(&id)
            .map(|(i, _)| i.clone())
    }

    pub fn len(&self) -> usize {
        self.inner.lock().unwrap().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records one kernel reference to the object `st` reached at `path`, returning its
    /// entry (the existing one for a known `(dev, ino)` of the same type).
    pub fn lookup(&self, path: &Path, st: &Stat) -> Arc<Inode> {
        let mut inner = self.inner.lock().unwrap();
        let key = (st.dev, st.ino);
        if let Some(&id) = inner.by_key.get(&key)
            && let Some((inode, count)) = inner.by_id.get_mut(&id)
            && inode.file_type == st.file_type()
        {
            *count += 1;
            let inode = inode.clone();
            inode.set_path(path);
            return inode;
        }
        let id = inner.next_id;
        inner.next_id += 1;
        let inode = Arc::new(Inode {
            id,
            file_type: st.file_type(),
            key,
            names: Mutex::new(vec![path.to_path_buf()]),
            file: Mutex::new(None),
        });
        inner.by_id.insert(id, (inode.clone(), 1));
        inner.by_key.insert(key, id);
        inode
    }

    /// The kernel dropped `n` references.
    pub fn forget(&self, id: u64, n: u64) {
        if id == ROOT_ID {
            return;
        }
        let mut inner = self.inner.lock().unwrap();
        let Some((inode, count)) = inner.by_id.get_mut(&id) else {
            return;
        };
        *count = count.saturating_sub(n);
        if *count == 0 {
            let key = inode.key;
            inner.by_id.remove(&id);
            if inner.by_key.get(&key) == Some(&id) {
                inner.by_key.remove(&key);
            }
            if inner.by_id.len() * 4 < inner.by_id.capacity() && inner.by_id.capacity() > 1024 {
                inner.by_id.shrink_to_fit();
                inner.by_key.shrink_to_fit();
            }
        }
    }

    /// The last name of `inode` is gone from the source: a new object that gets the same
    /// source inode number must not be taken for it.
    pub fn unlinked(&self, inode: &Inode) {
        let mut inner = self.inner.lock().unwrap();
        if inner.by_key.get(&inode.key) == Some(&inode.id) {
            inner.by_key.remove(&inode.key);
        }
    }

    /// Rewrites the paths of every entry at or below `from` to lie below `to`; with
    /// `exchange`, the two subtrees swap.
    pub fn renamed(&self, from: &Path, to: &Path, exchange: bool) {
        let inner = self.inner.lock().unwrap();
        for (inode, _) in inner.by_id.values() {
            for p in inode.names.lock().unwrap().iter_mut() {
                if let Ok(rest) = p.strip_prefix(from) {
                    *p = join(to, rest);
                } else if exchange && let Ok(rest) = p.strip_prefix(to) {
                    *p = join(from, rest);
                }
            }
        }
    }
}

fn join(base: &Path, rest: &Path) -> PathBuf {
    if rest.as_os_str().is_empty() {
        base.to_path_buf()
    } else {
        base.join(rest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(ino: u64, mode: u32) -> Stat {
        Stat {
            dev: 1,
            ino,
            mode,
            nlink: 1,
            uid: 0,
            gid: 0,
            rdev: 0,
            size: 0,
            blocks: 0,
            blksize: 4096,
            atime: (0, 0),
            mtime: (0, 0),
            ctime: (0, 0),
        }
    }

    #[test]
    fn follows_lookup_counts_and_shares_hard_links() {
        let t = InodeTable::new(&st(2, libc::S_IFDIR));
        let a = t.lookup(Path::new("a"), &st(10, libc::S_IFREG));
        let b = t.lookup(Path::new("b"), &st(10, libc::S_IFREG));
        assert_eq!(a.id, b.id, "hard links share one entry");
        assert_eq!(a.path(), PathBuf::from("b"));
        a.remove_name(Path::new("b"));
        assert_eq!(a.path(), PathBuf::from("a"), "the other link takes over");
        a.remove_name(Path::new("a"));
        assert_eq!(
            a.path(),
            PathBuf::from("a"),
            "the last name stays (open unlinked files)"
        );
        t.forget(a.id, 1);
        assert!(t.get(a.id).is_some());
        t.forget(a.id, 1);
        assert!(t.get(a.id).is_none());
        assert_eq!(t.len(), 1);
        // A reused inode number of another type is a new object.
        let c = t.lookup(Path::new("c"), &st(11, libc::S_IFREG));
        let d = t.lookup(Path::new("c"), &st(11, libc::S_IFDIR));
        assert_ne!(c.id, d.id);
        assert!(d.id > c.id, "ids are never reused");
    }

    #[test]
    fn rename_moves_subtrees() {
        let t = InodeTable::new(&st(2, libc::S_IFDIR));
        let x = t.lookup(Path::new("d/x"), &st(10, libc::S_IFREG));
        let dd = t.lookup(Path::new("dd"), &st(11, libc::S_IFREG));
        t.renamed(Path::new("d"), Path::new("e/f"), false);
        assert_eq!(x.path(), PathBuf::from("e/f/x"));
        assert_eq!(
            dd.path(),
            PathBuf::from("dd"),
            "prefix match is by component"
        );
        t.renamed(Path::new("e/f/x"), Path::new("dd"), true);
        assert_eq!(x.path(), PathBuf::from("dd"));
        assert_eq!(dd.path(), PathBuf::from("e/f/x"));
    }
}

//! Offline changes to names: `mkdir`, `unlink`, `rmdir` and `rename`, applied to the saved
//! listings and logged.

use std::ffi::OsStr;
use std::path::Path;

use fuser::{Errno, FileAttr};

use super::parent_of;
use crate::cache::listing::{DirListing, ListedEntry};
use crate::fs::{CachingFs, Result, child};
use crate::oplog::{Base, Op, bytes};
use crate::source::Stat;

impl CachingFs {
    pub(in crate::fs) fn offline_mkdir(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        uid: u32,
        gid: u32,
    ) -> Result<FileAttr> {
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        let _edits = self.offline_edits.lock().unwrap();
        let dir_st = self.offline_stat(&dir)?;
        if self.lookup_offline(&path)?.is_some() {
            return Err(Errno::EEXIST);
        }
        let st = self.synthetic(&dir_st, libc::S_IFDIR | (mode & 0o7777), uid, gid);
        self.log_op(|_| Op::Mkdir {
            path: bytes(&path),
            mode: mode & 0o7777,
            owner: Some((st.uid, st.gid)),
        })?;
        let listing = DirListing {
            path: path.clone(),
            dir: st,
            entries: Vec::new(),
        };
        let _ = self.uncache(&path);
        if let Err(e) = self.cache.save_listing(&listing) {
            tracing::warn!(
                ?path,
                "cannot save the listing of a directory made offline: {e}"
            );
        }
        self.add_listed(&dir, name, st)?;
        let inode = self.inodes.lookup(parent, &path, &st);
        Ok(self.attr_told(&inode, &st))
    }

    pub(in crate::fs) fn offline_unlink(&self, parent: u64, name: &OsStr) -> Result<()> {
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        let _edits = self.offline_edits.lock().unwrap();
        let st = self.offline_stat(&path)?;
        if st.is_dir() {
            return Err(Errno::EISDIR);
        }
        let base = self.base_of(&st);
        self.log_op(|log| Op::Unlink {
            path: bytes(&path),
            base: log.base_for(&path, base),
        })?;
        self.forget_name(&path, &st);
        Ok(())
    }

    /// `path` (with attributes `st`) is gone from the offline view.
    fn forget_name(&self, path: &Path, st: &Stat) {
        let name = path.file_name().unwrap_or_default().to_os_string();
        if let Err(e) = self.edit_listing(&parent_of(path), |l| {
            l.entries.retain(|e| e.name != name);
            Ok(())
        }) {
            tracing::warn!(
                ?path,
                "offline change logged, but the listing still names it: {e:?}"
            );
        }
        if let Some(inode) = self.inodes.find(path, st) {
            inode.remove_name(path);
            self.inodes.unlinked(&inode);
        }
        if let Err(e) = self.uncache(path) {
            tracing::warn!(?path, "cannot drop cache entry: {e}");
        }
    }

    pub(in crate::fs) fn offline_rmdir(&self, parent: u64, name: &OsStr) -> Result<()> {
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        let _edits = self.offline_edits.lock().unwrap();
        let st = self.offline_stat(&path)?;
        if !st.is_dir() {
            return Err(Errno::ENOTDIR);
        }
        if !self
            .listing_for(&path, Some(&st))?
            .listing
            .entries
            .is_empty()
        {
            return Err(Errno::ENOTEMPTY);
        }
        self.log_op(|_| Op::Rmdir { path: bytes(&path) })?;
        self.forget_name(&path, &st);
        self.listing_changed(&path);
        Ok(())
    }

    pub(in crate::fs) fn offline_rename(
        &self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
    ) -> Result<()> {
        if flags & libc::RENAME_EXCHANGE != 0 || flags & libc::RENAME_WHITEOUT != 0 {
            return Err(Errno::EINVAL);
        }
        let from = child(&self.path_of(parent)?, name)?;
        let to = child(&self.path_of(newparent)?, newname)?;
        let _whole = self.renames.read().unwrap();
        let _edits = self.offline_edits.lock().unwrap();
        let from_st = self.offline_stat(&from)?;
        if from_st.is_dir() {
            // Moving a subtree offline is not logged: mv falls back to copy and delete.
            return Err(Errno::EXDEV);
        }
        let to_st = self.lookup_offline(&to)?;
        if let Some(t) = &to_st {
            if flags & libc::RENAME_NOREPLACE != 0 {
                return Err(Errno::EEXIST);
            }
            if t.is_dir() {
                return Err(Errno::EISDIR);
            }
            if (t.dev, t.ino) == (from_st.dev, from_st.ino) {
                return Ok(()); // the same file
            }
        }
        // The listing needs the destination directory's listing too.
        self.listing_for(&parent_of(&to), None)?;
        let (base_from, base_to) = (
            self.base_of(&from_st),
            to_st.map_or(Base::Absent, |t| self.base_of(&t)),
        );
        self.log_op(|log| Op::Rename {
            from: bytes(&from),
            to: bytes(&to),
            base_from: log.base_for(&from, base_from),
            base_to: log.base_for(&to, base_to),
        })?;
        // The entry as listed (the record's newer size and times overlay it).
        let listed = self
            .listing_for(&parent_of(&from), None)?
            .find(name)
            .cloned()
            .ok_or(Errno::ENOENT)?;
        let r = self
            .edit_listing(&parent_of(&from), |l| {
                l.entries.retain(|e| e.name != name);
                Ok(())
            })
            .and_then(|_| {
                self.edit_listing(&parent_of(&to), |l| {
                    l.entries.retain(|e| e.name != newname);
                    l.entries.push(ListedEntry {
                        name: newname.to_os_string(),
                        ..listed
                    });
                    Ok(())
                })
            });
        if let Err(e) = r {
            tracing::warn!(
                ?from,
                ?to,
                "offline rename logged, but the listings lag: {e:?}"
            );
        }
        if let Some(t) = &to_st
            && let Some(inode) = self.inodes.find(&to, t)
        {
            inode.remove_name(&to);
            self.inodes.unlinked(&inode);
        }
        self.inodes.renamed(&from, &to, false, parent, newparent);
        self.cache.rename(&from, &to, 0);
        self.cache_renamed(&[&to]);
        Ok(())
    }
}

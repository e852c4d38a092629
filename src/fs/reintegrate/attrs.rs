//! Offline changes to attributes: `setattr` (mode, times, size) and truncation.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;

use fuser::{Errno, FileAttr};

use super::{now_ts, parent_of};
use crate::fs::entry::closed;
use crate::fs::{CachingFs, Inode, Result};
use crate::oplog::{Op, bytes};
use crate::source::{SetAttr, Stat, TimeSpec};

impl CachingFs {
    pub(in crate::fs) fn offline_setattr(
        &self,
        inode: &Arc<Inode>,
        attr: &SetAttr,
    ) -> Result<FileAttr> {
        if attr.uid.is_some() || attr.gid.is_some() {
            return Err(Errno::EROFS);
        }
        let path = inode.path().ok_or(Errno::ENOENT)?;
        if let Some(size) = attr.size {
            let st = self.offline_stat(&path)?;
            if !st.is_file() {
                return Err(if st.is_dir() {
                    Errno::EISDIR
                } else {
                    Errno::EINVAL
                });
            }
            self.offline_truncate(inode, &path, size)?;
        }
        if attr.mode.is_none() && attr.atime.is_none() && attr.mtime.is_none() {
            return self.offline_getattr(inode);
        }
        let _edits = self.offline_edits.lock().unwrap();
        let st = self.offline_stat(&path)?;
        if st.file_type() == libc::S_IFLNK {
            return Err(Errno::EROFS);
        }
        let now = now_ts();
        let at = |t: Option<TimeSpec>| {
            t.map(|t| match t {
                TimeSpec::Now => now,
                TimeSpec::At(s, n) => (s, n),
            })
        };
        let (atime, mtime) = (at(attr.atime), at(attr.mtime));
        let mode = attr.mode.map(|m| m & 0o7777);
        let base = (!st.is_dir()).then(|| self.base_of(&st));
        self.log_op(|log| Op::SetAttr {
            path: bytes(&path),
            base: base.map(|b| log.base_for(&path, b)),
            mode,
            atime,
            mtime,
        })?;
        let name = path.file_name().map(OsStr::to_os_string);
        let edit = |s: &mut Stat| {
            if let Some(m) = mode {
                s.mode = (s.mode & libc::S_IFMT) | m;
            }
            s.atime = atime.unwrap_or(s.atime);
            s.mtime = mtime.unwrap_or(s.mtime);
            s.ctime = now;
        };
        let r = match &name {
            Some(name) => self.edit_listing(&parent_of(&path), |l| {
                if let Some(e) = l.entries.iter_mut().find(|e| &e.name == name) {
                    edit(&mut e.stat);
                }
                Ok(())
            }),
            None => self.edit_listing(&path, |l| {
                edit(&mut l.dir);
                Ok(())
            }),
        };
        if let Err(e) = r {
            tracing::warn!(
                ?path,
                "offline change logged, but the listing kept the old attributes: {e:?}"
            );
        }
        if let (true, Some(mtime)) = (st.is_file(), mtime) {
            // The record's times overlay the listing's: keep them in step.
            let mut guard = inode.file();
            match guard.as_mut() {
                Some(state) => {
                    state.set_times(mtime, Some(now));
                    if !state.written() {
                        state.persist_record(&self.env(), true);
                    }
                }
                None => {
                    if let Some(files) = self.cache.open_existing(&path) {
                        let _ = closed::restamp(&files, true, |rec| {
                            rec.identity.mtime = mtime;
                            rec.identity.ctime = now;
                            true
                        });
                    }
                }
            }
        }
        self.offline_getattr(inode)
    }

    /// Truncation offline: through the open state if there is one (stored on close),
    /// else stored at once.
    fn offline_truncate(&self, inode: &Arc<Inode>, path: &Path, size: u64) -> Result<()> {
        let mut guard = inode.file();
        let opened_here = guard.is_none();
        if opened_here {
            *guard = Some(Box::new(self.offline_state(inode, path)));
        }
        let state = guard.as_mut().unwrap();
        let r = (|| {
            if !state.complete() && size > 0 {
                return Err(Errno::EIO);
            }
            if state.offline_base.is_none() {
                let base = self.base_of(&self.offline_stat(path)?);
                state.offline_base = Some(self.oplog.lock().unwrap().base_for(path, base));
            }
            self.offline_modify(state, Some(path), |f, _| f.set_len(size).map(|_| size))?;
            if state.daemon_opens() == 0 {
                self.offline_store(inode, state)?;
            }
            Ok(())
        })();
        if opened_here {
            self.release_if_unused(inode, &mut guard);
        }
        r
    }
}

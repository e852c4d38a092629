//! Creating a regular file (CREATE): made on the source exclusively, cached empty and
//! complete, and opened for the caller as `fs/open.rs` opens files.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::sync::Arc;

use fuser::{BackingId, FileAttr, FopenFlags};

use super::state::Look;
use super::{CachingFs, Handle, OpenKind, Opened, Result, Writes, child, errno};
use crate::fetch::HandleFetch;

impl CachingFs {
    pub fn create(
        &self,
        parent: u64,
        name: &OsStr,
        mode: u32,
        flags: i32,
        (uid, gid): (u32, u32),
        make_backing: &dyn Fn(&File) -> io::Result<BackingId>,
    ) -> Result<(FileAttr, Opened)> {
        if self.offline_change()? {
            return self.offline_create(parent, name, mode, flags, uid, gid);
        }
        if !self.caps().in_place_writes {
            return self.object_create(parent, name, mode, flags, uid, gid);
        }
        let dir = self.path_of(parent)?;
        let path = child(&dir, name)?;
        let writable = flags & libc::O_ACCMODE != libc::O_RDONLY;
        // Opened for reading too where the kernel may write it by passthrough.
        let set_id = libc::S_ISUID | libc::S_ISGID;
        let mut source_write = writable && self.source_writes() && mode & set_id == 0;
        let mut source_flags = Self::source_flags(flags);
        if source_write {
            source_flags = source_flags & !libc::O_ACCMODE | libc::O_RDWR;
        }
        // Exclusive first, so that we know we made it and may give it to the caller; a file
        // that appeared on the source meanwhile is opened as it is unless O_EXCL was asked.
        // The new file's attributes, as the file open for the caller has them.
        let (file, attr, mut st) =
            match self
                .source
                .create_file(&path, source_flags | libc::O_EXCL, mode)
            {
                Ok(file) => {
                    let (attr, st) =
                        self.finish_create(parent, &path, &dir, mode, uid, gid, Some(&file))?;
                    (file, attr, st)
                }
                Err(e) if e.raw_os_error() == Some(libc::EEXIST) && flags & libc::O_EXCL == 0 => {
                    let file = self
                        .open_source_for(
                            &path,
                            Self::source_flags(flags) | (flags & libc::O_TRUNC),
                            &mut source_write,
                        )
                        .map_err(errno)?;
                    let (attr, _) = self.entry_after_create(parent, &path, None)?;
                    let st = self.source.fstat(file.as_fd()).map_err(errno)?;
                    (file, attr, st)
                }
                Err(e) => return Err(errno(e)),
            };
        let inode = self.inode(attr.ino.0)?;
        // An `O_PATH` descriptor of the new file, as an open keeps: its close never reaches
        // the source (a duplicate of `file` would send a FLUSH, under the file's lock).
        let path_fd = self
            .source
            .with_fd(file.as_fd(), |f| {
                use std::os::fd::AsRawFd;
                let own = format!("/proc/self/fd/{}", f.as_raw_fd());
                let flags = rustix::fs::OFlags::PATH | rustix::fs::OFlags::CLOEXEC;
                Ok(rustix::fs::open(own, flags, rustix::fs::Mode::empty())?)
            })
            .ok();
        // A new file is fully known: cache it empty and complete.
        let backing;
        let direct = {
            let mut guard = inode.file();
            if guard.is_none() {
                let (mut state, _) = self.load_state(&inode, &path, &mut st, Look::Created);
                state.path_fd = path_fd.map(Arc::new);
                *guard = Some(Box::new(state));
            }
            let state = guard.as_mut().unwrap();
            source_write &= self.may_write_source(state, st.mode, true);
            backing = source_write
                .then(|| self.source_write_backing(state, &file, make_backing))
                .flatten();
            match backing {
                Some(_) => {
                    state.opened(OpenKind::SourceWriter);
                    false
                }
                None => self.count_daemon_open(&inode, state, flags),
            }
        };
        if writable && !direct {
            inode.wait_for_page_invalidation();
        }
        let fh = self.new_fh();
        inode.hand_out();
        self.handles.lock().unwrap().insert(
            fh,
            Arc::new(Handle {
                inode,
                source: Some(file),
                writable,
                passthrough: backing.clone(),
                direct,
                fetch: HandleFetch::default(),
                writes: Writes::Through,
                noflush: None,
            }),
        );
        Ok((
            attr,
            Opened {
                fh,
                flags: match (direct, &backing) {
                    (_, Some(_)) => FopenFlags::FOPEN_PASSTHROUGH,
                    (true, None) => FopenFlags::FOPEN_DIRECT_IO,
                    (false, None) => FopenFlags::empty(),
                },
                backing,
            },
        ))
    }
}

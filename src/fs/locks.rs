//! POSIX locks, held on the source as OFD locks on one descriptor per inode and lock owner,
//! so that they hold for every client of the source.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::sync::Arc;

use fuser::Errno;

use super::{CachingFs, Result, errno};
use crate::health::SourceFile;

impl CachingFs {
    /// The source descriptor holding `owner`'s locks on `id`, opened on first use. It is
    /// opened with no lock held: a source that does not answer holds up only this call.
    fn lock_file(&self, id: u64, owner: u64, fh: u64) -> Result<Arc<SourceFile>> {
        if !self.caps().posix_locks {
            // No locks at the source (an object store): the kernel keeps them, local to this
            // machine.
            return Err(Errno::ENOSYS);
        }
        let h = self.handle(fh)?;
        if let Some(owners) = &h.noflush {
            let mut owners = owners.lock().unwrap();
            if !owners.contains(&owner) {
                owners.push(owner);
            }
        }
        if let Some(f) = self.locks.lock().unwrap().get(&(id, owner)) {
            return Ok(f.clone());
        }
        // OFD locks need a descriptor open for the lock's type: read-write where possible.
        let path = h.inode.path().ok_or(Errno::ENOENT)?;
        let f = self
            .source
            .open_file(&path, libc::O_RDWR)
            .or_else(|_| self.source.open_file(&path, libc::O_RDONLY))
            .map_err(errno)?;
        // A lock call of the same owner may have opened one meanwhile: that one holds its
        // locks, and this one is closed (guarded) on return.
        let mut locks = self.locks.lock().unwrap();
        Ok(locks.entry((id, owner)).or_insert(Arc::new(f)).clone())
    }

    /// Whether no owner holds (or has asked about) locks on `id`: then a reader's close
    /// need not reach the daemon (`FOPEN_NOFLUSH`). POSIX drops a process's locks on a
    /// file at its close of any descriptor of it; for a descriptor opened while the file
    /// had no lock holder, the daemon drops the locks taken through it when it is
    /// released (its last close) instead.
    pub(super) fn no_lock_holders(&self, id: u64) -> bool {
        !self.caps().posix_locks || !self.locks.lock().unwrap().keys().any(|&(i, _)| i == id)
    }

    /// Drops `owner`'s locks on `id`: its lock descriptor is closed (through the source
    /// guard, by whoever uses it last), and waiters for them try again.
    pub(super) fn drop_locks(&self, id: u64, owner: u64) {
        let lock = self.locks.lock().unwrap().remove(&(id, owner));
        if lock.is_some() {
            drop(lock);
            self.lock_waits.kick(id);
        }
    }

    fn flock_struct(start: u64, end: u64, typ: i32) -> libc::flock {
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = typ as i16;
        fl.l_whence = libc::SEEK_SET as i16;
        fl.l_start = start as i64;
        fl.l_len = if end == u64::MAX || end >= i64::MAX as u64 {
            0
        } else {
            (end - start + 1) as i64
        };
        fl
    }

    /// One OFD-lock `fcntl` on the source for `owner`'s POSIX lock on `id`.
    #[allow(clippy::too_many_arguments)]
    fn source_lock(
        &self,
        id: u64,
        fh: u64,
        owner: u64,
        start: u64,
        end: u64,
        typ: i32,
        cmd: i32,
    ) -> io::Result<libc::flock> {
        let f = self
            .lock_file(id, owner, fh)
            .map_err(|e| io::Error::from_raw_os_error(e.code()))?;
        let mut fl = Self::flock_struct(start, end, typ);
        let mut lock = move |f: &File| {
            let r = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(f), cmd, &mut fl) };
            if r < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(fl)
        };
        if cmd == libc::F_OFD_SETLKW {
            // A wait for another holder's lock may last as long as that holder wants: no
            // timeout (the mount's blocking locks wait in `fs/lock_waits.rs` instead).
            return lock(&f);
        }
        self.source.with_fd(f.as_fd(), lock)
    }

    /// The first lock conflicting with the given one: (start, end, type).
    pub fn getlk(
        &self,
        id: u64,
        fh: u64,
        owner: u64,
        start: u64,
        end: u64,
        typ: i32,
    ) -> Result<(u64, u64, i32)> {
        let fl = self
            .source_lock(id, fh, owner, start, end, typ, libc::F_OFD_GETLK)
            .map_err(errno)?;
        let s = fl.l_start as u64;
        let e = if fl.l_len == 0 {
            u64::MAX
        } else {
            s + fl.l_len as u64 - 1
        };
        Ok((s, e, fl.l_type as i32))
    }

    #[allow(clippy::too_many_arguments)]
    pub fn setlk(
        &self,
        id: u64,
        fh: u64,
        owner: u64,
        start: u64,
        end: u64,
        typ: i32,
        sleep: bool,
    ) -> Result<()> {
        let cmd = if sleep {
            libc::F_OFD_SETLKW
        } else {
            libc::F_OFD_SETLK
        };
        match self.source_lock(id, fh, owner, start, end, typ, cmd) {
            Ok(_) if typ == libc::F_UNLCK => {
                self.lock_waits.kick(id);
                Ok(())
            }
            Ok(_) => Ok(()),
            // POSIX says EAGAIN or EACCES; the kernel's FUSE code expects EAGAIN.
            Err(e) if e.raw_os_error() == Some(libc::EACCES) => Err(Errno::EAGAIN),
            Err(e) => Err(errno(e)),
        }
    }
}

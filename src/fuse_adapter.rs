//! The only module that speaks fuser: turns each FUSE request into a `CachingFs` call,
//! counts it, and turns the result into a reply or an errno.

use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, CopyFileRangeFlags, Errno, FileHandle, Filesystem, Generation, INodeNo, InitFlags,
    IoctlFlags, KernelConfig, LockOwner, OpenFlags, PollEvents, PollFlags, PollNotifier,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty,
    ReplyEntry, ReplyIoctl, ReplyLock, ReplyLseek, ReplyOpen, ReplyPoll, ReplyStatfs, ReplyWrite,
    ReplyXattr, Request, TimeOrNow, WriteFlags,
};

use crate::fs::{CachingFs, LockRequest};
use crate::source::{SetAttr, TimeSpec};
use crate::stats::Op;

mod call;
use call::{Call, failed_elsewhere};

pub struct FuseAdapter {
    pub fs: Arc<CachingFs>,
}

const GEN: Generation = Generation(0);

fn time_spec(t: TimeOrNow) -> TimeSpec {
    match t {
        TimeOrNow::Now => TimeSpec::Now,
        TimeOrNow::SpecificTime(t) => match t.duration_since(UNIX_EPOCH) {
            Ok(d) => TimeSpec::At(d.as_secs() as i64, d.subsec_nanos()),
            Err(e) => {
                let d = e.duration();
                let (mut s, mut ns) = (-(d.as_secs() as i64), d.subsec_nanos());
                if ns > 0 {
                    s -= 1;
                    ns = 1_000_000_000 - ns;
                }
                TimeSpec::At(s, ns)
            }
        },
    }
}

impl FuseAdapter {
    /// Replies with a new entry in directory `parent`, with that directory's TTLs.
    fn entry(
        &self,
        call: &Call,
        reply: ReplyEntry,
        parent: INodeNo,
        r: crate::fs::Result<fuser::FileAttr>,
    ) {
        match r {
            Ok(attr) => {
                let (entry_ttl, attr_ttl) = self.fs.entry_ttls(parent.0, &attr);
                reply.entry_with_ttls(&attr_ttl, &entry_ttl, &attr, GEN)
            }
            Err(e) => reply.error(call.fail(e)),
        }
    }

    /// Like `entry`, but a missing name becomes a negative entry (node id 0) that the
    /// kernel remembers for the negative TTL. Only for lookup: the kernel answers EIO to a
    /// node id 0 from mkdir, mknod, symlink or link.
    fn lookup_entry(
        &self,
        call: &Call,
        reply: ReplyEntry,
        parent: INodeNo,
        r: crate::fs::Result<fuser::FileAttr>,
    ) {
        let negative_ttl = self.fs.negative_ttl(parent.0);
        match r {
            Err(e) if e == Errno::ENOENT && !negative_ttl.is_zero() => {
                let zero = crate::source::Stat::from_libc(&unsafe { std::mem::zeroed() });
                let attr = crate::fs::attr_of(0, &zero);
                reply.entry_with_ttls(&Duration::ZERO, &negative_ttl, &attr, GEN)
            }
            r => self.entry(call, reply, parent, r),
        }
    }

    fn opened(reply: ReplyOpen, o: crate::fs::Opened) {
        match &o.backing {
            Some(b) => reply.opened_passthrough(FileHandle(o.fh), o.flags, b),
            None => reply.opened(FileHandle(o.fh), o.flags),
        }
    }

    fn empty(call: &Call, reply: ReplyEmpty, r: crate::fs::Result<()>) {
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(call.fail(e)),
        }
    }

    fn xattr(call: &Call, reply: ReplyXattr, size: u32, r: crate::fs::Result<Vec<u8>>) {
        match r {
            Ok(v) if size == 0 => reply.size(v.len() as u32),
            Ok(v) if v.len() > size as usize => reply.error(call.fail(Errno::ERANGE)),
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(call.fail(e)),
        }
    }
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let caps = config.capabilities();
        // Readdirplus (adaptive: the kernel asks for it when lookups follow a listing)
        // answers `ls -l` without one lookup per name.
        let mut want = InitFlags::FUSE_CACHE_SYMLINKS
            | InitFlags::FUSE_DO_READDIRPLUS
            | InitFlags::FUSE_READDIRPLUS_AUTO;
        // Never `FUSE_AUTO_INVAL_DATA`: the kernel would drop a file's pages when it sees a
        // new mtime, also between a write's copy into them and its arrival here, and keep
        // what a reader fetched meanwhile. Pages are dropped by our notices only
        // (`CachingFs::kernel_version_told`).
        // Without these the kernel keeps locks itself, local to this machine: for a source
        // without locks (an object store), and with kernel opens (a close would have to
        // reach us to drop them on the source).
        if !self.fs.kernel_opens() && self.fs.caps().posix_locks {
            // flock(2) arrives as a whole-file lock owned by the open file; it is taken on
            // the source like POSIX locks, so it excludes across mounts.
            want |= InitFlags::FUSE_POSIX_LOCKS | InitFlags::FUSE_FLOCK_LOCKS;
        }
        if self.fs.passthrough_enabled() {
            if caps.contains(InitFlags::FUSE_PASSTHROUGH) {
                want |= InitFlags::FUSE_PASSTHROUGH;
                // One level below us (the cache file system) and one above (e.g. overlayfs).
                let _ = config.set_max_stack_depth(2);
            } else {
                tracing::warn!(
                    "kernel has no FUSE passthrough; cached reads go through the daemon"
                );
                self.fs.disable_passthrough();
            }
        }
        // Set-ID bits cleared by us on writes and truncations (the kernel then stops
        // asking `security.capability` before every write: one `getxattr` per file
        // instead, issue 22). The source's own kernel clears capabilities on our writes
        // and set-ID bits on our chowns; the object store keeps neither.
        if self.fs.caps().clears_set_id {
            want |= InitFlags::FUSE_HANDLE_KILLPRIV_V2;
        }
        let want = want & caps;
        if let Err(missing) = config.add_capabilities(want) {
            tracing::warn!("kernel lacks capabilities {missing:?}");
        }
        let _ = config.set_max_write(1 << 20);
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let call = self.call(Op::Lookup, req);
        self.lookup_entry(&call, reply, parent, self.fs.lookup(parent.0, name));
    }

    fn forget(&self, req: &Request, ino: INodeNo, nlookup: u64) {
        let _call = self.call(Op::Forget, req);
        self.fs.forget(ino.0, nlookup);
    }

    fn getattr(&self, req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let call = self.call(Op::Getattr, req);
        // Handle 0: a kernel open's (`fs/kernel_opens.rs`), none of ours.
        match self.fs.getattr(ino.0, fh.map(|f| f.0).filter(|&f| f != 0)) {
            Ok(attr) => reply.attr(&self.fs.attr_ttl(&attr), &attr),
            Err(e) => reply.error(call.fail(e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let call = self.call(Op::Setattr, req);
        let set = SetAttr {
            mode,
            uid,
            gid,
            size,
            atime: atime.map(time_spec),
            mtime: mtime.map(time_spec),
        };
        // A truncation by a caller without CAP_FSETID clears set-ID bits
        // (`FUSE_HANDLE_KILLPRIV_V2`; fuser does not pass the kernel's
        // `FATTR_KILL_SUIDGID`, so "not root" stands for it).
        let kill_suidgid = req.uid() != 0;
        let fh = fh.map(|f| f.0).filter(|&f| f != 0);
        match (self.fs).setattr(ino.0, fh, set, kill_suidgid) {
            Ok(attr) => reply.attr(&self.fs.attr_ttl(&attr), &attr),
            // Set-ID bits beside writers to the source by passthrough, perhaps ones whose
            // release is still on its way, which this thread may be the one to read: again
            // where it may wait for them (`fs/source_writes.rs`, `fs/waiting_opens.rs`).
            Err(Errno::ETXTBSY) if mode.is_some() => {
                let fs = self.fs.clone();
                self.fs.open_off_request_thread(Box::new(move || {
                    fs.wait_for_source_writers(ino.0);
                    match fs.setattr(ino.0, fh, set, kill_suidgid) {
                        Ok(attr) => reply.attr(&fs.attr_ttl(&attr), &attr),
                        Err(e) => reply.error(failed_elsewhere(&fs.stats, Op::Setattr, e)),
                    }
                }));
            }
            Err(e) => reply.error(call.fail(e)),
        }
    }

    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        let call = self.call(Op::Readlink, req);
        match self.fs.readlink(ino.0) {
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(call.fail(e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let call = self.call(Op::Mknod, req);
        self.entry(
            &call,
            reply,
            parent,
            self.fs
                .mknod(parent.0, name, mode, rdev, req.uid(), req.gid()),
        );
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let call = self.call(Op::Mkdir, req);
        self.entry(
            &call,
            reply,
            parent,
            self.fs.mkdir(parent.0, name, mode, req.uid(), req.gid()),
        );
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let call = self.call(Op::Unlink, req);
        Self::empty(&call, reply, self.fs.unlink(parent.0, name));
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let call = self.call(Op::Rmdir, req);
        Self::empty(&call, reply, self.fs.rmdir(parent.0, name));
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let call = self.call(Op::Symlink, req);
        self.entry(
            &call,
            reply,
            parent,
            self.fs
                .symlink(parent.0, link_name, target, req.uid(), req.gid()),
        );
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let call = self.call(Op::Rename, req);
        Self::empty(
            &call,
            reply,
            self.fs
                .rename(parent.0, name, newparent.0, newname, flags.bits()),
        );
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let call = self.call(Op::Link, req);
        self.entry(
            &call,
            reply,
            newparent,
            self.fs.link(ino.0, newparent.0, newname),
        );
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let call = self.call(Op::Open, req);
        if self.fs.kernel_opens() {
            // From this answer on the kernel opens files itself (`fs/kernel_opens.rs`).
            return reply.error(Errno::ENOSYS);
        }
        let pid = req.pid();
        match (self.fs).open_at_once(ino.0, flags.0, pid, &|f| reply.open_backing(f)) {
            Ok(o) => Self::opened(reply, o),
            // Perhaps a writer that must wait for the releases of its file's passthrough
            // readers, which this thread may be the one to read: opened again where it
            // may wait (`fs/waiting_opens.rs`).
            Err(Errno::ETXTBSY) if flags.0 & libc::O_ACCMODE != libc::O_RDONLY => {
                let fs = self.fs.clone();
                self.fs.open_off_request_thread(Box::new(move || {
                    match fs.open(ino.0, flags.0, pid, &|f| reply.open_backing(f)) {
                        Ok(o) => Self::opened(reply, o),
                        Err(e) => reply.error(failed_elsewhere(&fs.stats, Op::Open, e)),
                    }
                }));
            }
            Err(e) => reply.error(call.fail(e)),
        }
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let call = self.call(Op::Read, req);
        let flags = libc::O_RDONLY | (flags.0 & !libc::O_ACCMODE);
        match (self.fs).on_handle(ino.0, fh.0, flags, |fh| self.fs.read(fh, offset, size)) {
            Ok(v) => reply.data(&v),
            Err(e) => reply.error(call.fail(e)),
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let call = self.call(Op::Write, req);
        let kill = write_flags.contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID);
        let flags = libc::O_WRONLY | (flags.0 & !libc::O_ACCMODE);
        match (self.fs).on_handle(ino.0, fh.0, flags, |fh| {
            self.fs.write(fh, offset, data, kill)
        }) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(call.fail(e)),
        }
    }

    fn flush(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let call = self.call(Op::Flush, req);
        if fh.0 == 0 {
            // A kernel open (`fs/kernel_opens.rs`): nothing to do at close, and the kernel
            // stops asking.
            return reply.error(Errno::ENOSYS);
        }
        Self::empty(&call, reply, self.fs.flush(ino.0, fh.0, lock_owner.0));
    }

    fn release(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let call = self.call(Op::Release, req);
        if let Some(owner) = lock_owner {
            let _ = self.fs.flush(ino.0, fh.0, owner.0);
        }
        Self::empty(&call, reply, self.fs.release(fh.0));
    }

    fn fsync(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let call = self.call(Op::Fsync, req);
        let r = (self.fs).on_handle_rw(ino.0, fh.0, |fh| self.fs.fsync(fh, datasync));
        Self::empty(&call, reply, r);
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let call = self.call(Op::Opendir, req);
        if self.fs.kernel_dir_opens() {
            // The kernel opens directories itself and keeps their listings.
            return reply.error(Errno::ENOSYS);
        }
        match self.fs.opendir(ino.0) {
            Ok(fh) => reply.opened(FileHandle(fh), self.fs.dir_open_flags(ino.0)),
            Err(e) => reply.error(call.fail(e)),
        }
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let call = self.call(Op::Readdir, req);
        match self.fs.listing(ino.0, fh.0, offset) {
            Ok(l) => {
                for (i, e) in l.list.entries.iter().enumerate().skip(l.start) {
                    let at = l.cookie | (i + 1) as u64;
                    if reply.add(INodeNo(e.ino), at, e.kind, &e.name) {
                        break;
                    }
                }
                reply.ok()
            }
            Err(e) => reply.error(call.fail(e)),
        }
    }

    fn readdirplus(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        let call = self.call(Op::Readdirplus, req);
        let (list, mut i, cookie) = match self.fs.listing(ino.0, fh.0, offset) {
            Ok(l) => (l.list, l.start, l.cookie),
            Err(e) => return reply.error(call.fail(e)),
        };
        let ttl = self.fs.dir_entry_ttl(list.dir_id);
        'fill: while i < list.entries.len() {
            // Stat in batches: a reply buffer holds a few dozen entries.
            let attrs = self.fs.readdirplus_attrs(&list, i, 64);
            for (k, attr) in attrs.iter().enumerate() {
                let e = &list.entries[i + k];
                let Some(attr) = attr else { continue };
                let at = cookie | (i + k + 1) as u64;
                let ttl = self.fs.linked_file_ttl(ttl, attr);
                if reply.add(attr.ino, at, &e.name, &ttl, attr, GEN) {
                    // Did not fit: undo the lookups of this and the rest of the batch.
                    for a in attrs[k..].iter().flatten() {
                        // `.` and `..` carry the directory's id and were not counted.
                        if a.ino != INodeNo(list.dir_id) {
                            self.fs.forget(a.ino.0, 1);
                        }
                    }
                    break 'fill;
                }
            }
            i += attrs.len();
        }
        reply.ok()
    }

    fn releasedir(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        let _call = self.call(Op::Releasedir, req);
        self.fs.releasedir(fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let _call = self.call(Op::Fsyncdir, req);
        // Namespace changes were made on the source by the calls themselves; a directory
        // fsync there needs a descriptor of the directory.
        reply.ok();
    }

    fn statfs(&self, req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let call = self.call(Op::Statfs, req);
        match self.fs.statfs() {
            Ok(s) => reply.statfs(
                s.f_blocks,
                s.f_bfree,
                s.f_bavail,
                s.f_files,
                s.f_ffree,
                s.f_bsize as u32,
                s.f_namemax as u32,
                s.f_frsize as u32,
            ),
            Err(e) => reply.error(call.fail(e)),
        }
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let call = self.call(Op::Setxattr, req);
        Self::empty(&call, reply, self.fs.setxattr(ino.0, name, value, flags));
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let call = self.call(Op::Getxattr, req);
        Self::xattr(&call, reply, size, self.fs.getxattr(ino.0, name, size));
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let call = self.call(Op::Listxattr, req);
        Self::xattr(&call, reply, size, self.fs.listxattr(ino.0, size));
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let call = self.call(Op::Removexattr, req);
        Self::empty(&call, reply, self.fs.removexattr(ino.0, name));
    }

    fn access(&self, req: &Request, _ino: INodeNo, _mask: AccessFlags, reply: ReplyEmpty) {
        // Only reached without default_permissions, which hoardfs always sets.
        let _call = self.call(Op::Access, req);
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let call = self.call(Op::Create, req);
        if self.fs.kernel_opens() {
            // The kernel makes the file with MKNOD then, and opens it itself.
            return reply.error(Errno::ENOSYS);
        }
        let owner = (req.uid(), req.gid());
        let make_backing = |f: &std::fs::File| reply.open_backing(f);
        match (self.fs).create(parent.0, name, mode, flags, owner, &make_backing) {
            Ok((attr, o)) => {
                let ttl = self.fs.entry_ttls(parent.0, &attr).0;
                match &o.backing {
                    Some(b) => {
                        reply.created_passthrough(&ttl, &attr, GEN, FileHandle(o.fh), o.flags, b)
                    }
                    None => reply.created(&ttl, &attr, GEN, FileHandle(o.fh), o.flags),
                }
            }
            Err(e) => reply.error(call.fail(e)),
        }
    }

    fn getlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        reply: ReplyLock,
    ) {
        let call = self.call(Op::Getlk, req);
        match self.fs.getlk(ino.0, fh.0, lock_owner.0, start, end, typ) {
            Ok((s, e, t)) => reply.locked(s, e, t, if t == libc::F_UNLCK { 0 } else { pid }),
            Err(e) => reply.error(call.fail(e)),
        }
    }

    fn setlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        _pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        let call = self.call(Op::Setlk, req);
        if sleep {
            // A blocking lock may wait for a long time: never on a request thread, and
            // on the bounded pool of lock waiters, not a thread each.
            let lock = LockRequest {
                id: ino.0,
                fh: fh.0,
                owner: lock_owner.0,
                start,
                end,
                typ,
                tid: req.pid(),
            };
            let fs = self.fs.clone();
            self.fs.setlk_wait(
                lock,
                Box::new(move |r| match r {
                    Ok(()) => reply.ok(),
                    Err(e) => reply.error(failed_elsewhere(&fs.stats, Op::Setlk, e)),
                }),
            );
        } else {
            Self::empty(
                &call,
                reply,
                self.fs
                    .setlk(ino.0, fh.0, lock_owner.0, start, end, typ, false),
            );
        }
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let call = self.call(Op::Fallocate, req);
        let r = (self.fs).on_handle_rw(ino.0, fh.0, |fh| {
            self.fs.fallocate(fh, offset, length, mode)
        });
        Self::empty(&call, reply, r);
    }

    /// No ioctl is passed on to the source: every one is answered `ENOTTY`, as a regular
    /// file answers the terminal ones. The kernel asks again each time (it remembers no
    /// "not implemented" for ioctls), and Python's `open()` asks `isatty` (`TCGETS`) of
    /// every file it opens: fuser's default answer logged a warning for each.
    fn ioctl(
        &self,
        req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(self.call(Op::Ioctl, req).fail(Errno::ENOTTY));
    }

    /// Not implemented, quietly: on `ENOSYS` the kernel answers `poll` with the default
    /// mask (always ready, as for a regular file) and asks no more.
    fn poll(
        &self,
        req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _ph: PollNotifier,
        _events: PollEvents,
        _flags: PollFlags,
        reply: ReplyPoll,
    ) {
        reply.error(self.call(Op::Poll, req).fail(Errno::ENOSYS));
    }

    /// Not implemented, quietly: on `ENOSYS` the kernel copies through reads and writes
    /// (`cp` does so at once) and asks no more.
    fn copy_file_range(
        &self,
        req: &Request,
        _ino_in: INodeNo,
        _fh_in: FileHandle,
        _offset_in: u64,
        _ino_out: INodeNo,
        _fh_out: FileHandle,
        _offset_out: u64,
        _len: u64,
        _flags: CopyFileRangeFlags,
        reply: ReplyWrite,
    ) {
        reply.error(self.call(Op::CopyFileRange, req).fail(Errno::ENOSYS));
    }

    fn lseek(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let call = self.call(Op::Lseek, req);
        match (self.fs).on_handle(ino.0, fh.0, libc::O_RDONLY, |fh| {
            self.fs.lseek(fh, offset, whence)
        }) {
            Ok(o) => reply.offset(o),
            Err(e) => reply.error(call.fail(e)),
        }
    }
}

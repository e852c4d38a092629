//! A FUSE source whose timestamps cannot tell, as SSHFS's over sftp: a read-only view of a
//! directory with whole-second mtimes, no ctime of its own (ctime = mtime, as sshfs
//! reports) and inode numbers of its own, given out by path. The tests put hoardfs over it
//! to check what hoardfs does when a file's identity is (size, mtime in seconds).
//!
//! ```sh
//! cargo run --example coarse_fs -- BACKING_DIR MOUNTPOINT   # foreground; umount to end
//! ```

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry,
    ReplyOpen, Request, Session,
};

/// As sshfs's default `cache_timeout` would be if it were short: the kernel asks again soon.
const TTL: Duration = Duration::from_millis(500);

#[derive(Default)]
struct Tables {
    paths: Vec<PathBuf>,
    by_path: HashMap<PathBuf, u64>,
    files: HashMap<u64, File>,
    next_fh: u64,
}

struct CoarseFs {
    root: PathBuf,
    t: Mutex<Tables>,
}

fn errno(e: std::io::Error) -> Errno {
    Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))
}

fn whole_seconds(secs: i64) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::from_secs(secs as u64)
    } else {
        UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
    }
}

impl CoarseFs {
    fn ino_of(&self, rel: &Path) -> u64 {
        let mut t = self.t.lock().unwrap();
        if let Some(i) = t.by_path.get(rel) {
            return *i;
        }
        t.paths.push(rel.to_path_buf());
        let i = t.paths.len() as u64; // 1: the root, pushed first
        t.by_path.insert(rel.to_path_buf(), i);
        i
    }

    fn path_of(&self, ino: INodeNo) -> Result<PathBuf, Errno> {
        let t = self.t.lock().unwrap();
        t.paths
            .get((ino.0 as usize).wrapping_sub(1))
            .cloned()
            .ok_or(Errno::ENOENT)
    }

    fn attr(&self, rel: &Path) -> Result<FileAttr, Errno> {
        let m = std::fs::symlink_metadata(self.root.join(rel)).map_err(errno)?;
        let kind = match m.mode() & libc::S_IFMT {
            libc::S_IFDIR => FileType::Directory,
            libc::S_IFLNK => FileType::Symlink,
            _ => FileType::RegularFile,
        };
        let mtime = whole_seconds(m.mtime());
        Ok(FileAttr {
            ino: INodeNo(self.ino_of(rel)),
            size: m.size(),
            blocks: m.blocks(),
            atime: whole_seconds(m.atime()),
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind,
            perm: (m.mode() & 0o7777) as u16,
            nlink: m.nlink() as u32,
            uid: m.uid(),
            gid: m.gid(),
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }
}

impl Filesystem for CoarseFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let r = self.path_of(parent).and_then(|p| self.attr(&p.join(name)));
        match r {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.path_of(ino).and_then(|p| self.attr(&p)) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self
            .path_of(ino)
            .and_then(|p| std::fs::read_link(self.root.join(p)).map_err(errno))
        {
            Ok(t) => reply.data(t.as_os_str().as_bytes()),
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        let r = self
            .path_of(ino)
            .and_then(|p| File::open(self.root.join(p)).map_err(errno));
        match r {
            Ok(f) => {
                let mut t = self.t.lock().unwrap();
                t.next_fh += 1;
                let fh = t.next_fh;
                t.files.insert(fh, f);
                // As sshfs: no page cache kept across opens.
                reply.opened(FileHandle(fh), FopenFlags::empty())
            }
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let f = self
            .t
            .lock()
            .unwrap()
            .files
            .get(&fh.0)
            .and_then(|f| f.try_clone().ok());
        let Some(f) = f else {
            return reply.error(Errno::EBADF);
        };
        let mut buf = vec![0u8; size as usize];
        let mut n = 0;
        while n < buf.len() {
            match f.read_at(&mut buf[n..], offset + n as u64) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) => return reply.error(errno(e)),
            }
        }
        reply.data(&buf[..n])
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.t.lock().unwrap().files.remove(&fh.0);
        reply.ok()
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let dir = match self.path_of(ino) {
            Ok(d) => d,
            Err(e) => return reply.error(e),
        };
        let entries = match std::fs::read_dir(self.root.join(&dir)) {
            Ok(rd) => rd.flatten().collect::<Vec<_>>(),
            Err(e) => return reply.error(errno(e)),
        };
        let mut all = vec![
            (ino.0, FileType::Directory, OsStr::new(".").to_os_string()),
            (ino.0, FileType::Directory, OsStr::new("..").to_os_string()),
        ];
        for e in entries {
            let kind = match e.file_type() {
                Ok(t) if t.is_dir() => FileType::Directory,
                Ok(t) if t.is_symlink() => FileType::Symlink,
                _ => FileType::RegularFile,
            };
            let name = e.file_name();
            all.push((self.ino_of(&dir.join(&name)), kind, name));
        }
        for (i, (ino, kind, name)) in all.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(ino), (i + 1) as u64, kind, &name) {
                break;
            }
        }
        reply.ok()
    }
}

fn main() -> anyhow::Result<()> {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [backing, mountpoint] = &args[..] else {
        anyhow::bail!("usage: coarse_fs BACKING_DIR MOUNTPOINT");
    };
    let fs = CoarseFs {
        root: std::fs::canonicalize(backing)?,
        t: Mutex::default(),
    };
    fs.ino_of(Path::new("")); // the root is node 1
    let mut cfg = fuser::Config::default();
    cfg.mount_options = vec![
        MountOption::FSName("coarse".into()),
        MountOption::Subtype("coarse".into()),
        MountOption::RO,
    ];
    Session::new(fs, mountpoint, &cfg)?.run()?;
    Ok(())
}

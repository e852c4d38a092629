//! Invalidations sent to the kernel from a thread with a descriptor table of its own.
//!
//! `notify_inval_entry` waits, uninterruptibly, for the directory's inode lock, which a
//! request in flight may hold (a create or lookup in that directory). If the daemon is
//! killed (`kill -9`) while such a request is unanswered and an invalidation waits for its
//! lock, the kernel answers the request only once the descriptor that request was read on
//! is released, at the process's last thread's exit, and the waiting invalidation is that
//! last thread: the daemon stays a zombie, the mount hangs, and so does anyone who closes
//! a file of it (a forced FLUSH), until the connection is aborted by hand.
//!
//! So the invalidations are written by one thread that holds nothing but its own clone of
//! the FUSE device (`FUSE_DEV_IOC_CLONE`, from which nothing is read): it shares no
//! descriptor table with the request threads, so their exit releases the descriptors
//! their requests were read on, the kernel ends those requests, the lock is freed, and the
//! writer's wait ends too. fuser's `Notifier` writes on the session's own descriptor, so
//! the two messages are built here (`fuse_kernel.h`: `fuse_out_header` with `unique` 0 and
//! the notification's code as `error`, then its body).
//!
//! One notification is written from the calling thread instead (`AttrDropper`): dropping
//! a node's attributes alone waits for no lock, so a request may send it before its reply.

use std::ffi::OsStr;
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::mpsc;

const FUSE_NOTIFY_INVAL_INODE: i32 = 2;
const FUSE_NOTIFY_INVAL_ENTRY: i32 = 3;
/// `_IOR(229, 0, uint32_t)`.
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

type Reply = mpsc::SyncSender<io::Result<()>>;

/// Sends invalidations through the writer thread and returns each one's result.
pub struct KernelNotifier {
    tx: mpsc::Sender<(Vec<u8>, Reply)>,
}

impl KernelNotifier {
    /// Clones the session's FUSE device `session` and starts the writer thread (named
    /// `notify`; it ends when the notifier is dropped).
    pub fn start(session: BorrowedFd<'_>) -> io::Result<KernelNotifier> {
        let dev = clone_device(session)?;
        let number = dev.as_raw_fd();
        let (tx, rx) = mpsc::channel::<(Vec<u8>, Reply)>();
        let (alone_tx, alone_rx) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("notify".into())
            .spawn(move || {
                let alone = keep_only(dev.as_fd());
                if let Err(e) = &alone {
                    tracing::warn!("notify thread shares the daemon's descriptors: {e}");
                }
                let _ = alone_tx.send(alone.is_ok());
                for (msg, reply) in rx {
                    let _ = reply.send(write_all(dev.as_fd(), &msg));
                }
            })?;
        // Once the thread has a table of its own, the daemon's copy of the device goes
        // (the thread's `OwnedFd` closes the number in its own table only).
        if alone_rx.recv() == Ok(true) {
            // SAFETY: `number` is open in this table, and nothing here owns it any more.
            unsafe { libc::close(number) };
        }
        Ok(KernelNotifier { tx })
    }

    /// The kernel drops node `ino`'s attributes and cached data (all of it).
    pub fn inval_inode(&self, ino: u64) -> io::Result<()> {
        self.send(message(FUSE_NOTIFY_INVAL_INODE, &inval_inode_body(ino, 0)))
    }

    /// The kernel drops node `ino`'s attributes, not its pages.
    pub fn inval_attrs(&self, ino: u64) -> io::Result<()> {
        self.send(message(FUSE_NOTIFY_INVAL_INODE, &inval_inode_body(ino, -1)))
    }

    /// The kernel drops the name `name` in directory `parent`.
    pub fn inval_entry(&self, parent: u64, name: &OsStr) -> io::Result<()> {
        let name = name.as_bytes();
        let len = u32::try_from(name.len())
            .map_err(|_| io::Error::from_raw_os_error(libc::ENAMETOOLONG))?;
        let mut body = Vec::with_capacity(16 + name.len() + 1);
        body.extend_from_slice(&parent.to_ne_bytes());
        body.extend_from_slice(&len.to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes()); // flags
        body.extend_from_slice(name);
        body.push(0);
        self.send(message(FUSE_NOTIFY_INVAL_ENTRY, &body))
    }

    fn send(&self, msg: Vec<u8>) -> io::Result<()> {
        let (reply_tx, reply_rx) = mpsc::sync_channel(1);
        let gone = || io::Error::other("the notify thread is gone");
        self.tx.send((msg, reply_tx)).map_err(|_| gone())?;
        reply_rx.recv().map_err(|_| gone())?
    }
}

/// Drops the kernel's attributes of a node from the calling thread, on a clone of the FUSE
/// device of its own.
///
/// The kernel takes a file's size from the last attributes it was given and cuts its
/// cached reads there (`fuse_cache_read_iter` asks again only once they are dropped or
/// expired). An open served by the daemon whose version has another size than the one the
/// kernel holds (the file replaced or resized behind the mount since) drops them before
/// its reply, or the reader's reads end at the old size. A notice from the notify thread
/// could arrive after the first read (it may wait behind an entry's invalidation, which
/// waits for a directory lock); this one cannot, and needs no lock itself: with a
/// negative offset, `fuse_reverse_inval_inode` only bumps the node's attribute version and
/// marks its attributes stale (so a reply to a request sent before it is not applied
/// either), and invalidates no pages.
pub struct AttrDropper {
    dev: OwnedFd,
}

impl AttrDropper {
    pub fn new(session: BorrowedFd<'_>) -> io::Result<AttrDropper> {
        Ok(AttrDropper {
            dev: clone_device(session)?,
        })
    }

    /// The kernel drops node `ino`'s attributes (not its pages). `ENOENT`: it holds no
    /// such node, so no attributes of it.
    pub fn drop_attrs(&self, ino: u64) -> io::Result<()> {
        let msg = message(FUSE_NOTIFY_INVAL_INODE, &inval_inode_body(ino, -1));
        match write_all(self.dev.as_fd(), &msg) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            r => r,
        }
    }
}

impl AttrDropper {
    /// The kernel drops directory `ino`'s cached listing (its pages) and attributes. A
    /// directory's pages are locked only while entries are copied into or out of them,
    /// never across a request, so this waits for no request either.
    pub fn drop_listing(&self, ino: u64) -> io::Result<()> {
        let msg = message(FUSE_NOTIFY_INVAL_INODE, &inval_inode_body(ino, 0));
        match write_all(self.dev.as_fd(), &msg) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            r => r,
        }
    }
}

/// `fuse_notify_inval_inode_out`: the node, and the offset its page invalidation starts at
/// (negative: none) with length 0 (to the end).
fn inval_inode_body(ino: u64, offset: i64) -> Vec<u8> {
    let mut body = Vec::with_capacity(24);
    body.extend_from_slice(&ino.to_ne_bytes());
    body.extend_from_slice(&offset.to_ne_bytes());
    body.extend_from_slice(&0i64.to_ne_bytes());
    body
}

/// A notification: `fuse_out_header` with `unique` 0 and the code as `error`, then `body`.
fn message(code: i32, body: &[u8]) -> Vec<u8> {
    let len = 16 + body.len();
    let mut msg = Vec::with_capacity(len);
    msg.extend_from_slice(&(len as u32).to_ne_bytes());
    msg.extend_from_slice(&code.to_ne_bytes());
    msg.extend_from_slice(&0u64.to_ne_bytes()); // unique: a notification
    msg.extend_from_slice(body);
    msg
}

/// A new descriptor of the FUSE connection that `session` is one of.
fn clone_device(session: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    let dev = rustix::fs::open("/dev/fuse", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())?;
    let mut source = session.as_raw_fd() as u32;
    // SAFETY: FUSE_DEV_IOC_CLONE reads one u32 (the descriptor to clone) from the pointer.
    let r = unsafe { libc::ioctl(dev.as_raw_fd(), FUSE_DEV_IOC_CLONE, &mut source) };
    if r == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(dev)
}

/// Gives the calling thread a descriptor table of its own holding only `keep`: closing the
/// copies of the others releases nothing of the daemon's, whose table still holds them.
/// Not even the standard ones are kept: before the daemon's output goes to its log they
/// are the caller's terminal or pipe, which a copy here would hold open for good.
fn keep_only(keep: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: unshare(CLONE_FILES) only changes this thread's descriptor table.
    if unsafe { libc::unshare(libc::CLONE_FILES) } == -1 {
        return Err(io::Error::last_os_error());
    }
    let keep = keep.as_raw_fd() as u32;
    let close = |from: u32, to: u32| {
        // SAFETY: closes descriptors of this thread's private table only (after the
        // unshare), none of which this thread owns as a Rust object but `keep`.
        if from <= to && unsafe { libc::syscall(libc::SYS_close_range, from, to, 0) } == -1 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    };
    close(0, keep.saturating_sub(1))?;
    close(keep + 1, u32::MAX)
}

fn write_all(dev: BorrowedFd<'_>, msg: &[u8]) -> io::Result<()> {
    loop {
        match rustix::io::writev(dev, &[IoSlice::new(msg)]) {
            Ok(n) if n == msg.len() => return Ok(()),
            Ok(_) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

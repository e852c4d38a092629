//! A write in place behind the mount, caught in the middle of its copy. A write moves the
//! file's mtime and ctime *before* it copies its bytes (ext4, xfs, tmpfs), so a fetch made
//! while the copy is under way reads part new bytes and part old (or a torn page) under
//! the new version's identity, and no stat taken after the copy tells the difference.
//! Such bytes may be served while the write is under way, as a native read would return
//! them; they must not outlive it.
//!
//! The write is stopped deterministically: its buffer's second half is registered with
//! `userfaultfd`, so the kernel's copy from it blocks at the first page of that half until
//! the test supplies the page.

mod common;

use std::fs;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::time::Duration;

use common::TestMount;

const LEN: usize = 1 << 20;

/// A write buffer of `LEN` bytes whose first `ready` bytes hold `fill` and whose rest is
/// registered with a `userfaultfd`: the kernel's first touch of it blocks until `supply`.
struct StalledBuffer {
    ptr: *mut u8,
    uffd: OwnedFd,
    ready: usize,
    fill: u8,
}

// SAFETY: the mapping is owned by the struct and lives until drop; the writer thread only
// reads it through the kernel, and the test joins that thread before drop.
unsafe impl Send for StalledBuffer {}
unsafe impl Sync for StalledBuffer {}

// <linux/userfaultfd.h>, x86-64 and arm64 alike: _IOWR(0xAA, nr, size).
const fn iowr(nr: u64, size: u64) -> u64 {
    (3 << 30) | (size << 16) | (0xAA << 8) | nr
}
const UFFDIO_API: u64 = iowr(0x3F, 24);
const UFFDIO_REGISTER: u64 = iowr(0x00, 32);
const UFFDIO_COPY: u64 = iowr(0x03, 40);
const UFFD_API: u64 = 0xAA;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;

impl StalledBuffer {
    /// `None` where userfaultfd is not allowed for faults in the kernel's copies (it needs
    /// `CAP_SYS_PTRACE`, or `vm.unprivileged_userfaultfd`).
    fn new(fill: u8, ready: usize) -> Option<StalledBuffer> {
        // SAFETY: plain syscalls; every pointer passed points at a live local.
        unsafe {
            let fd = libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC);
            if fd < 0 {
                return None;
            }
            let uffd = OwnedFd::from_raw_fd(fd as i32);
            let mut api = [UFFD_API, 0, 0];
            assert_eq!(
                libc::ioctl(uffd.as_raw_fd(), UFFDIO_API as _, api.as_mut_ptr()),
                0,
                "UFFDIO_API: {}",
                std::io::Error::last_os_error()
            );
            let ptr = libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(ptr, libc::MAP_FAILED);
            let ptr = ptr as *mut u8;
            std::ptr::write_bytes(ptr, fill, ready);
            let mut reg = [
                (ptr as u64) + ready as u64,
                (LEN - ready) as u64,
                UFFDIO_REGISTER_MODE_MISSING,
                0,
            ];
            assert_eq!(
                libc::ioctl(uffd.as_raw_fd(), UFFDIO_REGISTER as _, reg.as_mut_ptr()),
                0,
                "UFFDIO_REGISTER: {}",
                std::io::Error::last_os_error()
            );
            Some(StalledBuffer {
                ptr,
                uffd,
                ready,
                fill,
            })
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: mapped for LEN bytes until drop. Only the kernel touches the
        // registered half (a user read of it would block like the kernel's).
        unsafe { std::slice::from_raw_parts(self.ptr, LEN) }
    }

    /// Blocks until a copy from the registered half faults (the write is stalled there);
    /// returns the faulting address's offset in the buffer.
    fn wait_for_fault(&self) -> usize {
        let mut msg = [0u8; 32];
        let mut pfd = libc::pollfd {
            fd: self.uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: plain syscalls on live locals.
        unsafe {
            assert_eq!(
                libc::poll(&mut pfd, 1, 10_000),
                1,
                "the write never reached the stalled half"
            );
            let n = libc::read(self.uffd.as_raw_fd(), msg.as_mut_ptr().cast(), msg.len());
            assert_eq!(n, 32, "uffd_msg: {}", std::io::Error::last_os_error());
        }
        // struct uffd_msg: event (u8) at 0, pagefault.address (u64) at 16.
        assert_eq!(msg[0], 0x12, "not a page fault event");
        let addr = u64::from_ne_bytes(msg[16..24].try_into().unwrap());
        addr as usize - self.ptr as usize
    }

    /// Supplies the registered half, filled with the buffer's fill byte: the write goes on.
    fn supply(&self) {
        let page = vec![self.fill; LEN - self.ready];
        let mut copy = [
            self.ptr as u64 + self.ready as u64,
            page.as_ptr() as u64,
            (LEN - self.ready) as u64,
            0u64,
            0u64,
        ];
        // SAFETY: `page` outlives the call; the range is registered and mapped.
        let r = unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_COPY as _, copy.as_mut_ptr()) };
        assert_eq!(r, 0, "UFFDIO_COPY: {}", std::io::Error::last_os_error());
    }
}

impl Drop for StalledBuffer {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer used.
        unsafe { libc::munmap(self.ptr.cast(), LEN) };
    }
}

/// Rewrites `f` in place behind the mount (all of it 'B' over 'A'), reads it through the
/// mount while the write is stalled halfway, lets the write finish, and after `settle`
/// (time for a watcher's notice) reads it again: it must be all 'B'.
fn a_read_during_a_stalled_write_does_not_outlive_it(args: &[&str], settle: Duration) {
    let t = TestMount::new(args);
    fs::write(t.s("f"), vec![b'A'; LEN]).unwrap();
    assert!(fs::read(t.m("f")).unwrap() == vec![b'A'; LEN]);
    let Some(buf) = StalledBuffer::new(b'B', LEN / 2) else {
        assert_ne!(unsafe { libc::geteuid() }, 0, "userfaultfd refused to root");
        eprintln!("skipped: userfaultfd for kernel copies needs CAP_SYS_PTRACE");
        return;
    };
    let buf = std::sync::Arc::new(buf);
    let writer = {
        let (buf, path) = (buf.clone(), t.s("f"));
        std::thread::spawn(move || {
            let f = fs::OpenOptions::new().write(true).open(path).unwrap();
            f.write_all_at(buf.bytes(), 0).unwrap();
        })
    };
    let at = buf.wait_for_fault();
    assert_eq!(at, LEN / 2, "the write stalled elsewhere than planned");
    // The source now holds B then A, under the write's new mtime: a read through the
    // mount may return that (as a native read would), in a thread in case it waits for the
    // write (it must not wait forever: the write is supplied after a second either way).
    let during = {
        let path = t.m("f");
        std::thread::spawn(move || fs::read(path))
    };
    std::thread::sleep(Duration::from_millis(300));
    buf.supply();
    writer.join().unwrap();
    let during = during.join().unwrap().unwrap();
    assert_eq!(during.len(), LEN);
    assert!(during.iter().all(|b| *b == b'A' || *b == b'B'));
    std::thread::sleep(settle);
    for round in 0..3 {
        let after = fs::read(t.m("f")).unwrap();
        let old = after.iter().filter(|b| **b != b'B').count();
        assert!(
            old == 0,
            "round {round}: {old} bytes of the old version served after the write returned \
             (the read during it had {} new bytes)",
            during.iter().filter(|b| **b == b'B').count()
        );
    }
}

#[test]
fn a_read_during_a_stalled_write_does_not_outlive_it_without_a_watcher() {
    a_read_during_a_stalled_write_does_not_outlive_it(&["--watch", "off"], Duration::ZERO);
}

#[test]
fn a_read_during_a_stalled_write_does_not_outlive_it_on_a_watched_source() {
    a_read_during_a_stalled_write_does_not_outlive_it(&[], Duration::from_millis(300));
}

#[test]
fn a_read_during_a_stalled_write_does_not_outlive_it_in_a_whole_small_file() {
    a_read_during_a_stalled_write_does_not_outlive_it(
        &["--watch", "off", "--whole-file-threshold", "4M"],
        Duration::ZERO,
    );
}

#[test]
fn a_read_during_a_stalled_write_does_not_outlive_it_with_kernel_opens_without_a_watcher() {
    a_read_during_a_stalled_write_does_not_outlive_it(
        // Attributes never kept: the read during the write asks for them, finds the new
        // mtime and drops the pages of the old version (with a TTL, only sometimes).
        &["--kernel-opens", "--watch", "off", "--attr-ttl", "0"],
        Duration::from_millis(1500),
    );
}

#[test]
fn a_read_during_a_stalled_write_does_not_outlive_it_with_kernel_opens_on_a_watched_source() {
    a_read_during_a_stalled_write_does_not_outlive_it(
        &["--kernel-opens"],
        Duration::from_millis(1500),
    );
}

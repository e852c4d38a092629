//! End-to-end tests of the core mount: every operation through a real FUSE mount, checked
//! on the source; persistence across remount and crash; staleness; passthrough.

mod common;

use std::ffi::CString;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{BIN, TestMount, pattern, wait_until};

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).unwrap()
}

fn errno_of<T>(r: std::io::Result<T>) -> i32 {
    r.err().and_then(|e| e.raw_os_error()).unwrap_or(0)
}

#[test]
fn files_and_directories_go_through_to_the_source() {
    let t = TestMount::new(&[]);
    fs::create_dir(t.m("dir")).unwrap();
    assert!(t.s("dir").is_dir());
    fs::write(t.m("dir/f"), b"hello").unwrap();
    assert_eq!(fs::read(t.s("dir/f")).unwrap(), b"hello");
    assert_eq!(fs::read(t.m("dir/f")).unwrap(), b"hello");

    // Append and overwrite in the middle.
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(t.m("dir/f"))
        .unwrap();
    f.write_all(b" world").unwrap();
    drop(f);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(t.m("dir/f"))
        .unwrap();
    f.write_all_at(b"J", 0).unwrap();
    drop(f);
    assert_eq!(fs::read(t.s("dir/f")).unwrap(), b"Jello world");
    assert_eq!(fs::read(t.m("dir/f")).unwrap(), b"Jello world");

    // Listing.
    fs::write(t.s("dir/g"), b"from the source").unwrap();
    let mut names: Vec<_> = fs::read_dir(t.m("dir"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["f", "g"]);

    // Rename, then the old name is gone on both sides.
    fs::rename(t.m("dir/f"), t.m("dir/h")).unwrap();
    assert!(!t.s("dir/f").exists());
    assert_eq!(fs::read(t.s("dir/h")).unwrap(), b"Jello world");
    assert_eq!(fs::read(t.m("dir/h")).unwrap(), b"Jello world");

    // Rename a directory holding a cached file: its cache entry moves with it.
    fs::create_dir(t.m("dir/sub")).unwrap();
    fs::write(t.m("dir/sub/x"), b"xx").unwrap();
    fs::rename(t.m("dir/sub"), t.m("moved")).unwrap();
    assert_eq!(fs::read(t.m("moved/x")).unwrap(), b"xx");
    assert_eq!(fs::read(t.c("moved/x")).unwrap(), b"xx");

    // Unlink and rmdir.
    fs::remove_file(t.m("dir/h")).unwrap();
    assert!(!t.s("dir/h").exists());
    // Its cache entry goes soon after, off the unlink's path (cache/removals.rs).
    wait_until(
        Duration::from_secs(5),
        "the cache entry dropped with the file",
        || !t.c("dir/h").exists(),
    );
    assert_eq!(errno_of(fs::remove_dir(t.m("dir"))), libc::ENOTEMPTY);
    fs::remove_file(t.m("dir/g")).unwrap();
    fs::remove_dir(t.m("dir")).unwrap();
    assert!(!t.s("dir").exists());
    assert_eq!(errno_of(fs::metadata(t.m("dir"))), libc::ENOENT);
}

#[test]
fn renameat2_flags_hard_links_symlinks_and_special_files() {
    let t = TestMount::new(&[]);
    fs::write(t.m("a"), b"A").unwrap();
    fs::write(t.m("b"), b"B").unwrap();
    let (a, b) = (cpath(&t.m("a")), cpath(&t.m("b")));
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    assert_eq!(r, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EEXIST)
    );
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    assert_eq!(fs::read(t.s("a")).unwrap(), b"B");
    assert_eq!(fs::read(t.m("a")).unwrap(), b"B");
    assert_eq!(fs::read(t.m("b")).unwrap(), b"A");

    // Hard links share an inode and show the right link count through either name.
    fs::hard_link(t.m("a"), t.m("a2")).unwrap();
    let (m1, m2) = (
        fs::metadata(t.m("a")).unwrap(),
        fs::metadata(t.m("a2")).unwrap(),
    );
    assert_eq!(m1.ino(), m2.ino());
    assert_eq!(m2.nlink(), 2);
    assert_eq!(
        fs::metadata(t.s("a2")).unwrap().ino(),
        fs::metadata(t.s("a")).unwrap().ino()
    );
    fs::remove_file(t.m("a")).unwrap();
    assert_eq!(fs::metadata(t.m("a2")).unwrap().nlink(), 1);
    assert_eq!(fs::read(t.m("a2")).unwrap(), b"B");

    // Symlinks: created on the source, read back, never followed by the daemon.
    std::os::unix::fs::symlink("a2", t.m("ln")).unwrap();
    assert_eq!(fs::read_link(t.s("ln")).unwrap(), Path::new("a2"));
    assert_eq!(fs::read_link(t.m("ln")).unwrap(), Path::new("a2"));
    assert_eq!(
        fs::read(t.m("ln")).unwrap(),
        b"B",
        "the kernel follows it inside the mount"
    );
    std::os::unix::fs::symlink("/etc/passwd", t.s("out")).unwrap();
    assert_eq!(fs::read_link(t.m("out")).unwrap(), Path::new("/etc/passwd"));

    // FIFO and socket nodes.
    let fifo = cpath(&t.m("fifo"));
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0);
    assert!(
        fs::symlink_metadata(t.s("fifo"))
            .unwrap()
            .file_type()
            .is_fifo_like()
    );
    let sock = cpath(&t.m("sock"));
    assert_eq!(
        unsafe { libc::mknod(sock.as_ptr(), libc::S_IFSOCK | 0o600, 0) },
        0
    );
    assert_eq!(
        fs::symlink_metadata(t.s("sock")).unwrap().mode() & libc::S_IFMT,
        libc::S_IFSOCK
    );
}

trait FifoLike {
    fn is_fifo_like(&self) -> bool;
}
impl FifoLike for fs::FileType {
    fn is_fifo_like(&self) -> bool {
        std::os::unix::fs::FileTypeExt::is_fifo(self)
    }
}

#[test]
fn attributes_xattrs_statfs_and_space() {
    let t = TestMount::new(&[]);
    fs::write(t.m("f"), pattern(10_000, 1)).unwrap();
    fs::set_permissions(t.m("f"), fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(fs::metadata(t.s("f")).unwrap().mode() & 0o7777, 0o640);
    std::os::unix::fs::chown(t.m("f"), Some(1234), Some(4321)).unwrap();
    let m = fs::metadata(t.s("f")).unwrap();
    assert_eq!((m.uid(), m.gid()), (1234, 4321));

    // atime alone (UTIME_OMIT for mtime) must set atime.
    let p = cpath(&t.m("f"));
    let times = [
        libc::timespec {
            tv_sec: 1_000_000,
            tv_nsec: 5,
        },
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
    ];
    assert_eq!(
        unsafe { libc::utimensat(libc::AT_FDCWD, p.as_ptr(), times.as_ptr(), 0) },
        0
    );
    let m = fs::metadata(t.s("f")).unwrap();
    assert_eq!((m.atime(), m.atime_nsec()), (1_000_000, 5));
    let mtimes = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        libc::timespec {
            tv_sec: 2_000_000,
            tv_nsec: 7,
        },
    ];
    assert_eq!(
        unsafe { libc::utimensat(libc::AT_FDCWD, p.as_ptr(), mtimes.as_ptr(), 0) },
        0
    );
    assert_eq!(fs::metadata(t.m("f")).unwrap().mtime(), 2_000_000);

    // Truncate, shrinking and growing.
    let f = fs::OpenOptions::new().write(true).open(t.m("f")).unwrap();
    f.set_len(100).unwrap();
    assert_eq!(fs::metadata(t.s("f")).unwrap().len(), 100);
    f.set_len(5000).unwrap();
    drop(f);
    let mut want = pattern(10_000, 1);
    want.truncate(100);
    want.resize(5000, 0);
    assert_eq!(fs::read(t.m("f")).unwrap(), want);
    assert_eq!(fs::read(t.s("f")).unwrap(), want);

    // Extended attributes.
    let name = CString::new("user.hoard").unwrap();
    let r = unsafe { libc::setxattr(p.as_ptr(), name.as_ptr(), b"v1".as_ptr().cast(), 2, 0) };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    let mut buf = [0u8; 16];
    let n = unsafe {
        libc::getxattr(
            cpath(&t.s("f")).as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            16,
        )
    };
    assert_eq!(&buf[..n as usize], b"v1");
    let n = unsafe { libc::getxattr(p.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) };
    assert_eq!(n, 2, "size query");
    let n = unsafe { libc::getxattr(p.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), 1) };
    assert_eq!(
        (n, std::io::Error::last_os_error().raw_os_error()),
        (-1, Some(libc::ERANGE))
    );
    let n = unsafe { libc::listxattr(p.as_ptr(), buf.as_mut_ptr().cast(), 16) };
    assert_eq!(&buf[..n as usize], b"user.hoard\0");
    assert_eq!(unsafe { libc::removexattr(p.as_ptr(), name.as_ptr()) }, 0);
    let n = unsafe { libc::getxattr(p.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), 16) };
    assert_eq!(
        (n, std::io::Error::last_os_error().raw_os_error()),
        (-1, Some(libc::ENODATA))
    );

    // statfs is the source's.
    let mut a: libc::statvfs = unsafe { std::mem::zeroed() };
    let mut b: libc::statvfs = unsafe { std::mem::zeroed() };
    unsafe {
        libc::statvfs(cpath(&t.mnt).as_ptr(), &mut a);
        libc::statvfs(cpath(&t.src).as_ptr(), &mut b);
    }
    assert_eq!(
        (a.f_blocks, a.f_bsize, a.f_namemax),
        (b.f_blocks, b.f_bsize, b.f_namemax)
    );

    // fallocate and SEEK_DATA / SEEK_HOLE.
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(t.m("sparse"))
        .unwrap();
    f.write_all_at(b"data", 1 << 20).unwrap();
    let fd = f.as_raw_fd();
    assert_eq!(
        unsafe { libc::fallocate(fd, 0, 0, 8192) },
        0,
        "{}",
        std::io::Error::last_os_error()
    );
    assert_eq!(fs::metadata(t.s("sparse")).unwrap().len(), (1 << 20) + 4);
    // The source's own answers (ext4 reports preallocated space as a hole).
    let src = fs::File::open(t.s("sparse")).unwrap();
    for (off, whence) in [
        (0, libc::SEEK_DATA),
        (0, libc::SEEK_HOLE),
        (8192, libc::SEEK_DATA),
        ((1 << 20) + 1, libc::SEEK_HOLE),
    ] {
        let m = unsafe { libc::lseek(fd, off, whence) };
        let s = unsafe { libc::lseek(src.as_raw_fd(), off, whence) };
        assert_eq!(m, s, "lseek({off}, {whence})");
    }
    assert_eq!(unsafe { libc::lseek(fd, 8192, libc::SEEK_DATA) }, 1 << 20);
    let r = unsafe {
        libc::fallocate(
            fd,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            1 << 20,
            2,
        )
    };
    assert_eq!(r, 0);
    let mut back = vec![0u8; 4];
    f.read_exact_at(&mut back, 1 << 20).unwrap();
    assert_eq!(back, b"\0\0ta");
}

#[test]
fn posix_locks_are_taken_on_the_source() {
    let t = TestMount::new(&[]);
    fs::write(t.m("lockme"), b"x").unwrap();
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(t.m("lockme"))
        .unwrap();
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    assert_eq!(unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETLK, &fl) }, 0);
    // Another process on the source itself sees the lock.
    let other = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(t.s("lockme"))
        .unwrap();
    let mut probe: libc::flock = unsafe { std::mem::zeroed() };
    probe.l_type = libc::F_WRLCK as i16;
    probe.l_whence = libc::SEEK_SET as i16;
    assert_eq!(
        unsafe { libc::fcntl(other.as_raw_fd(), libc::F_OFD_GETLK, &mut probe) },
        0
    );
    assert_eq!(
        probe.l_type,
        libc::F_WRLCK as i16,
        "lock not visible on the source"
    );
    // Closing the file drops the lock, as POSIX says.
    drop(f);
    let mut probe: libc::flock = unsafe { std::mem::zeroed() };
    probe.l_type = libc::F_WRLCK as i16;
    probe.l_whence = libc::SEEK_SET as i16;
    assert_eq!(
        unsafe { libc::fcntl(other.as_raw_fd(), libc::F_OFD_GETLK, &mut probe) },
        0
    );
    assert_eq!(probe.l_type, libc::F_UNLCK as i16);
}

/// A reader's close sends no FLUSH (`FOPEN_NOFLUSH`), yet every close still drops the
/// locks POSIX says it drops.
#[test]
fn readers_close_without_a_flush_and_their_locks_still_go() {
    let t = TestMount::new(&[]);
    fs::write(t.m("lockme"), b"x").unwrap();
    let flushes = |t: &TestMount| t.stats().requests["flush"];
    let lock = |f: &fs::File, typ: i32| {
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = typ as i16;
        fl.l_whence = libc::SEEK_SET as i16;
        unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETLK, &fl) }
    };
    // Whether a process on the source itself could take a write lock now.
    let source_unlocked = |t: &TestMount| {
        let other = fs::File::open(t.s("lockme")).unwrap();
        let mut probe: libc::flock = unsafe { std::mem::zeroed() };
        probe.l_type = libc::F_WRLCK as i16;
        probe.l_whence = libc::SEEK_SET as i16;
        let r = unsafe { libc::fcntl(other.as_raw_fd(), libc::F_OFD_GETLK, &mut probe) };
        assert_eq!(r, 0);
        probe.l_type == libc::F_UNLCK as i16
    };

    // Plain reads: no FLUSH at all.
    let before = flushes(&t);
    for _ in 0..5 {
        assert_eq!(fs::read(t.m("lockme")).unwrap(), b"x");
    }
    assert_eq!(flushes(&t), before);

    // A read lock taken through such a reader goes with its close.
    let r = fs::File::open(t.m("lockme")).unwrap();
    assert_eq!(lock(&r, libc::F_RDLCK), 0);
    assert!(!source_unlocked(&t), "the read lock is not on the source");
    drop(r);
    wait_until(
        Duration::from_secs(5),
        "the read lock dropped at release",
        || source_unlocked(&t),
    );

    // While the file has a lock holder, a reader opened then closes with a FLUSH, and that
    // close drops the holder's locks taken through another descriptor, as POSIX says.
    let w = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(t.m("lockme"))
        .unwrap();
    assert_eq!(lock(&w, libc::F_WRLCK), 0);
    assert!(!source_unlocked(&t));
    let before = flushes(&t);
    drop(fs::File::open(t.m("lockme")).unwrap());
    // At least one: `w` may send more. Another test's fork duplicates every descriptor of
    // this process, and the child's close of its copy (at exec) is a close of `w` too.
    assert!(flushes(&t) > before, "the reader closed without a FLUSH");
    assert!(
        source_unlocked(&t),
        "closing another descriptor kept the lock"
    );
    drop(w);
}

/// With a source timeout, a blocking lock that waits for another holder longer than the
/// timeout is not a hung source: it is taken once the holder lets go, and the mount stays
/// online.
#[test]
fn a_blocking_lock_waits_past_the_source_timeout() {
    let t = TestMount::new(&["--source-timeout", "1"]);
    fs::write(t.m("lockme"), b"x").unwrap();
    let holder = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(t.s("lockme"))
        .unwrap();
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    assert_eq!(
        unsafe { libc::fcntl(holder.as_raw_fd(), libc::F_OFD_SETLK, &fl) },
        0
    );
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(t.m("lockme"))
        .unwrap();
    let fd = f.as_raw_fd();
    let waiter = std::thread::spawn(move || {
        let t0 = Instant::now();
        let r = unsafe { libc::fcntl(fd, libc::F_SETLKW, &fl) };
        let r = (r == 0)
            .then_some(())
            .ok_or_else(std::io::Error::last_os_error);
        (r, t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert!(!waiter.is_finished(), "the lock is held on the source");
    fl.l_type = libc::F_UNLCK as i16;
    assert_eq!(
        unsafe { libc::fcntl(holder.as_raw_fd(), libc::F_OFD_SETLK, &fl) },
        0
    );
    let (r, took) = waiter.join().unwrap();
    r.unwrap();
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(t.stats().health.online, "a lock wait is no timeout");
    // Taken on the source.
    fl.l_type = libc::F_WRLCK as i16;
    assert_eq!(
        unsafe { libc::fcntl(holder.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) },
        0
    );
    assert_eq!(fl.l_type, libc::F_WRLCK as i16);
    drop(f);
}

#[test]
fn cached_data_survives_remount_without_reading_the_source() {
    let t = &mut TestMount::new(&["--chunk-size", "64K", "--whole-file-threshold", "128K"]);
    let small = pattern(100_000, 2);
    let big = pattern(3_000_000, 3);
    fs::write(t.s("small"), &small).unwrap();
    fs::write(t.s("big"), &big).unwrap();
    assert_eq!(fs::read(t.m("small")).unwrap(), small);
    assert_eq!(fs::read(t.m("big")).unwrap(), big);
    let first = t.stats().cache;
    assert!(first.bytes_from_source >= (small.len() + big.len()) as u64);
    // The cache mirrors the tree and is readable without hoardfs.
    assert_eq!(fs::read(t.c("small")).unwrap(), small);
    assert_eq!(fs::read(t.c("big")).unwrap(), big);

    t.remount();
    assert_eq!(fs::read(t.m("small")).unwrap(), small);
    assert_eq!(fs::read(t.m("big")).unwrap(), big);
    let s = t.stats().cache;
    assert_eq!(
        s.bytes_from_source, 0,
        "remount must serve from the cache: {s:?}"
    );
    assert_eq!(s.open_hits, 2);
}

#[test]
fn partially_cached_large_files_fetch_only_missing_chunks() {
    let t = &mut TestMount::new(&["--chunk-size", "64K", "--whole-file-threshold", "128K"]);
    let big = pattern(1 << 20, 4);
    fs::write(t.s("big"), &big).unwrap();
    let f = fs::File::open(t.m("big")).unwrap();
    let mut buf = vec![0u8; 1000];
    f.read_exact_at(&mut buf, 300_000).unwrap();
    assert_eq!(buf, big[300_000..301_000]);
    drop(f);
    let s = t.stats().cache;
    assert_eq!(s.chunks_fetched, 1, "one chunk for one small read: {s:?}");
    assert!(s.bytes_from_source <= 65536);
    t.remount();
    let f = fs::File::open(t.m("big")).unwrap();
    f.read_exact_at(&mut buf, 300_000).unwrap();
    assert_eq!(buf, big[300_000..301_000]);
    assert_eq!(
        t.stats().cache.bytes_from_source,
        0,
        "the chunk bitmap persisted"
    );
}

#[test]
fn source_changes_are_seen_on_open() {
    let t = &mut TestMount::new(&["--attr-ttl", "0", "--entry-ttl", "0"]);
    fs::write(t.s("f"), b"version one").unwrap();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"version one");
    // New size and mtime, changed behind the mount.
    fs::write(t.s("f"), b"version two, longer").unwrap();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"version two, longer");
    // Same size, only the mtime moves.
    let before = fs::metadata(t.s("f")).unwrap();
    let f = fs::OpenOptions::new().write(true).open(t.s("f")).unwrap();
    f.write_all_at(b"VERSION", 0).unwrap();
    drop(f);
    let after = fs::metadata(t.s("f")).unwrap();
    assert_eq!(before.len(), after.len());
    assert_eq!(fs::read(t.m("f")).unwrap(), b"VERSION two, longer");
    // Each change emptied the cache, or, when the previous read's handle was still open
    // (its RELEASE comes after close(2) returns), left that handle its version and moved
    // the name to a new node.
    let c = t.stats().cache;
    assert!(c.stale_invalidations + c.versions_kept >= 2, "{c:?}");

    // Changed while unmounted.
    t.unmount();
    fs::write(t.s("f"), b"offline edit").unwrap();
    t.mount();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"offline edit");
}

#[test]
fn no_stale_check_trusts_the_cache() {
    let t = &mut TestMount::new(&["--no-stale-check", "--attr-ttl", "0"]);
    fs::write(t.s("f"), b"cached").unwrap();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"cached");
    t.unmount();
    // Same size so that the kernel's view of the size does not cut the read short.
    fs::write(t.s("f"), b"CHANGE").unwrap();
    t.mount();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"cached");
}

#[test]
fn fully_cached_files_are_read_through_passthrough() {
    let t = &mut TestMount::new(&[]);
    let data = pattern(4 << 20, 5);
    fs::write(t.s("f"), &data).unwrap();
    assert_eq!(fs::read(t.m("f")).unwrap(), data); // whole-file fetch on first open
    let reads_before = t.stats().requests["read"];
    for _ in 0..3 {
        let mut f = fs::File::open(t.m("f")).unwrap();
        let mut back = Vec::new();
        f.read_to_end(&mut back).unwrap();
        assert_eq!(back, data);
    }
    let s = t.stats();
    assert_eq!(
        s.requests["read"], reads_before,
        "passthrough reads must not reach the daemon"
    );
    assert!(s.cache.passthrough_opens >= 3);

    // A writer while no reader is open: write-through, and readers then see the new bytes.
    let f = fs::OpenOptions::new().write(true).open(t.m("f")).unwrap();
    f.write_all_at(b"NEW", 10).unwrap();
    drop(f);
    assert_eq!(&fs::read(t.s("f")).unwrap()[10..13], b"NEW");
    let mut f = fs::File::open(t.m("f")).unwrap();
    let mut back = [0u8; 3];
    f.seek(SeekFrom::Start(10)).unwrap();
    f.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"NEW");
}

#[test]
fn a_corrupt_record_is_discarded_and_the_file_refetched() {
    let t = &mut TestMount::new(&[]);
    t.expect_warnings();
    fs::write(t.s("f"), b"good bytes").unwrap();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"good bytes");
    t.unmount();
    // Corrupt both the cached data and its record.
    fs::write(t.c("f"), b"evil bytes").unwrap();
    let meta = t.cache.join("meta/f");
    let mut rec = fs::read(&meta).unwrap();
    let last = rec.len() - 1;
    rec[last] ^= 0xff;
    fs::write(&meta, rec).unwrap();
    t.mount();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"good bytes");
    assert_eq!(t.stats().cache.corrupt_records, 1);
}

#[test]
fn cache_data_edited_behind_our_back_is_not_served() {
    let t = &mut TestMount::new(&[]);
    t.expect_warnings();
    fs::write(t.s("f"), b"0123456789").unwrap();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"0123456789");
    t.unmount();
    // A truncated cache file no longer matches its record.
    fs::write(t.c("f"), b"0123").unwrap();
    t.mount();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"0123456789");
}

#[test]
fn sigkill_during_writes_loses_no_acknowledged_write() {
    let t = &mut TestMount::new(&["--chunk-size", "64K", "--whole-file-threshold", "128K"]);
    fs::write(t.s("seed"), pattern(500_000, 9)).unwrap();
    assert_eq!(fs::read(t.m("seed")).unwrap().len(), 500_000);
    let path = t.m("log");
    let writer = std::thread::spawn(move || {
        let mut f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        let mut acked = 0u64;
        for i in 0u64.. {
            let rec = format!("{i:016}\n");
            if f.write_all(rec.as_bytes()).is_err() {
                break;
            }
            acked = i + 1;
        }
        acked
    });
    std::thread::sleep(std::time::Duration::from_millis(700));
    t.crash();
    let acked = writer.join().unwrap();
    assert!(acked > 0);
    let on_source = fs::read(t.s("log")).unwrap();
    assert!(
        on_source.len() as u64 >= acked * 17,
        "acknowledged writes missing from the source"
    );
    for (i, line) in on_source.chunks(17).take(acked as usize).enumerate() {
        assert_eq!(line, format!("{i:016}\n").as_bytes());
    }
    t.mount();
    // The mount comes back by itself, and what it serves is the source's data.
    assert_eq!(fs::read(t.m("log")).unwrap(), on_source);
    assert_eq!(fs::read(t.m("seed")).unwrap(), pattern(500_000, 9));
    t.unmount();
    // No cache file marked valid differs from the source.
    for name in ["log", "seed"] {
        let meta = fs::read(t.cache.join("meta").join(name)).unwrap();
        let rec = hoardfs::cache::CacheRecord::decode(&meta).unwrap();
        let src = fs::read(t.s(name)).unwrap();
        let cached = fs::read(t.c(name)).unwrap();
        for c in 0..rec.nchunks() {
            if rec.is_present(c) {
                let (a, b) = (
                    (c * rec.chunk_size) as usize,
                    (((c + 1) * rec.chunk_size) as usize).min(src.len()),
                );
                assert_eq!(
                    cached[a..b],
                    src[a..b],
                    "{name}: chunk {c} differs from the source"
                );
            }
        }
    }
}

#[test]
fn bad_invocations_get_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let (src, mnt) = (d.path().join("src"), d.path().join("mnt"));
    fs::create_dir_all(src.join("inner")).unwrap();
    fs::create_dir(&mnt).unwrap();
    let run = |args: &[&std::ffi::OsStr]| Command::new(BIN).args(args).output().unwrap();

    let out = run(&[
        src.as_os_str(),
        mnt.as_os_str(),
        "--cache-dir".as_ref(),
        src.join("inner").as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("must not be inside the source"),
        "{out:?}"
    );

    let out = run(&[
        src.as_os_str(),
        mnt.as_os_str(),
        "-o".as_ref(),
        "frobnicate=1".as_ref(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown mount option"));

    let out = run(&[d.path().join("nope").as_os_str(), mnt.as_os_str()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("source"));

    let out = run(&["stats".as_ref(), mnt.as_os_str()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not inside a hoardfs mount"));
}

#[test]
fn daemon_mode_returns_once_mounted_and_sigterm_unmounts() {
    let d = tempfile::tempdir().unwrap();
    let base = fs::canonicalize(d.path()).unwrap();
    let (src, mnt, cache) = (base.join("src"), base.join("mnt"), base.join("cache"));
    fs::create_dir(&src).unwrap();
    fs::create_dir(&mnt).unwrap();
    fs::write(src.join("hello"), b"hi").unwrap();
    let st = Command::new(BIN)
        .arg(&src)
        .arg(&mnt)
        .arg("--cache-dir")
        .arg(&cache)
        .status()
        .unwrap();
    assert!(st.success());
    // Ready when the command returns: no waiting.
    assert_eq!(fs::read(mnt.join("hello")).unwrap(), b"hi");
    let snap = hoardfs::control::request_stats(&mnt).unwrap();
    assert_eq!(snap.cache_dir, cache.display().to_string());
    // The daemon: the peer of its control socket (`SO_PEERCRED`). Not `pgrep -f`, which
    // reads every process's command line and hangs while any process on the machine is
    // stuck in the kernel.
    let conn =
        std::os::unix::net::UnixStream::connect(hoardfs::control::socket_path(&mnt)).unwrap();
    let pid: i32 = rustix::net::sockopt::socket_peercred(&conn)
        .unwrap()
        .pid
        .as_raw_nonzero()
        .get();
    drop(conn);
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while common::is_mounted(&mnt) {
        assert!(
            std::time::Instant::now() < deadline,
            "SIGTERM did not unmount"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(fs::read(src.join("hello")).unwrap(), b"hi");
}

#[test]
fn files_created_through_the_mount_belong_to_the_caller() {
    if !rustix::process::geteuid().is_root() {
        return;
    }
    let t = TestMount::new(&["--allow-other"]);
    fs::set_permissions(&t.mnt, fs::Permissions::from_mode(0o777)).unwrap();
    fs::set_permissions(&t.src, fs::Permissions::from_mode(0o777)).unwrap();
    let script = format!("echo hi > {0}/mine && mkdir {0}/d", t.mnt.display());
    let st = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            &script,
        ])
        .status()
        .unwrap();
    assert!(st.success());
    for name in ["mine", "d"] {
        let m = fs::metadata(t.s(name)).unwrap();
        assert_eq!((m.uid(), m.gid()), (65534, 65534), "{name}");
    }
    // And the kernel's permission checks hold: nobody cannot write root's file.
    fs::write(t.m("roots"), b"x").unwrap();
    fs::set_permissions(t.m("roots"), fs::Permissions::from_mode(0o644)).unwrap();
    let script = format!("echo no > {}/roots", t.mnt.display());
    let st = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "sh",
            "-c",
            &script,
        ])
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!st.success());
    assert_eq!(fs::read(t.s("roots")).unwrap(), b"x");
}

/// The cache entries of unlinked names are removed off the unlink's path
/// (`cache/removals.rs`), behind a queue. A file made again under the name at once, with
/// many removals queued before its own, must get a cache entry of its new bytes that the
/// old removal never takes, and the old bytes must never be read.
#[test]
fn a_name_unlinked_and_made_again_at_once_keeps_its_new_cache_entry() {
    let t = TestMount::new(&[]);
    fs::create_dir(t.m("d")).unwrap();
    for round in 0..150u64 {
        let old = pattern(5_000, round);
        fs::write(t.m("f"), &old).unwrap();
        assert_eq!(fs::read(t.m("f")).unwrap(), old);
        // Removals queued ahead of f's, so that the queue lags behind.
        for i in 0..20 {
            fs::write(t.m(&format!("d/o{i}")), b"x").unwrap();
        }
        for i in 0..20 {
            fs::remove_file(t.m(&format!("d/o{i}"))).unwrap();
        }
        fs::remove_file(t.m("f")).unwrap();
        let new = pattern(3_000, round + 1_000);
        fs::write(t.m("f"), &new).unwrap();
        assert_eq!(fs::read(t.m("f")).unwrap(), new, "round {round}");
        assert_eq!(
            fs::read(t.c("f")).ok(),
            Some(new),
            "round {round}: the cache entry of the new file is gone or old"
        );
    }
}

fn set_tag(path: &Path, value: &[u8]) {
    let p = cpath(path);
    let r = unsafe {
        libc::setxattr(
            p.as_ptr(),
            c"user.tag".as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(
        r,
        0,
        "setxattr {path:?}: {}",
        std::io::Error::last_os_error()
    );
}

/// A metadata change or question is of the kernel's node, that is of one file: it must reach that file
/// even when its name was taken by another behind the mount (nothing watched here, so the
/// mount still knows the node by the old name), and never the file that has the name now.
#[test]
fn metadata_requests_reach_the_nodes_file_not_the_one_that_took_its_name() {
    let t = TestMount::new(&["--watch", "off"]);
    for round in 0..20 {
        fs::write(t.m("f"), b"first").unwrap();
        set_tag(&t.s("f"), b"node");
        let open = fs::File::open(t.m("f")).unwrap();
        // Behind the mount: the file moves away, another takes its name.
        fs::rename(t.s("f"), t.s("moved")).unwrap();
        fs::write(t.s("f"), b"second").unwrap();
        fs::set_permissions(t.s("f"), fs::Permissions::from_mode(0o644)).unwrap();
        set_tag(&t.s("f"), b"other");
        // fgetxattr of the open node.
        let mut buf = [0u8; 16];
        let n = unsafe {
            libc::fgetxattr(
                open.as_raw_fd(),
                c"user.tag".as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        assert_eq!(
            &buf[..n.max(0) as usize],
            b"node",
            "round {round}: the node's xattr"
        );
        // fchmod and futimens of the open node.
        open.set_permissions(fs::Permissions::from_mode(0o600))
            .unwrap();
        let when = std::time::UNIX_EPOCH + Duration::from_secs(1_000_000 + round);
        open.set_modified(when).unwrap();
        let moved = fs::metadata(t.s("moved")).unwrap();
        let other = fs::metadata(t.s("f")).unwrap();
        assert_eq!(
            moved.mode() & 0o7777,
            0o600,
            "round {round}: the node's file"
        );
        assert_eq!(moved.modified().unwrap(), when, "round {round}");
        assert_eq!(
            other.mode() & 0o7777,
            0o644,
            "round {round}: the other file changed"
        );
        assert_ne!(other.modified().unwrap(), when, "round {round}");
        drop(open);
        fs::remove_file(t.s("moved")).unwrap();
        fs::remove_file(t.s("f")).unwrap();
    }
}

#[test]
fn open_unlinked_files_keep_working() {
    let t = TestMount::new(&["--chunk-size", "64K", "--whole-file-threshold", "64K"]);
    let data = pattern(300_000, 11);
    fs::write(t.s("f"), &data).unwrap();
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(t.m("f"))
        .unwrap();
    fs::remove_file(t.m("f")).unwrap();
    let mut buf = vec![0u8; 1000];
    f.read_exact_at(&mut buf, 200_000).unwrap();
    assert_eq!(buf, data[200_000..201_000]);
    f.write_all_at(b"still here", 0).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 300_000);
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut head = [0u8; 10];
    f.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"still here");
}

#[test]
fn mode_bits_of_new_files_follow_the_callers_umask() {
    let t = TestMount::new(&[]);
    let f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o640)
        .open(t.m("x"))
        .unwrap();
    drop(f);
    assert_eq!(
        fs::metadata(t.s("x")).unwrap().mode() & 0o777,
        0o640 & !current_umask()
    );
}

fn current_umask() -> u32 {
    let m = unsafe { libc::umask(0o022) };
    unsafe { libc::umask(m) };
    m
}

#[test]
fn a_writer_cannot_join_passthrough_readers_but_can_without_passthrough() {
    let t = TestMount::new(&[]);
    fs::write(t.s("f"), b"cached").unwrap();
    let reader = fs::File::open(t.m("f")).unwrap(); // fetched whole: passthrough
    assert_eq!(t.stats().cache.passthrough_opens, 1);
    let w = fs::OpenOptions::new().write(true).open(t.m("f"));
    assert_eq!(errno_of(w), libc::ETXTBSY, "documented restriction");
    drop(reader);
    // The reader's release may still be in flight: the writer waits for it.
    let w = fs::OpenOptions::new().write(true).open(t.m("f")).unwrap();
    w.write_all_at(b"C", 0).unwrap();
    drop(w);
    assert_eq!(fs::read(t.s("f")).unwrap(), b"Cached");

    let t = TestMount::new(&["--no-passthrough"]);
    fs::write(t.s("f"), b"cached").unwrap();
    let reader = fs::File::open(t.m("f")).unwrap();
    let w = fs::OpenOptions::new().write(true).open(t.m("f")).unwrap();
    w.write_all_at(b"C", 0).unwrap();
    let mut back = [0u8; 6];
    reader.read_exact_at(&mut back, 0).unwrap();
    assert_eq!(&back, b"Cached", "the reader sees the write");
    assert_eq!(t.stats().cache.passthrough_opens, 0);
}

#[test]
fn fstat_of_an_open_unlinked_cached_file_answers() {
    let t = TestMount::new(&[]);
    fs::write(t.s("f"), b"Hello").unwrap();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"Hello"); // fully cached
    let f = fs::File::open(t.m("f")).unwrap();
    fs::remove_file(t.m("f")).unwrap();
    let m = f.metadata().unwrap();
    assert_eq!((m.nlink(), m.len()), (0, 5));
}

#[test]
fn creating_in_a_directory_removed_behind_the_mount_is_enoent() {
    let t = TestMount::new(&[]);
    fs::create_dir(t.m("sub")).unwrap();
    fs::metadata(t.m("sub")).unwrap();
    fs::remove_dir(t.s("sub")).unwrap();
    assert_eq!(errno_of(fs::create_dir(t.m("sub/x"))), libc::ENOENT);
    assert_eq!(
        errno_of(std::os::unix::fs::symlink("t", t.m("sub/l"))),
        libc::ENOENT
    );
    fs::write(t.m("file"), b"x").unwrap();
    assert_eq!(
        errno_of(fs::hard_link(t.m("file"), t.m("sub/h"))),
        libc::ENOENT
    );
}

#[test]
fn listing_with_attributes_needs_no_lookups() {
    // The tree is made before the mount: made behind a live mount, its events reach the
    // watcher, whose notice for `d` (sent when it had not yet seen the kernel look `d` up)
    // may arrive mid-listing and take the names below `d` with it (once in CI: 86 lookups).
    let mut t = TestMount::unmounted_at("mnt", &["--entry-ttl", "60", "--attr-ttl", "60"]);
    fs::create_dir(t.s("d")).unwrap();
    for i in 0..200 {
        fs::write(t.s(&format!("d/f{i}")), format!("{i}")).unwrap();
    }
    t.mount();
    let before = t.stats().requests;
    // What `ls -l` does: list, then stat every name.
    let mut n = 0;
    for e in fs::read_dir(t.m("d")).unwrap() {
        let e = e.unwrap();
        let m = fs::symlink_metadata(e.path()).unwrap();
        assert!(m.is_file());
        n += 1;
    }
    assert_eq!(n, 200);
    let after = t.stats().requests;
    let lookups = after["lookup"] - before["lookup"];
    assert!(
        after["readdirplus"] > before["readdirplus"],
        "readdirplus used"
    );
    let count =
        |op: &str| after.get(op).copied().unwrap_or(0) - before.get(op).copied().unwrap_or(0);
    assert!(
        lookups <= 2,
        "{lookups} lookups reached the daemon for 200 names ({} readdirplus, {} readdir)",
        count("readdirplus"),
        count("readdir"),
    );
    // The names are the kernel's now: the sizes are right without asking again.
    assert_eq!(fs::metadata(t.m("d/f150")).unwrap().len(), 3);
}

/// Over a FUSE source (sshfs, rclone: they number inodes themselves, anew after their
/// kernel forgets a file) the cache identity leaves inode numbers out, or every re-lookup
/// would look like a new version. bindfs stands in for such a source here: it is FUSE,
/// though it happens to pass the real inode numbers through.
#[test]
fn a_source_that_renumbers_inodes_keeps_its_cache() {
    let d = tempfile::tempdir().unwrap();
    let base = fs::canonicalize(d.path()).unwrap();
    let (real, src, mnt, cache) = (
        base.join("real"),
        base.join("src"),
        base.join("mnt"),
        base.join("cache"),
    );
    for p in [&real, &src, &mnt] {
        fs::create_dir(p).unwrap();
    }
    fs::write(real.join("f"), b"remote bytes").unwrap();
    // Written well before it is read: a version read within the source's timestamp
    // granularity of its mtime (1 s on FUSE sources) would be fetched again on purpose.
    fs::File::options()
        .write(true)
        .open(real.join("f"))
        .unwrap()
        .set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(60))
        .unwrap();
    let st = Command::new("bindfs")
        .arg(&real)
        .arg(&src)
        .status()
        .expect("bindfs (apt-get install bindfs)");
    assert!(st.success());
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            // The daemon above may still be closing its source descriptors: then detach.
            let ok = Command::new("umount")
                .arg(self.0)
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(self.0).status();
            }
        }
    }
    let _bindfs = Unmount(&src);
    let mount = || {
        let out = Command::new(BIN)
            .arg(&src)
            .arg(&mnt)
            .arg("--cache-dir")
            .arg(&cache)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    mount();
    assert_eq!(fs::read(mnt.join("f")).unwrap(), b"remote bytes");
    Command::new("umount").arg(&mnt).status().unwrap();
    let rec =
        hoardfs::cache::CacheRecord::decode(&fs::read(cache.join("meta/f")).unwrap()).unwrap();
    assert_eq!(rec.identity.ino, 0, "inode number left out of the identity");
    assert_eq!(rec.identity.size, 12);
    mount();
    assert_eq!(fs::read(mnt.join("f")).unwrap(), b"remote bytes");
    let s = hoardfs::control::request_stats(&mnt).unwrap();
    Command::new("umount").arg(&mnt).status().unwrap();
    assert_eq!(s.cache.stale_invalidations, 0, "{s:?}");
    assert_eq!(s.cache.bytes_from_source, 0);
}

/// A failure after the mount was made (here: the control socket cannot be bound) takes the
/// mount down again instead of leaving a dead one behind.
#[test]
fn a_failed_start_leaves_nothing_mounted() {
    let d = tempfile::tempdir().unwrap();
    let base = fs::canonicalize(d.path()).unwrap();
    let (src, mnt) = (base.join("src"), base.join("mnt"));
    fs::create_dir(&src).unwrap();
    fs::create_dir(&mnt).unwrap();
    let sock = hoardfs::control::socket_path(&mnt);
    fs::create_dir_all(&sock).unwrap();
    struct RemoveDir(std::path::PathBuf);
    impl Drop for RemoveDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir(&self.0);
        }
    }
    let _cleanup = RemoveDir(sock.clone());
    let out = Command::new(BIN)
        .arg(&src)
        .arg(&mnt)
        .arg("--cache-dir")
        .arg(base.join("cache"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot bind"), "{err}");
    assert!(!common::is_mounted(&mnt), "a dead mount was left behind");
}

/// Requests answered with an error are counted by type and errno, in `hoardfs stats` (its
/// table too) and in the snapshot the metrics endpoint encodes.
#[test]
fn failed_requests_are_counted_by_type_and_errno() {
    let t = TestMount::new(&[]);
    fs::create_dir(t.s("d")).unwrap();
    fs::write(t.s("d/f"), b"x").unwrap();
    for _ in 0..2 {
        let e = fs::remove_dir(t.m("d")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOTEMPTY));
    }
    let path = CString::new(t.m("d/f").as_os_str().as_encoded_bytes()).unwrap();
    let name = CString::new("user.absent").unwrap();
    let r = unsafe { libc::getxattr(path.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) };
    assert_eq!(r, -1);
    let s = t.stats();
    assert_eq!(s.errors["rmdir"]["ENOTEMPTY"], 2, "{:?}", s.errors);
    assert_eq!(s.errors["getxattr"]["ENODATA"], 1, "{:?}", s.errors);
    assert!(!s.errors.contains_key("read"), "{:?}", s.errors);
    let out = Command::new(BIN).arg("stats").arg(&t.mnt).output().unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table
            .lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["rmdir", "ENOTEMPTY", "2"]),
        "{table}"
    );
}

/// An ioctl, which hoardfs passes on to no source (here a terminal's `TCGETS`, which
/// Python's `open()` asks of every file it opens), answers `ENOTTY` as a regular file does,
/// is counted, and logs no warning (fuser's default logged one for each).
#[test]
fn an_ioctl_answers_enotty_quietly_and_is_counted() {
    let m = TestMount::new(&[]);
    fs::write(m.s("f"), b"bytes").unwrap();
    let f = fs::File::open(m.m("f")).unwrap();
    let asked = |m: &TestMount| m.stats().requests.get("ioctl").copied().unwrap_or(0);
    let before = asked(&m);
    for _ in 0..3 {
        let mut tty = std::mem::MaybeUninit::<libc::termios>::uninit();
        // SAFETY: TCGETS writes at most one termios into `tty`.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::TCGETS, tty.as_mut_ptr()) };
        let e = std::io::Error::last_os_error();
        assert_eq!((r, e.raw_os_error()), (-1, Some(libc::ENOTTY)), "{e}");
    }
    assert_eq!(
        asked(&m) - before,
        3,
        "each ioctl reaches the daemon and is counted"
    );
    assert_eq!(m.stats().errors["ioctl"]["ENOTTY"], 3);
    let warnings = common::log_warnings(&m.log);
    assert!(warnings.is_empty(), "{warnings:?}");
}

/// `copy_file_range` and `poll`, which hoardfs does not implement, answer `ENOSYS` without
/// a warning (fuser's default logged one): the kernel then copies through reads and writes
/// and takes a file as always ready, and asks no more, so each reaches the daemon once a
/// mount, counted.
#[test]
fn copy_file_range_and_poll_fall_back_quietly_and_once() {
    let m = TestMount::new(&[]);
    let bytes = pattern(300_000, 7);
    fs::write(m.s("f"), &bytes).unwrap();
    for copy in ["g", "h"] {
        let ok = Command::new("cp")
            .arg(m.m("f"))
            .arg(m.m(copy))
            .status()
            .unwrap();
        assert!(ok.success());
        assert!(fs::read(m.m(copy)).unwrap() == bytes, "{copy}");
    }
    let f = fs::File::open(m.m("f")).unwrap();
    for _ in 0..2 {
        let mut p = libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN | libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one pollfd, no wait.
        assert_eq!(unsafe { libc::poll(&mut p, 1, 0) }, 1);
        assert_eq!(p.revents, libc::POLLIN | libc::POLLOUT);
    }
    let s = m.stats();
    assert_eq!(s.requests["copy_file_range"], 1, "{:?}", s.requests);
    assert_eq!(s.requests["poll"], 1, "{:?}", s.requests);
    let warnings = common::log_warnings(&m.log);
    assert!(warnings.is_empty(), "{warnings:?}");
}

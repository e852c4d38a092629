//! Threads with owners (issue 19): the daemon exits promptly after an unmount under load,
//! and blocking lock waits share a bounded pool of threads.

mod common;

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use common::{TestMount, pattern, wait_until};

/// What issue 19 allows between an unmount and the daemon's exit.
const EXIT_WITHIN: Duration = Duration::from_secs(2);

/// An OFD lock command on the whole of `f` (OFD locks: threads of one process conflict).
fn ofd_lock(f: &File, cmd: i32, typ: i32) -> std::io::Result<()> {
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = typ as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    if unsafe { libc::fcntl(f.as_raw_fd(), cmd, &mut fl) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn open_rw(p: &Path) -> File {
    OpenOptions::new().read(true).write(true).open(p).unwrap()
}

/// Threads of process `pid` now.
fn tasks(pid: u32) -> usize {
    fs::read_dir(format!("/proc/{pid}/task")).unwrap().count()
}

fn setlk_requests(m: &TestMount) -> u64 {
    m.stats().requests.get("setlk").copied().unwrap_or(0)
}

/// Waits for `child` to exit; how long that took, or `None` past `limit`.
fn exit_within(child: &mut Child, limit: Duration) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < limit {
        if child.try_wait().unwrap().is_some() {
            return Some(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

#[test]
fn many_blocked_lock_waiters_share_a_bounded_pool_and_all_get_the_lock() {
    const WAITERS: usize = 200;
    let m = TestMount::new(&[]);
    fs::write(m.s("lockme"), b"x").unwrap();
    let path = m.m("lockme");
    let holder = open_rw(&path);
    ofd_lock(&holder, libc::F_OFD_SETLK, libc::F_WRLCK).unwrap();
    let (pid, threads_before, asked_before) = (m.pid(), tasks(m.pid()), setlk_requests(&m));

    let inside = Arc::new(AtomicBool::new(false));
    let got = Arc::new(AtomicUsize::new(0));
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| {
            let (path, inside, got) = (path.clone(), inside.clone(), got.clone());
            std::thread::spawn(move || {
                let f = open_rw(&path);
                ofd_lock(&f, libc::F_OFD_SETLKW, libc::F_WRLCK).unwrap();
                assert!(!inside.swap(true, SeqCst), "two holders of a write lock");
                got.fetch_add(1, SeqCst);
                inside.store(false, SeqCst);
                ofd_lock(&f, libc::F_OFD_SETLK, libc::F_UNLCK).unwrap();
            })
        })
        .collect();
    wait_until(
        Duration::from_secs(60),
        "every blocking lock request reached the daemon",
        || setlk_requests(&m) >= asked_before + WAITERS as u64,
    );
    let threads_waiting = tasks(pid);
    assert_eq!(got.load(SeqCst), 0, "a waiter got a held lock");
    assert!(
        threads_waiting <= threads_before + 16,
        "{WAITERS} blocked lock waiters took the daemon from {threads_before} to \
         {threads_waiting} threads"
    );

    ofd_lock(&holder, libc::F_OFD_SETLK, libc::F_UNLCK).unwrap();
    wait_until(
        Duration::from_secs(60),
        "every waiter got the lock in turn",
        || got.load(SeqCst) == WAITERS,
    );
    for w in waiters {
        w.join().unwrap();
    }
    assert!(tasks(pid) <= threads_before + 16);
}

#[test]
fn a_killed_lock_waiter_ends_while_the_lock_is_still_held() {
    let m = TestMount::new(&[]);
    fs::write(m.s("lockme"), b"x").unwrap();
    let path = m.m("lockme");
    let holder = open_rw(&path);
    assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX) }, 0);
    let asked = setlk_requests(&m);
    let mut waiter = Command::new("flock")
        .arg(&path)
        .arg("true")
        .spawn()
        .unwrap();
    wait_until(
        Duration::from_secs(10),
        "the flock waiter's request reached the daemon",
        || setlk_requests(&m) > asked,
    );
    // Without an answer the killed process stays in the kernel (D state) until the lock is
    // free; the pool must notice the kill.
    waiter.kill().unwrap();
    assert!(
        exit_within(&mut waiter, EXIT_WITHIN).is_some(),
        "a lock waiter killed with SIGKILL did not end while the lock was held"
    );
    assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_UN) }, 0);
    let again = Command::new("flock")
        .args(["-n".as_ref(), path.as_os_str(), "true".as_ref()])
        .status()
        .unwrap();
    assert!(
        again.success(),
        "the lock is free after its holder released it"
    );
}

/// Reads and writes `files` small files in turn through the mount until `stop` or an error
/// (the mount gone); returns how many rounds it made.
fn churn(
    dir: PathBuf,
    n: usize,
    files: usize,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut rounds = 0;
        while !stop.load(SeqCst) {
            let p = dir.join(format!("churn-{n}-{}", rounds % files));
            if fs::write(&p, pattern(64 << 10, rounds as u64)).is_err() {
                break;
            }
            if fs::read(&p).is_err() {
                break;
            }
            rounds += 1;
        }
        rounds
    })
}

/// A source with small files and a big one (sparse in the source, filled in the cache).
fn big_source(m: &TestMount) {
    for i in 0..8 {
        fs::write(m.s(&format!("small-{i}")), pattern(256 << 10, i)).unwrap();
    }
    File::create(m.s("big"))
        .unwrap()
        .set_len(512 << 20)
        .unwrap();
}

#[test]
fn the_daemon_exits_promptly_after_an_unmount_with_fetches_and_commits_pending() {
    let mut m = TestMount::new(&[]);
    big_source(&m);
    // Many files closed with writes just before the unmount: much for the group commit.
    let stop = Arc::new(AtomicBool::new(false));
    let churners: Vec<_> = (0..4)
        .map(|n| churn(m.mnt.clone(), n, 200, stop.clone()))
        .collect();
    // A sequential reader starts prefetching the big file; it closes early, the workers
    // go on fetching ahead.
    let mut f = File::open(m.m("big")).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..16 {
        std::io::Read::read_exact(&mut f, &mut buf).unwrap();
    }
    drop(f);
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, SeqCst);
    for c in churners {
        assert!(c.join().unwrap() > 0, "the load did nothing");
    }
    assert!(common::umount(&m.mnt), "umount failed");
    let unmounted = Instant::now();
    let mut daemon = m.take_daemon();
    let took = exit_within(&mut daemon, Duration::from_secs(20));
    let took = took.map(|_| unmounted.elapsed());
    eprintln!("daemon exited {took:?} after the unmount");
    assert!(
        took.is_some_and(|t| t <= EXIT_WITHIN),
        "the daemon took {took:?} (> {EXIT_WITHIN:?}) to exit after its unmount; log:\n{}",
        m.daemon_log()
    );
}

#[test]
fn the_daemon_exits_promptly_after_a_forced_unmount_under_load() {
    let mut m = TestMount::new(&[]);
    // Requests cut off by the abort may be logged as failures.
    m.expect_warnings();
    big_source(&m);
    fs::write(m.s("lockme"), b"x").unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let churners: Vec<_> = (0..4)
        .map(|n| churn(m.mnt.clone(), n, 8, stop.clone()))
        .collect();
    // A fetch in progress: a reader of the big file, reading until the mount goes.
    let big = m.m("big");
    let reader = std::thread::spawn(move || {
        let mut f = File::open(big).unwrap();
        let mut buf = vec![0u8; 1 << 20];
        while std::io::Read::read(&mut f, &mut buf).is_ok_and(|n| n > 0) {}
    });
    // A blocked lock waiter.
    let holder = open_rw(&m.m("lockme"));
    ofd_lock(&holder, libc::F_OFD_SETLK, libc::F_WRLCK).unwrap();
    let asked = setlk_requests(&m);
    let lock_path = m.m("lockme");
    let waiter = std::thread::spawn(move || {
        let f = open_rw(&lock_path);
        ofd_lock(&f, libc::F_OFD_SETLKW, libc::F_WRLCK)
    });
    wait_until(
        Duration::from_secs(10),
        "the blocking lock request reached the daemon",
        || setlk_requests(&m) > asked,
    );
    std::thread::sleep(Duration::from_millis(200));

    // Busy: a plain umount fails; force (abort the FUSE connection) and detach, as an
    // administrator does with a busy mount.
    let mnt = std::ffi::CString::new(m.mnt.as_os_str().as_encoded_bytes()).unwrap();
    let r = unsafe { libc::umount2(mnt.as_ptr(), libc::MNT_FORCE | libc::MNT_DETACH) };
    assert_eq!(r, 0, "umount2: {}", std::io::Error::last_os_error());
    let unmounted = Instant::now();
    let mut daemon = m.take_daemon();
    let took = exit_within(&mut daemon, Duration::from_secs(20)).map(|_| unmounted.elapsed());
    eprintln!("daemon exited {took:?} after the forced unmount");
    stop.store(true, SeqCst);
    assert!(
        took.is_some_and(|t| t <= EXIT_WITHIN),
        "the daemon took {took:?} (> {EXIT_WITHIN:?}) to exit after a forced unmount; \
         log:\n{}",
        m.daemon_log()
    );
    assert!(
        waiter.join().unwrap().is_err(),
        "the lock waiter's wait ended with the mount, without the lock"
    );
    reader.join().unwrap();
    for c in churners {
        c.join().unwrap();
    }
    drop(holder);
}

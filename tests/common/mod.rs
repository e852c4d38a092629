//! Test harness: real FUSE mounts of the real binary over temporary directories.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hoardfs::stats::Snapshot;

pub const BIN: &str = env!("CARGO_BIN_EXE_hoardfs");

/// A source, a cache and a mount point, and the daemon serving them (in the foreground,
/// so that the test owns the process and sees how it exits).
pub struct TestMount {
    pub dirs: tempfile::TempDir,
    pub src: PathBuf,
    pub cache: PathBuf,
    pub mnt: PathBuf,
    pub extra_args: Vec<String>,
    /// Environment variables for the daemon (failpoints).
    pub env: Vec<(String, String)>,
    child: Option<Child>,
}

/// The fusectl connection number (the device minor) of the FUSE mount at `mnt`, read from
/// mountinfo (a stat of a mount whose daemon is dead would hang).
pub fn fuse_connection(mnt: &Path) -> Option<u32> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = mnt.to_str()?;
    info.lines().find_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.len() > 4 && f[4] == want && l.contains(" - fuse"))
            .then(|| f[2].split(':').nth(1)?.parse().ok())
            .flatten()
    })
}

pub fn is_mounted(mnt: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let want = mnt.to_str().unwrap();
    info.lines().any(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        f.len() > 4 && f[4] == want && l.contains(" - fuse.hoardfs ")
    })
}

impl TestMount {
    pub fn new(args: &[&str]) -> TestMount {
        TestMount::new_at("mnt", args)
    }

    /// Like `new`, with the mount point at `mnt_rel` under the test's base directory
    /// (e.g. deeper than the source, so that relative symlinks in the source resolve
    /// elsewhere from the mount than from the source).
    pub fn new_at(mnt_rel: &str, args: &[&str]) -> TestMount {
        let mut m = TestMount::unmounted_at(mnt_rel, args);
        m.mount();
        m
    }

    /// The directories of a `TestMount`, not yet mounted (call `mount`).
    pub fn unmounted_at(mnt_rel: &str, args: &[&str]) -> TestMount {
        let dirs = tempfile::Builder::new()
            .prefix("hoardfs-test")
            .tempdir()
            .unwrap();
        let base = std::fs::canonicalize(dirs.path()).unwrap();
        let (src, cache, mnt) = (base.join("src"), base.join("cache"), base.join(mnt_rel));
        for d in [&src, &mnt] {
            std::fs::create_dir_all(d).unwrap();
        }
        TestMount {
            dirs,
            src,
            cache,
            mnt,
            extra_args: args.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            child: None,
        }
    }

    /// The test's base directory (holds src, cache and the mount point).
    pub fn base(&self) -> PathBuf {
        self.src.parent().unwrap().to_path_buf()
    }

    /// Another mount of this mount's source with its own cache and mount point, as a
    /// second machine sharing the source would have.
    pub fn another(&self, args: &[&str]) -> TestMount {
        let dirs = tempfile::Builder::new()
            .prefix("hoardfs-test")
            .tempdir()
            .unwrap();
        let base = std::fs::canonicalize(dirs.path()).unwrap();
        let (cache, mnt) = (base.join("cache"), base.join("mnt"));
        std::fs::create_dir(&mnt).unwrap();
        let mut m = TestMount {
            dirs,
            src: self.src.clone(),
            cache,
            mnt,
            extra_args: args.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            child: None,
        };
        m.mount();
        m
    }

    pub fn mount(&mut self) {
        assert!(self.child.is_none(), "already mounted");
        let child = Command::new(BIN)
            .arg(&self.src)
            .arg(&self.mnt)
            .arg("--cache-dir")
            .arg(&self.cache)
            .arg("-f")
            // The default floor is 5 % of the file system holding the tests' caches; on a
            // nearly full test machine that would stop all caching. A test's own
            // `--min-free` (a flag wins over `-o`) or `-o min_free` (later) wins.
            .args(["-o", "min_free=64M"])
            .args(&self.extra_args)
            .env(
                "HOARDFS_LOG",
                std::env::var("HOARDFS_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn hoardfs");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !is_mounted(&self.mnt) {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("hoardfs exited before mounting: {status}");
            }
            assert!(Instant::now() < deadline, "mount did not appear");
            std::thread::sleep(Duration::from_millis(10));
        }
        // The control socket comes up right after the mount.
        let deadline = Instant::now() + Duration::from_secs(10);
        while hoardfs::control::request_stats(&self.mnt).is_err() {
            assert!(Instant::now() < deadline, "control socket did not appear");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Unmounts as a user would and checks that the daemon exits cleanly.
    pub fn unmount(&mut self) {
        assert!(umount(&self.mnt), "umount failed");
        self.wait_exit(true);
    }

    pub fn wait_exit(&mut self, expect_success: bool) {
        let mut child = self.child.take().expect("not mounted");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                if expect_success {
                    assert!(status.success(), "daemon exited with {status}");
                }
                return;
            }
            assert!(
                Instant::now() < deadline,
                "daemon did not exit after unmount"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL the daemon (a crash), then clear the dead mount.
    pub fn crash(&mut self) {
        let conn = fuse_connection(&self.mnt);
        let mut child = self.child.take().expect("not mounted");
        child.kill().unwrap();
        // A killed daemon whose notification is stuck behind a directory lock held by a
        // request it will never answer cannot finish dying (the kernel keeps the FUSE
        // connection while the thread is in there): abort the connection, as an
        // administrator would (fusectl).
        let deadline = Instant::now() + Duration::from_secs(1);
        while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if child.try_wait().unwrap().is_none()
            && let Some(conn) = conn
        {
            let abort = format!("/sys/fs/fuse/connections/{conn}/abort");
            if !Path::new(&abort).exists() {
                let _ = Command::new("mount")
                    .args(["-t", "fusectl", "fusectl", "/sys/fs/fuse/connections"])
                    .status();
            }
            let _ = std::fs::write(abort, "1");
        }
        child.wait().unwrap();
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        while is_mounted(&self.mnt) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL the daemon and leave everything as the kill left it: no abort of the FUSE
    /// connection, no unmount, no wait (a daemon killed while stuck in the kernel cannot
    /// finish dying until its connection is aborted). The next `mount` must recover by
    /// itself; the caller reaps the returned process after that.
    pub fn kill_only(&mut self) -> Child {
        let mut child = self.child.take().expect("not mounted");
        child.kill().unwrap();
        child
    }

    /// Takes the daemon's process out of this mount's care: the caller ends it.
    pub fn take_daemon(&mut self) -> Child {
        self.child.take().expect("not mounted")
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    pub fn remount(&mut self) {
        self.unmount();
        self.mount();
    }

    pub fn stats(&self) -> Snapshot {
        hoardfs::control::request_stats(&self.mnt).expect("stats")
    }

    pub fn m(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    pub fn s(&self, rel: &str) -> PathBuf {
        self.src.join(rel)
    }

    pub fn c(&self, rel: &str) -> PathBuf {
        self.cache.join("data").join(rel)
    }
}

/// `umount MNT`, tried for a second: another test's fork may hold a copy of a descriptor
/// on the mount for the instant before its exec closes it (EBUSY), which is not a leak of
/// the mount's own test.
pub fn umount(mnt: &Path) -> bool {
    for _ in 0..20 {
        let ok = Command::new("umount")
            .arg(mnt)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// A test that ends with its mount still in use (a file left open in it, a process inside
/// it) or whose daemon does not exit after the unmount fails: the mount is taken down
/// anyway (kill, lazy unmount), so that nothing is left behind either way.
impl Drop for TestMount {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let unmounted = umount(&self.mnt);
        // Generous: after a long stress run on a loaded machine a daemon has taken more
        // than 5 s to exit (issue 19 asks for 2 s; not met yet).
        let deadline = Instant::now() + Duration::from_secs(20);
        while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let exited = child.try_wait().ok().flatten().is_some();
        let _ = child.kill();
        let _ = child.wait();
        if is_mounted(&self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
        if !std::thread::panicking() {
            assert!(
                unmounted,
                "{} was still in use at the end of the test (umount failed)",
                self.mnt.display()
            );
            assert!(
                exited,
                "the daemon of {} did not exit within 20 s of its unmount",
                self.mnt.display()
            );
        }
    }
}

/// Polls `cond` every 10 ms until it holds and returns how long that took; fails the test
/// with `what` once `limit` has passed. The one polling loop of the tests.
pub fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < limit, "not within {limit:?}: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
    t.elapsed()
}

/// `wait_until` for a value: polls `get` until `ok` holds for what it returns, and returns
/// that; the failure shows the last value.
pub fn wait_for_value<T: std::fmt::Debug>(
    limit: Duration,
    what: &str,
    mut get: impl FnMut() -> T,
    ok: impl Fn(&T) -> bool,
) -> T {
    let t = Instant::now();
    loop {
        let v = get();
        if ok(&v) {
            return v;
        }
        assert!(t.elapsed() < limit, "not within {limit:?}: {what}: {v:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Deterministic pseudo-random bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

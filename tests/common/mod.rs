//! Test harness: real FUSE mounts of the real binary over temporary directories.
//!
//! What every `TestMount` does besides mounting (issue 24):
//! - it waits for the daemon's own word that the mount answers (`READY=1` on a
//!   `NOTIFY_SOCKET` in the test's directory, systemd's protocol) instead of polling;
//! - a watchdog (`watchdog.rs`) fails the whole test binary, taking every mount down, when
//!   a mount is still up `HOARDFS_TEST_TIMEOUT` seconds (default 300) after it was mounted;
//! - the daemon's stdout and stderr (its log: `HOARDFS_LOG`, `warn` unless set) go to
//!   `daemon.log` in the test's directory, printed when the test fails; with
//!   `HOARDFS_TEST_FATAL_WARNINGS=1`, a WARN or ERROR line in it fails the test unless the
//!   test called `expect_warnings`;
//! - at the end, the daemon must hold no descriptor of a regular file under the source or
//!   the cache's `data/` once the test has closed its files (checked before the unmount;
//!   `expect_open_files` for a test that ends with files open on purpose).
#![allow(dead_code)]

mod watchdog;

use std::io::Write;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hoardfs::stats::Snapshot;

pub const BIN: &str = env!("CARGO_BIN_EXE_hoardfs");

/// How long a mount may take to say `READY=1`.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// The threads of every other hoardfs process, and of any process with a thread in
/// uninterruptible sleep (who may hold what the stuck daemon waits for).
fn other_stacks(pid: u32) -> String {
    let mut out = String::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        let Some(other) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if other == pid {
            continue;
        }
        let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
        let stuck = std::fs::read_dir(p.path().join("task")).is_ok_and(|ts| {
            ts.flatten().any(|t| {
                let stat = std::fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                stat.rsplit(") ").next().is_some_and(|r| r.starts_with('D'))
            })
        });
        if comm.trim() == "hoardfs" || stuck {
            out += &format!(
                "== process {other} ({})\n{}",
                comm.trim(),
                thread_stacks(other)
            );
        }
    }
    out
}

/// Each thread of process `pid`: its name, state, wait channel and kernel stack (root
/// reads the stack), to tell where a daemon that does not start is stuck.
fn thread_stacks(pid: u32) -> String {
    let mut out = String::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return format!("(no /proc/{pid})");
    };
    for t in tasks.flatten() {
        let p = t.path();
        let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        let stat = read("stat");
        let state = stat.rsplit(") ").next().and_then(|r| r.split(' ').next());
        out += &format!(
            "-- task {} ({}) state {} wchan {}\n{}",
            t.file_name().to_string_lossy(),
            read("comm").trim(),
            state.unwrap_or("?"),
            read("wchan"),
            read("stack")
        );
    }
    out
}

/// How long after the test's last close the daemon may still hold descriptors of the
/// closed files (FUSE releases are asynchronous; a fetch in flight finishes first).
const RELEASE_WITHIN: Duration = Duration::from_secs(2);

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
    /// The daemon's open-files limit, soft and hard alike (`RLIMIT_NOFILE`); the test's own
    /// if `None`.
    pub open_files_limit: Option<u64>,
    /// The daemon's stdout and stderr, every mount of this `TestMount` appended.
    pub log: PathBuf,
    child: Option<Child>,
    notify: Option<Notify>,
    /// This mount's entry in the watchdog.
    watch: u64,
    mounts: u32,
    warnings_expected: AtomicBool,
    open_files_expected: AtomicBool,
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

/// Aborts the FUSE connection of the mount at `mnt` through fusectl, as an administrator
/// would (mounting fusectl first if it is not): every request waiting on it fails with
/// ENOTCONN. Returns the connection aborted, if there was one.
pub fn abort_connection(mnt: &Path) -> Option<u32> {
    let conn = fuse_connection(mnt)?;
    let abort = format!("/sys/fs/fuse/connections/{conn}/abort");
    if !Path::new(&abort).exists() {
        let _ = Command::new("mount")
            .args(["-t", "fusectl", "fusectl", "/sys/fs/fuse/connections"])
            .stderr(Stdio::null())
            .status();
    }
    std::fs::write(abort, "1").ok().map(|_| conn)
}

pub fn is_mounted(mnt: &Path) -> bool {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let want = mnt.to_str().unwrap();
    info.lines().any(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        f.len() > 4 && f[4] == want && l.contains(" - fuse.hoardfs ")
    })
}

/// The end of a daemon log (all of it up to 64 KiB), for failure messages.
pub fn log_excerpt(log: &Path) -> String {
    const MAX: usize = 64 << 10;
    let Ok(bytes) = std::fs::read(log) else {
        return String::new();
    };
    let text = String::from_utf8_lossy(&bytes);
    if text.len() <= MAX {
        return text.into_owned();
    }
    let mut cut = text.len() - MAX;
    while !text.is_char_boundary(cut) {
        cut += 1;
    }
    format!("[... {cut} bytes left out ...]\n{}", &text[cut..])
}

/// The WARN and ERROR entries of a daemon log (`tracing`'s format: a timestamp, then the
/// level; the lines up to the next timestamp belong to the entry).
pub fn log_warnings(log: &Path) -> Vec<String> {
    let text = String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default()).into_owned();
    let mut found: Vec<String> = Vec::new();
    let mut in_warning = false;
    for l in text.lines() {
        let mut words = l.split_whitespace();
        let stamped = words
            .next()
            .is_some_and(|w| w.len() > 20 && w.ends_with('Z') && w.as_bytes()[4] == b'-');
        if stamped || l.starts_with("=== hoardfs test harness") {
            in_warning = stamped && matches!(words.next(), Some("WARN" | "ERROR"));
            if in_warning {
                found.push(l.to_string());
            }
        } else if in_warning && let Some(last) = found.last_mut() {
            last.push_str("\n    ");
            last.push_str(l);
        }
    }
    found
}

fn fatal_warnings() -> bool {
    std::env::var("HOARDFS_TEST_FATAL_WARNINGS").is_ok_and(|v| v == "1")
}

/// The receiving end of a mount's `NOTIFY_SOCKET`: a thread reads every notification (a
/// daemon blocks on a full socket: STATUS= comes every 10 s) and hands it over here.
struct Notify {
    /// What `NOTIFY_SOCKET` says: the socket's path, or `@name` (abstract) if the path is
    /// too long for a socket address.
    address: String,
    sock: UnixDatagram,
    /// In a mutex: a `TestMount` is shared between threads (`Sync`).
    rx: std::sync::Mutex<mpsc::Receiver<String>>,
    stop: Arc<AtomicBool>,
}

impl Notify {
    fn bind(path: &Path) -> Notify {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let _ = std::fs::remove_file(path);
        let (sock, address) = match UnixDatagram::bind(path) {
            Ok(s) => (s, path.display().to_string()),
            Err(_) => {
                use std::os::linux::net::SocketAddrExt;
                let id = NEXT.fetch_add(1, Ordering::Relaxed);
                let name = format!("hoardfs-test-{}-{id}", std::process::id());
                let addr =
                    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
                let s = UnixDatagram::bind_addr(&addr).expect("bind a notify socket");
                (s, format!("@{name}"))
            }
        };
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let (recv, stopped) = (sock.try_clone().unwrap(), stop.clone());
        recv.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        std::thread::Builder::new()
            .name("hoardfs-test-notify".into())
            .spawn(move || {
                let mut buf = vec![0u8; 4096];
                while !stopped.load(Ordering::Relaxed) {
                    match recv.recv(&mut buf) {
                        // Shut down (`Drop`).
                        Ok(0) => return,
                        Ok(n) => {
                            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                            if tx.send(msg).is_err() {
                                return;
                            }
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) => {}
                        Err(_) => return,
                    }
                }
            })
            .unwrap();
        Notify {
            address,
            sock,
            rx: std::sync::Mutex::new(rx),
            stop,
        }
    }
}

impl Drop for Notify {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
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
        let (src, mnt) = (base.join("src"), base.join(mnt_rel));
        for d in [&src, &mnt] {
            std::fs::create_dir_all(d).unwrap();
        }
        TestMount::with(dirs, src, mnt, args)
    }

    /// A `TestMount` of `src` whose cache, log and notify socket are in `dirs`.
    fn with(dirs: tempfile::TempDir, src: PathBuf, mnt: PathBuf, args: &[&str]) -> TestMount {
        let home = std::fs::canonicalize(dirs.path()).unwrap();
        let log = home.join("daemon.log");
        TestMount {
            cache: home.join("cache"),
            watch: watchdog::register(&mnt, &log),
            dirs,
            src,
            mnt,
            log,
            extra_args: args.iter().map(|s| s.to_string()).collect(),
            env: Vec::new(),
            open_files_limit: None,
            child: None,
            notify: None,
            mounts: 0,
            warnings_expected: AtomicBool::new(false),
            open_files_expected: AtomicBool::new(false),
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
        let mnt = std::fs::canonicalize(dirs.path()).unwrap().join("mnt");
        std::fs::create_dir(&mnt).unwrap();
        let mut m = TestMount::with(dirs, self.src.clone(), mnt, args);
        m.mount();
        m
    }

    /// This test makes its daemon log warnings or errors on purpose (faults, damage, bad
    /// input): they do not fail it under `HOARDFS_TEST_FATAL_WARNINGS=1`.
    pub fn expect_warnings(&self) {
        self.warnings_expected.store(true, Ordering::Relaxed);
    }

    /// This test ends with files open in its daemon on purpose: no descriptor check at
    /// the end.
    pub fn expect_open_files(&self) {
        self.open_files_expected.store(true, Ordering::Relaxed);
    }

    /// This test runs `more` longer than the usual timeout (`HOARDFS_TEST_TIMEOUT`) by
    /// request (`HOARDFS_HUNT_SECS` and the like).
    pub fn allow_time(&self, more: Duration) {
        watchdog::allow(self.watch, more);
    }

    /// The daemon's log so far (every mount of this `TestMount`).
    pub fn daemon_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn mount(&mut self) {
        assert!(self.child.is_none(), "already mounted");
        let sock_path = self.log.with_file_name("notify.sock");
        let notify = self.notify.get_or_insert_with(|| Notify::bind(&sock_path));
        // Whatever an earlier daemon said (its STOPPING=1) is not this one's word.
        let rx = notify.rx.get_mut().unwrap();
        while rx.try_recv().is_ok() {}
        let address = notify.address.clone();
        self.mounts += 1;
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        writeln!(
            log,
            "=== hoardfs test harness: mount {} of {} ===",
            self.mounts,
            self.mnt.display()
        )
        .unwrap();
        let mut command = Command::new(BIN);
        if let Some(n) = self.open_files_limit {
            use std::os::unix::process::CommandExt;
            let limit = libc::rlimit {
                rlim_cur: n,
                rlim_max: n,
            };
            // SAFETY: setrlimit is async-signal-safe, and `limit` is a plain copy.
            unsafe {
                command.pre_exec(move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = command
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
            .env("NOTIFY_SOCKET", &address)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawn hoardfs");
        watchdog::mounted(self.watch, child.id());
        self.child = Some(child);
        // The daemon says READY=1 once the mount and its control socket answer.
        let t0 = Instant::now();
        loop {
            let said = self.notify.as_mut().unwrap().rx.get_mut().unwrap();
            match said.recv_timeout(Duration::from_millis(20)) {
                Ok(msg) if msg.lines().any(|l| l == "READY=1") => break,
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the notify socket failed"),
            }
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.forget_child();
                panic!("hoardfs exited before it was ready: {status}");
            }
            if t0.elapsed() >= READY_WITHIN {
                let pid = self.child.as_ref().unwrap().id();
                panic!(
                    "hoardfs did not say READY=1 within {READY_WITHIN:?}; where its threads \
                     wait:\n{}\nother hoardfs processes and tasks in D state:\n{}",
                    thread_stacks(pid),
                    other_stacks(pid)
                );
            }
        }
        assert!(is_mounted(&self.mnt), "READY=1 before the mount exists");
        if let Err(e) = hoardfs::control::request_stats(&self.mnt) {
            panic!("READY=1 before the control socket answers: {e:#}");
        }
    }

    /// The daemon is no longer this mount's to reap.
    fn forget_child(&mut self) -> Option<Child> {
        watchdog::set_pid(self.watch, None);
        self.child.take()
    }

    /// Unmounts as a user would and checks that the daemon exits cleanly.
    pub fn unmount(&mut self) {
        assert!(umount(&self.mnt), "umount failed");
        self.wait_exit(true);
    }

    pub fn wait_exit(&mut self, expect_success: bool) {
        let mut child = self.forget_child().expect("not mounted");
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
        let mut child = self.forget_child().expect("not mounted");
        child.kill().unwrap();
        // A killed daemon whose notification is stuck behind a directory lock held by a
        // request it will never answer cannot finish dying (the kernel keeps the FUSE
        // connection while the thread is in there): abort the connection, as an
        // administrator would (fusectl).
        let deadline = Instant::now() + Duration::from_secs(1);
        while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if child.try_wait().unwrap().is_none() {
            abort_connection(&self.mnt);
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
        let mut child = self.forget_child().expect("not mounted");
        child.kill().unwrap();
        child
    }

    /// Takes the daemon's process out of this mount's care: the caller ends it.
    pub fn take_daemon(&mut self) -> Child {
        self.forget_child().expect("not mounted")
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

    /// The regular files under the source or the cache's `data/` that the daemon holds
    /// open now (`fd N -> path`). Not its directories (the watcher's, open listings), nor
    /// the cache's records, listings, log or lock, which it keeps by design.
    pub fn daemon_files(&self) -> Vec<String> {
        let Some(pid) = self.child.as_ref().map(Child::id) else {
            return Vec::new();
        };
        let data = self.cache.join("data");
        let mut roots = vec![data.as_path()];
        // An object-store source (`s3://...`) has no files here.
        if self.src.is_absolute() {
            roots.push(&self.src);
        }
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            return Vec::new();
        };
        let (mut open, mut covered) = (Vec::new(), Vec::new());
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let shown = target.to_string_lossy();
            let path = Path::new(shown.strip_suffix(" (deleted)").unwrap_or(&shown));
            let o_path = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_string_lossy()
            ))
            .ok()
            .and_then(|info| {
                let flags = info.lines().find_map(|l| l.strip_prefix("flags:"))?;
                u32::from_str_radix(flags.trim(), 8).ok()
            })
            .is_some_and(|flags| flags & libc::O_PATH as u32 != 0);
            if roots.iter().any(|r| path.starts_with(r))
                && std::fs::metadata(fd.path()).is_ok_and(|m| m.is_file())
            {
                let shown = format!("fd {} -> {shown}", fd.file_name().to_string_lossy());
                if o_path && path.starts_with(&self.src) {
                    covered.push(shown);
                } else {
                    open.push(shown);
                }
            }
        }
        // Callbacks keep an `O_PATH` descriptor of each source file they cover
        // (`coherence::Callback`: no I/O, no lock, nothing written back on close), one per
        // file watched: only more than that is left open.
        if !covered.is_empty() && covered.len() > self.stats().coherence.watched_files as usize {
            open.append(&mut covered);
        }
        open.sort();
        open
    }

    /// Waits until the daemon has every handle released and holds no descriptor of a
    /// file under the source or the cache's `data/` (after the test closed its files:
    /// releases reach the daemon after close(2) returns).
    pub fn wait_released(&self) {
        wait_for_value(
            Duration::from_secs(10),
            "the daemon to release every file",
            || (self.stats().open_handles, self.daemon_files()),
            |(handles, files)| *handles == 0 && files.is_empty(),
        );
    }

    /// The end-of-test descriptor check: what the daemon still holds `RELEASE_WITHIN`
    /// after the test's last close, if anything.
    fn leaked_files(&self) -> Option<String> {
        let t0 = Instant::now();
        loop {
            let open = self.daemon_files();
            if open.is_empty() {
                return None;
            }
            if t0.elapsed() >= RELEASE_WITHIN {
                let handles = hoardfs::control::request_stats(&self.mnt)
                    .map_or("unknown".to_string(), |s| s.open_handles.to_string());
                return Some(format!(
                    "the daemon of {} still holds {} descriptor(s) of files under its source \
                     or cache data {RELEASE_WITHIN:?} after the test's last close (open \
                     handles: {handles}; a test that ends with files open on purpose calls \
                     expect_open_files):\n  {}",
                    self.mnt.display(),
                    open.len(),
                    open.join("\n  ")
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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
/// it), whose daemon still holds descriptors of closed files, or whose daemon does not exit
/// after the unmount fails: the mount is taken down anyway (kill, lazy unmount), so that
/// nothing is left behind either way. A failing test shows its daemon's log.
impl Drop for TestMount {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        let mut failures = Vec::new();
        if let Some(mut child) = self.child.take() {
            if !panicking
                && !self.open_files_expected.load(Ordering::Relaxed)
                && let Some(leak) = self.leaked_files()
            {
                failures.push(leak);
            }
            let unmounted = umount(&self.mnt);
            // Generous: after a long stress run on a loaded machine a daemon has taken
            // more than 5 s to exit (issue 19 asks for 2 s; not met yet).
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
            if !unmounted {
                failures.push(format!(
                    "{} was still in use at the end of the test (umount failed)",
                    self.mnt.display()
                ));
            }
            if !exited {
                failures.push(format!(
                    "the daemon of {} did not exit within 20 s of its unmount",
                    self.mnt.display()
                ));
            }
        }
        // After the daemon's exit: it says STOPPING=1 as it goes.
        self.notify = None;
        watchdog::disarm(self.watch);
        if fatal_warnings() && !self.warnings_expected.load(Ordering::Relaxed) {
            let warnings = log_warnings(&self.log);
            if !warnings.is_empty() {
                failures.push(format!(
                    "the daemon of {} logged {} warning(s) or error(s) and the test does not \
                     expect any (HOARDFS_TEST_FATAL_WARNINGS=1; expect_warnings if they are \
                     the point):\n  {}",
                    self.mnt.display(),
                    warnings.len(),
                    warnings.join("\n  ")
                ));
            }
        }
        if panicking || !failures.is_empty() {
            let log = log_excerpt(&self.log);
            if log
                .lines()
                .any(|l| !l.starts_with("=== hoardfs test harness"))
            {
                eprintln!(
                    "--- daemon log of {} ({}) ---\n{log}--- end of the daemon log ---",
                    self.mnt.display(),
                    self.log.display()
                );
            }
        }
        if !panicking && !failures.is_empty() {
            panic!("{}", failures.join("\n"));
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
/// Writes `data` at `offset` of the existing file `path`, in place (no truncation).
pub fn write_in_place(path: &Path, offset: u64, data: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, offset).unwrap();
}

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

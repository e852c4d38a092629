//! The per-mount timeout: a hung mount fails its test instead of hanging `cargo test`.
//!
//! Every `TestMount` registers here when it is made, is armed at each of its mounts and
//! leaves at drop. One thread per test process looks at the deadlines; when one passes
//! (`HOARDFS_TEST_TIMEOUT` seconds after the mount, default 300, 0 for never), it says
//! which mount of which test timed out and shows that daemon's log, aborts the mount's FUSE
//! connection through fusectl (so that syscalls stuck in it return), kills its daemon (and
//! removes the control socket it leaves), takes down every other mount still registered in
//! the process the same way (nothing is left mounted), and exits the process with 101, as a
//! failed test binary does.
//!
//! It writes to fd 2 itself, not with `eprintln!`: libtest captures a test's `eprintln!`
//! and prints it only when the test ends, which an exit skips.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

struct Armed {
    /// The test's thread name (libtest names it after the test).
    test: String,
    mnt: PathBuf,
    log: PathBuf,
    /// The daemon while this mount's `TestMount` owns it (unreaped, so the pid is ours).
    pid: Option<u32>,
    mounted_at: Instant,
    deadline: Option<Instant>,
}

static ARMED: Mutex<BTreeMap<u64, Armed>> = Mutex::new(BTreeMap::new());
static NEXT: AtomicU64 = AtomicU64::new(1);
static THREAD: std::sync::Once = std::sync::Once::new();

/// `HOARDFS_TEST_TIMEOUT` (seconds; 0: no timeout), 300 s if unset.
pub fn timeout() -> Option<Duration> {
    match std::env::var("HOARDFS_TEST_TIMEOUT") {
        Ok(v) => {
            let secs: u64 = v.trim().parse().unwrap_or_else(|_| {
                panic!("HOARDFS_TEST_TIMEOUT={v:?} is not a number of seconds")
            });
            (secs > 0).then(|| Duration::from_secs(secs))
        }
        Err(_) => Some(Duration::from_secs(300)),
    }
}

/// Registers a mount (not armed until `mounted`); returns its id.
pub fn register(mnt: &Path, log: &Path) -> u64 {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    let test = std::thread::current()
        .name()
        .unwrap_or("an unnamed thread")
        .to_string();
    ARMED.lock().unwrap().insert(
        id,
        Armed {
            test,
            mnt: mnt.to_path_buf(),
            log: log.to_path_buf(),
            pid: None,
            mounted_at: Instant::now(),
            deadline: None,
        },
    );
    id
}

/// The mount `id` is up with daemon `pid`: its timeout starts now.
pub fn mounted(id: u64, pid: u32) {
    let Some(limit) = timeout() else {
        set_pid(id, Some(pid));
        return;
    };
    THREAD.call_once(|| {
        std::thread::Builder::new()
            .name("hoardfs-test-watchdog".into())
            .spawn(watch)
            .expect("spawn the watchdog");
    });
    if let Some(a) = ARMED.lock().unwrap().get_mut(&id) {
        a.pid = Some(pid);
        a.mounted_at = Instant::now();
        a.deadline = Some(a.mounted_at + limit);
    }
}

/// The daemon of `id` left the `TestMount`'s care (reaped, or handed to the test).
pub fn set_pid(id: u64, pid: Option<u32>) {
    if let Some(a) = ARMED.lock().unwrap().get_mut(&id) {
        a.pid = pid;
    }
}

/// Gives the mount `id` `more` on top of its timeout, from now (tests that run long by
/// request, such as `HOARDFS_HUNT_SECS=600`).
pub fn allow(id: u64, more: Duration) {
    let Some(limit) = timeout() else { return };
    if let Some(a) = ARMED.lock().unwrap().get_mut(&id) {
        let want = Instant::now() + limit + more;
        a.deadline = Some(a.deadline.map_or(want, |d| d.max(want)));
    }
}

pub fn disarm(id: u64) {
    ARMED.lock().unwrap().remove(&id);
}

fn watch() {
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let armed = ARMED.lock().unwrap();
        let now = Instant::now();
        if let Some((&id, _)) = armed
            .iter()
            .find(|(_, a)| a.deadline.is_some_and(|d| d <= now))
        {
            fire(&armed, id);
        }
    }
}

/// Says what timed out, takes every registered mount down and exits (the lock on the
/// registry stays held: no test gets to register or leave meanwhile).
fn fire(armed: &BTreeMap<u64, Armed>, id: u64) -> ! {
    let a = &armed[&id];
    let mut err = std::io::stderr().lock();
    let pid = a.pid.map_or("none".to_string(), |p| p.to_string());
    let _ = writeln!(
        err,
        "\n*** hoardfs test watchdog: test `{}`: the mount at {} (daemon pid {pid}) is \
         still up {} s after it was mounted (HOARDFS_TEST_TIMEOUT={}): aborting its FUSE \
         connection and exiting with 101",
        a.test,
        a.mnt.display(),
        a.mounted_at.elapsed().as_secs(),
        timeout().map_or(0, |t| t.as_secs()),
    );
    let _ = writeln!(
        err,
        "--- its daemon's log ({}) ---\n{}--- end of the daemon's log ---",
        a.log.display(),
        super::log_excerpt(&a.log)
    );
    // Where each of its threads waits, for a hang that leaves nothing in the log.
    if let Some(pid) = a.pid {
        let _ = writeln!(err, "--- its threads (name, state, kernel stack) ---");
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten();
        for task in tasks.flatten() {
            let p = task.path();
            let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
            let state = read("stat")
                .rsplit(") ")
                .next()
                .unwrap_or("")
                .chars()
                .next();
            let _ = writeln!(
                err,
                "{} {} {state:?}\n{}",
                task.file_name().to_string_lossy(),
                read("comm").trim(),
                read("stack")
            );
        }
        let _ = writeln!(err, "--- end of its threads ---");
    }
    let take_down = |a: &Armed| {
        let aborted = super::abort_connection(&a.mnt);
        if let Some(pid) = a.pid {
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            // A killed daemon leaves its control socket behind.
            let _ = std::fs::remove_file(hoardfs::control::socket_path(&a.mnt));
        }
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&a.mnt)
            .stderr(std::process::Stdio::null())
            .status();
        aborted
    };
    let aborted = take_down(a);
    let _ = writeln!(
        err,
        "*** hoardfs test watchdog: {}: {}",
        a.mnt.display(),
        match aborted {
            Some(conn) => format!("FUSE connection {conn} aborted, daemon killed, unmounted"),
            None => "no FUSE connection to abort (not mounted); daemon killed".to_string(),
        }
    );
    for (other, b) in armed {
        if *other != id {
            take_down(b);
            let _ = writeln!(
                err,
                "*** hoardfs test watchdog: also took down {} (test `{}`)",
                b.mnt.display(),
                b.test
            );
        }
    }
    let _ = err.flush();
    std::process::exit(101)
}

//! Tests of the test harness itself (`tests/common`): the watchdog that fails a hung mount,
//! the daemon-log check and the descriptor check. What the first two test ends the process
//! (the watchdog exits with 101) or fails a test, so those run in a child process, this
//! binary run again for one test (`child_*`) with `HOARDFS_HARNESS_CHILD` set. Without it,
//! the `child_*` tests do nothing.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{TestMount, is_mounted};

const CHILD: &str = "HOARDFS_HARNESS_CHILD";

fn in_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs the test `name` of this binary alone in a child process with `env`; returns its
/// exit code and its output (stdout then stderr). Killed after 120 s.
fn run_child(name: &str, env: &[(&str, &str)]) -> (Option<i32>, String) {
    let out_file = tempfile::NamedTempFile::new().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env_remove("HOARDFS_TEST_TIMEOUT")
        .env_remove("HOARDFS_TEST_FATAL_WARNINGS")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(out_file.reopen().unwrap())
        .stderr(out_file.reopen().unwrap())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{name} did not end within 120 s:\n{}",
                std::fs::read_to_string(out_file.path()).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = String::from_utf8_lossy(&std::fs::read(out_file.path()).unwrap()).into_owned();
    (status.code(), out)
}

/// Is process `pid` gone (or a zombie: orphans are reaped by whatever PID 1 is here)?
fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit(')').next().is_some_and(|r| r.starts_with(" Z"))
    })
}

/// A mount whose daemon is stopped hangs the next request that reaches it; the watchdog
/// ends the test process with 101 after `HOARDFS_TEST_TIMEOUT`, saying which mount, and
/// leaves nothing behind: the connection aborted (the hung stat returned), the stopped
/// daemon killed, the mount point unmounted.
#[test]
fn a_hung_mount_fails_the_test_binary_after_the_timeout() {
    let (code, out) = run_child(
        "child_hangs_on_a_stopped_daemon",
        &[("HOARDFS_TEST_TIMEOUT", "2")],
    );
    assert_eq!(code, Some(101), "{out}");
    let said = out
        .lines()
        .find(|l| l.contains("hoardfs test watchdog: test `child_hangs_on_a_stopped_daemon`"))
        .unwrap_or_else(|| panic!("the watchdog did not say which test:\n{out}"));
    assert!(said.contains("HOARDFS_TEST_TIMEOUT=2"), "{said}");
    // "the mount at MNT (daemon pid PID) is still up ..."
    let mnt = said
        .split("the mount at ")
        .nth(1)
        .and_then(|r| r.split(" (daemon pid ").next())
        .unwrap();
    let pid: u32 = said
        .split("(daemon pid ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no daemon pid in {said:?}"));
    assert!(
        out.contains(&format!("{mnt}: FUSE connection ")) && out.contains(" aborted"),
        "{out}"
    );
    assert!(!is_mounted(Path::new(mnt)), "{mnt} is still mounted");
    common::wait_until(Duration::from_secs(10), "the stopped daemon to die", || {
        gone(pid)
    });
    let socket = hoardfs::control::socket_path(Path::new(mnt));
    assert!(!socket.exists(), "{} is left behind", socket.display());
    let _ = std::fs::remove_dir_all(Path::new(mnt).parent().unwrap());
}

#[test]
fn child_hangs_on_a_stopped_daemon() {
    if !in_child() {
        return;
    }
    let m = TestMount::new(&[]);
    std::fs::write(m.s("f"), b"x").unwrap();
    unsafe { libc::kill(m.pid() as i32, libc::SIGSTOP) };
    // A name never looked up: the lookup reaches the stopped daemon and waits, in the
    // kernel, uninterruptibly once the daemon has read the request. The process can exit
    // (the parent sees its status) only once the watchdog aborted the connection.
    let _ = std::fs::metadata(m.m("f"));
    // Only the watchdog ends this test.
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// With `HOARDFS_TEST_FATAL_WARNINGS=1`, a WARN line in the daemon's log fails a test that
/// does not expect it, and the failure shows the line; a test that expects warnings passes.
/// Without the variable, the same test passes.
#[test]
fn warnings_fail_a_test_only_when_asked_and_unexpected() {
    let fatal = [("HOARDFS_TEST_FATAL_WARNINGS", "1")];
    let (code, out) = run_child("child_makes_its_daemon_warn", &fatal);
    assert_eq!(code, Some(101), "{out}");
    assert!(out.contains("warning(s) or error(s)"), "{out}");
    assert!(
        out.contains("WARN hoardfs::fs::state: discarding cache record"),
        "{out}"
    );
    assert!(out.contains("--- daemon log of "), "{out}");
    let (code, out) = run_child("child_makes_its_daemon_warn", &[]);
    assert_eq!(code, Some(0), "{out}");
    let (code, out) = run_child(
        "child_makes_its_daemon_warn",
        &[fatal[0], ("HOARDFS_HARNESS_EXPECT", "1")],
    );
    assert_eq!(code, Some(0), "{out}");
}

#[test]
fn child_makes_its_daemon_warn() {
    if !in_child() {
        return;
    }
    let mut m = TestMount::new(&[]);
    if std::env::var_os("HOARDFS_HARNESS_EXPECT").is_some() {
        m.expect_warnings();
    }
    // A record torn on disk: the daemon discards it with a WARN when it reads it.
    std::fs::write(m.s("f"), b"cached").unwrap();
    assert_eq!(std::fs::read(m.m("f")).unwrap(), b"cached");
    m.unmount();
    std::fs::write(m.cache.join("meta/f"), b"torn").unwrap();
    m.mount();
    assert_eq!(std::fs::read(m.m("f")).unwrap(), b"cached");
    assert!(
        common::log_warnings(&m.log)
            .iter()
            .any(|l| l.contains("discarding cache record")),
        "{}",
        m.daemon_log()
    );
}

/// The end-of-test descriptor check looks at what matters: a file open through the mount
/// shows as held by the daemon (its cache data file; its source file only by the `O_PATH`
/// descriptor the open shares with the file's callback, which the check leaves aside as
/// it leaves every callback's), the daemon's directories and records do not, and nothing
/// is left once the file is closed and released.
#[test]
fn the_descriptor_check_sees_the_files_the_daemon_holds() {
    use std::io::Read;
    let m = TestMount::new(&[]);
    std::fs::create_dir(m.s("d")).unwrap();
    std::fs::write(m.s("d/f"), vec![7u8; 100_000]).unwrap();
    assert!(m.daemon_files().is_empty(), "{:?}", m.daemon_files());
    let mut f = std::fs::File::open(m.m("d/f")).unwrap();
    let mut buf = [0u8; 10];
    f.read_exact(&mut buf).unwrap();
    let held = m.daemon_files();
    let src_f = m.s("d/f").display().to_string();
    let data_f = m.c("d/f").display().to_string();
    assert!(held.iter().any(|l| l.ends_with(&data_f)), "{held:?}");
    assert_eq!(
        m.stats().coherence.watched_files,
        1,
        "the file has a callback"
    );
    assert!(
        held.iter()
            .all(|l| l.ends_with(&src_f) || l.ends_with(&data_f)),
        "{held:?}"
    );
    drop(f);
    m.wait_released();
    assert!(m.daemon_files().is_empty(), "{:?}", m.daemon_files());
}

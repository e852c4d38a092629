//! The daemon's boundaries as a root service: who may steer it through its control socket,
//! and what happens to a mount point that already holds a hoardfs mount (a live one is
//! refused; a dead or hung one is cleared without a hand).

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, TestMount, is_mounted};

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// `hoardfs ARGS` as the user nobody.
fn as_nobody(args: &[&str]) -> Output {
    Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "env",
            "XDG_RUNTIME_DIR=/run",
            BIN,
        ])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn other_users_may_read_counters_but_never_steer_a_root_daemon() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let m = TestMount::new(&["--allow-other"]);
    // nobody must be able to reach the mount point to name it.
    std::fs::set_permissions(m.base(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir(m.s("secret")).unwrap();
    std::fs::set_permissions(m.s("secret"), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(m.s("secret/plans.txt"), b"x").unwrap();
    let mnt = m.mnt.to_str().unwrap();

    let out = as_nobody(&["stats", mnt]);
    assert!(out.status.success(), "{out:?}");

    let secret = m.m("secret/plans.txt");
    let secret = secret.to_str().unwrap();
    for args in [
        vec!["set", mnt, "stale_check=off"],
        vec!["set", mnt, "watch=off"],
        vec!["set", mnt, "attr_ttl=100000"],
        vec!["set", mnt, "log=trace"],
        vec!["offline", mnt],
        vec!["clean", mnt, "--to", "0"],
        vec!["pin", secret],
    ] {
        let out = as_nobody(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "nobody could run {args:?}");
        // pin of a name in a 0700 directory must not even tell whether it exists.
        assert!(
            err.contains("permission denied") || err.contains("Permission denied"),
            "{args:?}: {err}"
        );
    }
    let s = m.stats();
    assert!(s.health.online, "nobody switched the mount offline: {s:?}");

    // The socket directory is root's and nobody can plant or remove a socket there.
    let dir = hoardfs::control::runtime_dir();
    let md = std::fs::symlink_metadata(&dir).unwrap();
    assert!(md.is_dir());
    assert_eq!((md.uid(), md.mode() & 0o7777), (0, 0o755));
    let sock = hoardfs::control::socket_path(&m.mnt);
    let sm = std::fs::symlink_metadata(&sock).unwrap();
    assert_eq!((sm.uid(), sm.mode() & 0o777), (0, 0o666));
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "rm",
            "-f",
        ])
        .arg(&sock)
        .output()
        .unwrap();
    assert!(!out.status.success(), "nobody removed the socket");
    assert!(sock.exists());
}

/// Waits until `f` holds, for at most `secs` seconds.
fn wait_for(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A second daemon for `m`'s source and mount point, with a cache of its own, in the
/// foreground (the test owns it), under a timeout so that a hang fails the test.
fn second_daemon(m: &TestMount) -> Child {
    Command::new("timeout")
        .args(["-s", "KILL", "60", BIN])
        .arg(&m.src)
        .arg(&m.mnt)
        .arg("--cache-dir")
        .arg(m.base().join("cache2"))
        .arg("-f")
        .env("HOARDFS_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn hoardfs_mounts_at(mnt: &Path) -> usize {
    hoardfs::mounts::hoardfs_mounts()
        .iter()
        .filter(|h| h.mountpoint == mnt)
        .count()
}

#[test]
fn a_second_mount_on_a_live_mount_point_is_refused() {
    let m = TestMount::new(&[]);
    std::fs::write(m.s("f"), b"one").unwrap();
    let child = second_daemon(&m);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a second mount was accepted: {err}");
    assert!(err.contains("already a hoardfs mount"), "{err}");
    assert_eq!(hoardfs_mounts_at(&m.mnt), 1);
    // The first mount still answers, on the socket and through the file system.
    assert_eq!(m.stats().mountpoint, m.mnt.to_str().unwrap());
    assert_eq!(std::fs::read(m.m("f")).unwrap(), b"one");
}

/// Mounts a second daemon over a mount point whose first daemon is `dead_or_stopped`, and
/// checks that it takes over: one mount left, serving, answering its control socket.
fn take_over(m: &TestMount) -> Child {
    let mut child = second_daemon(m);
    wait_for(30, "the new mount to answer", || {
        if let Some(st) = child.try_wait().unwrap() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("the new daemon exited with {st}: {err}");
        }
        hoardfs::control::request_stats(&m.mnt).is_ok_and(|s| {
            s.cache_dir
                .ends_with(m.base().join("cache2").to_str().unwrap())
        })
    });
    assert_eq!(hoardfs_mounts_at(&m.mnt), 1, "the old mount is still there");
    assert_eq!(std::fs::read(m.m("f")).unwrap(), b"one");
    child
}

fn stop_second(mut child: Child, mnt: &Path) {
    let st = Command::new("umount").arg(mnt).status().unwrap();
    assert!(st.success());
    wait_for(20, "the new daemon to exit", || {
        child.try_wait().unwrap().is_some()
    });
    assert!(!is_mounted(mnt));
}

#[test]
fn a_mount_point_left_by_a_killed_daemon_is_mounted_again_without_a_hand() {
    let mut m = TestMount::new(&[]);
    std::fs::write(m.s("f"), b"one").unwrap();
    assert_eq!(std::fs::read(m.m("f")).unwrap(), b"one");
    // kill -9 without clearing the mount: the mount point is left dead (ENOTCONN).
    let mut old = m.kill_only();
    old.wait().unwrap();
    let child = take_over(&m);
    stop_second(child, &m.mnt);
}

#[test]
fn a_mount_point_of_a_hung_daemon_is_taken_over() {
    let mut m = TestMount::new(&[]);
    std::fs::write(m.s("f"), b"one").unwrap();
    assert_eq!(std::fs::read(m.m("f")).unwrap(), b"one");
    let pid = m.pid().to_string();
    // The old daemon finds its connection aborted: its last replies fail.
    m.expect_warnings();
    // Ended by `Resume` below: the old mount is gone by then.
    let mut old = m.take_daemon();
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    struct Resume(String);
    impl Drop for Resume {
        fn drop(&mut self) {
            let _ = Command::new("kill").args(["-KILL", &self.0]).status();
            let _ = Command::new("kill").args(["-CONT", &self.0]).status();
        }
    }
    let resume = Resume(pid);
    let child = take_over(&m);
    // The old daemon, resumed, finds its connection aborted and goes; it must not take the
    // new daemon's control socket with it.
    let _ = Command::new("kill").args(["-CONT", &resume.0]).status();
    wait_for(20, "the old daemon to exit", || {
        old.try_wait().unwrap().is_some()
    });
    assert!(
        hoardfs::control::request_stats(&m.mnt).is_ok(),
        "the old daemon removed the new daemon's socket"
    );
    stop_second(child, &m.mnt);
    drop(resume);
    old.wait().unwrap();
}

#[test]
fn commands_take_any_path_inside_the_mount() {
    let m = TestMount::new(&[]);
    std::fs::create_dir_all(m.s("a/b")).unwrap();
    let out = Command::new(BIN)
        .arg("stats")
        .arg(m.m("a/b"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let out = Command::new(BIN)
        .args(["set"])
        .arg(m.m("a"))
        .arg("attr_ttl=2")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// `hoardfs abort`, which the systemd unit runs after a stop (ExecStopPost): a mount whose
/// daemon answers is left alone; one whose daemon hangs (stopped) is aborted and detached,
/// by mount point or by the config file's section name as the unit gives it, and its
/// daemon, resumed, can die.
#[test]
fn abort_clears_a_hung_mount_and_leaves_a_live_one() {
    let mut m = TestMount::new(&[]);
    std::fs::write(m.s("f"), b"one").unwrap();
    assert_eq!(std::fs::read(m.m("f")).unwrap(), b"one");
    let abort = |args: &[&str]| {
        let out = Command::new(BIN).arg("abort").args(args).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let mnt = m.mnt.to_str().unwrap().to_string();
    let said = abort(&[&mnt]);
    assert!(said.contains("left alone"), "{said}");
    assert!(is_mounted(&m.mnt));
    assert_eq!(std::fs::read(m.m("f")).unwrap(), b"one");

    let config = m.base().join("hoardfs.toml");
    std::fs::write(
        &config,
        format!(
            "[mount.media]\nsource = {:?}\nmountpoint = {mnt:?}\n",
            m.src.to_str().unwrap()
        ),
    )
    .unwrap();
    let pid = m.pid().to_string();
    let mut old = m.take_daemon();
    Command::new("kill").args(["-STOP", &pid]).status().unwrap();
    let said = abort(&["--config", config.to_str().unwrap(), "media"]);
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
    assert!(said.contains("connection aborted"), "{said}");
    assert_eq!(
        hoardfs_mounts_at(&m.mnt),
        0,
        "the hung mount is still there"
    );
    let t0 = Instant::now();
    while old.try_wait().unwrap().is_none() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the old daemon did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let said = abort(&[&mnt]);
    assert!(said.contains("no hoardfs mount there"), "{said}");
}

/// A daemon killed with -9 cannot remove its control socket; the next daemon to start
/// removes every socket that nobody listens on, so that killed test daemons (and crashed
/// ones in production) leave nothing behind in the runtime directory for long.
#[test]
fn sockets_of_dead_daemons_are_removed_by_the_next_daemon() {
    let mut dead = TestMount::new(&[]);
    let sock = hoardfs::control::socket_path(&dead.mnt);
    assert!(sock.exists(), "{}", sock.display());
    dead.crash();
    assert!(
        sock.exists(),
        "the killed daemon removed its socket itself?"
    );
    let live = TestMount::new(&[]);
    assert!(!sock.exists(), "{} is still there", sock.display());
    assert!(hoardfs::control::socket_path(&live.mnt).exists());
}

/// Daemons started at the same moment each get their control socket: one starting daemon
/// must not take another's socket, bound a moment before it listens, for a dead daemon's
/// and remove it (that daemon then failed with "cannot chmod …sock").
#[test]
fn daemons_started_at_once_all_get_their_sockets() {
    for _round in 0..4 {
        let mounts: Vec<TestMount> = std::thread::scope(|s| {
            let started: Vec<_> = (0..6).map(|_| s.spawn(|| TestMount::new(&[]))).collect();
            started.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for m in &mounts {
            assert!(hoardfs::control::socket_path(&m.mnt).exists());
            assert_eq!(m.stats().open_handles, 0);
        }
    }
}

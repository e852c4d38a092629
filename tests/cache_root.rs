//! The cache root is opened once and everything in it is reached beneath it without
//! following links (issue 21, item 2): links, hard links and wrong types planted in the
//! cache directory by whoever can write it never lead the daemon to change anything
//! outside, and the daemon's own files get owner-only modes whatever its umask. Every test
//! plants something, mounts real FUSE, and checks a canary directory outside the cache
//! (names, modes, sizes, bytes). See docs/security.md (C1-C6).

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, TestMount, is_mounted, pattern};

const CANARY: &[u8] = b"CANARY-7d1f-outside-the-cache\n";

/// These tests mount and unmount many times; run in parallel threads, one test's child
/// process (between fork and exec) can hold another's file on its mount for an instant,
/// and that unmount fails with EBUSY. One at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A directory outside the cache holding `passwd` and `victim` (canary bytes, 0644),
/// itself 0755.
fn plant_canary(t: &TestMount) -> PathBuf {
    let outside = t.base().join("outside");
    fs::create_dir(&outside).unwrap();
    fs::set_permissions(&outside, fs::Permissions::from_mode(0o755)).unwrap();
    for name in ["passwd", "victim"] {
        fs::write(outside.join(name), CANARY).unwrap();
        fs::set_permissions(outside.join(name), fs::Permissions::from_mode(0o644)).unwrap();
    }
    outside
}

/// Names, modes, sizes and bytes of everything in the canary directory, and its own mode.
fn canary_state(outside: &Path) -> Vec<(String, u32, u64, Vec<u8>)> {
    let mut v: Vec<_> = fs::read_dir(outside)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let m = fs::symlink_metadata(e.path()).unwrap();
            let bytes = if m.is_file() {
                fs::read(e.path()).unwrap()
            } else {
                Vec::new()
            };
            (
                e.file_name().to_string_lossy().into_owned(),
                m.mode(),
                m.len(),
                bytes,
            )
        })
        .collect();
    v.sort();
    v.push((
        ".".into(),
        fs::metadata(outside).unwrap().mode(),
        0,
        Vec::new(),
    ));
    v
}

fn assert_canary_untouched(outside: &Path) {
    let now = canary_state(outside);
    let names: Vec<&str> = now.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(
        names,
        ["passwd", "victim", "."],
        "something was created or removed outside the cache"
    );
    for (name, mode, len, bytes) in &now {
        if name == "." {
            assert_eq!(mode & 0o7777, 0o755, "the canary directory was chmodded");
            continue;
        }
        assert_eq!(
            mode & 0o7777,
            0o644,
            "{name} outside the cache was chmodded"
        );
        assert_eq!(
            *len,
            CANARY.len() as u64,
            "{name} outside the cache changed size"
        );
        assert_eq!(bytes, CANARY, "{name} outside the cache was written");
    }
}

/// Makes `t.cache` an (empty) hoardfs cache, so that what is planted in it is not refused
/// as a foreign directory.
fn init_cache(t: &TestMount) {
    fs::create_dir(&t.cache).unwrap();
    fs::set_permissions(&t.cache, fs::Permissions::from_mode(0o700)).unwrap();
    fs::write(t.cache.join("FORMAT"), b"hoardfs cache 1\n").unwrap();
}

/// The source holds `passwd` (and a directory to list); reads go through the mount.
fn use_the_mount(t: &TestMount) {
    let data = pattern(100 << 10, 3);
    assert_eq!(fs::read(t.m("passwd")).unwrap(), data);
    let names: Vec<_> = fs::read_dir(t.m("d")).unwrap().flatten().collect();
    assert_eq!(names.len(), 1);
    assert_eq!(fs::read(t.m("d/f")).unwrap(), b"in d");
    hoardfs_ok(&["pin", t.m("d").to_str().unwrap()]);
}

fn fill_source(t: &TestMount) {
    fs::write(t.s("passwd"), pattern(100 << 10, 3)).unwrap();
    fs::create_dir(t.s("d")).unwrap();
    fs::write(t.s("d/f"), b"in d").unwrap();
}

fn hoardfs_ok(args: &[&str]) {
    let out = Command::new(BIN).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "hoardfs {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Plants a symlink at `CACHE/<rel>` to `target`, mounts, uses the mount, unmounts. The
/// link is ignored, and replaced if the daemon writes that name.
fn mount_with_link(rel: &str, target_in_outside: &str) {
    let mut t = TestMount::unmounted_at("mnt", &[]);
    // The daemon says what it replaces.
    t.expect_warnings();
    fill_source(&t);
    let outside = plant_canary(&t);
    init_cache(&t);
    let link = t.cache.join(rel);
    fs::create_dir_all(link.parent().unwrap()).unwrap();
    symlink(outside.join(target_in_outside), &link).unwrap();
    t.mount();
    use_the_mount(&t);
    t.unmount();
    assert_canary_untouched(&outside);
    // The replay's progress file is only written by a replay.
    assert!(
        rel == "oplog/progress"
            || !fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink(),
        "{rel}: the planted link was left in place"
    );
}

#[test]
fn a_cache_subdirectory_that_is_a_symlink_is_never_followed() {
    let _serial = serial();
    // data -> a directory holding `passwd`: reading the source's `passwd` would overwrite
    // it (with data -> /etc, /etc/passwd).
    for sub in ["data", "meta", "dirs", "oplog"] {
        mount_with_link(sub, "");
    }
}

#[test]
fn top_level_files_that_are_symlinks_are_never_followed() {
    let _serial = serial();
    // oplog/log -> a file: it was truncated to 0 bytes at mount. lock -> a name outside:
    // it was created there. pins.tmp and source.json.tmp: written through.
    for rel in ["oplog/log", "oplog/progress", "lock", "pins", "source.json"] {
        mount_with_link(rel, "victim");
    }
    mount_with_link("lock", "new-file");
    for tmp in ["pins.tmp", "source.json.tmp", "FORMAT.tmp"] {
        let mut t = TestMount::unmounted_at("mnt", &[]);
        fill_source(&t);
        let outside = plant_canary(&t);
        init_cache(&t);
        symlink(outside.join("victim"), t.cache.join(tmp)).unwrap();
        t.mount();
        use_the_mount(&t);
        t.unmount();
        assert_canary_untouched(&outside);
    }
}

/// Lazily unmounts a mount whose daemon the test does not own, should the test fail.
struct Unmount<'a>(&'a Path);

impl Drop for Unmount<'_> {
    fn drop(&mut self) {
        if is_mounted(self.0) {
            let _ = Command::new("umount").arg("-l").arg(self.0).status();
        }
    }
}

/// Runs the daemon as a daemon (its log goes to `CACHE/hoardfs.log`), uses the mount,
/// unmounts, and waits for the daemon to let go of the cache.
fn run_daemonized(t: &TestMount) {
    let _unmount = Unmount(&t.mnt);
    let st = Command::new(BIN)
        .arg(&t.src)
        .arg(&t.mnt)
        .arg("--cache-dir")
        .arg(&t.cache)
        .env("HOARDFS_LOG", "info")
        .stdin(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success(), "daemon mount failed: {st}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while hoardfs::control::request_stats(&t.mnt).is_err() {
        assert!(Instant::now() < deadline, "control socket did not appear");
        std::thread::sleep(Duration::from_millis(10));
    }
    use_the_mount(t);
    assert!(
        Command::new("umount")
            .arg(&t.mnt)
            .status()
            .unwrap()
            .success()
    );
    while is_mounted(&t.mnt) {
        std::thread::sleep(Duration::from_millis(10));
    }
    // The daemon exits after the unmount: its lock goes with it.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lock = fs::File::open(t.cache.join("lock")).unwrap();
        let r = unsafe {
            libc::flock(
                std::os::fd::AsRawFd::as_raw_fd(&lock),
                libc::LOCK_EX | libc::LOCK_NB,
            )
        };
        if r == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the daemon did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn the_daemon_log_is_never_written_through_a_link_and_its_files_are_owner_only() {
    let _serial = serial();
    let t = TestMount::unmounted_at("mnt", &[]);
    fill_source(&t);
    let outside = plant_canary(&t);
    init_cache(&t);
    symlink(outside.join("victim"), t.cache.join("hoardfs.log")).unwrap();
    run_daemonized(&t);
    assert_canary_untouched(&outside);
    let log = fs::symlink_metadata(t.cache.join("hoardfs.log")).unwrap();
    assert!(log.is_file(), "hoardfs.log is the daemon's own file");
    assert!(
        fs::read_to_string(t.cache.join("hoardfs.log"))
            .unwrap()
            .contains("mounted"),
        "the log is written to the cache"
    );
    // The daemon runs with umask 0: every file it makes gets its mode explicitly.
    for name in ["hoardfs.log", "pins", "lock", "source.json"] {
        let mode = fs::metadata(t.cache.join(name)).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o600, "{name} is {mode:o}");
    }
    for dir in ["", "data", "meta", "dirs", "oplog", "oplog/data", "data/d"] {
        let mode = fs::metadata(t.cache.join(dir)).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o700, "{dir:?} is {mode:o}");
    }
    let f = t.cache.join("data/passwd");
    assert_eq!(fs::metadata(&f).unwrap().mode() & 0o7777, 0o600);
}

#[test]
fn a_data_file_hard_linked_outside_is_replaced_not_written_through() {
    let _serial = serial();
    let mut t = TestMount::new(&[]);
    t.expect_warnings();
    let outside = plant_canary(&t);
    let data = pattern(CANARY.len(), 9);
    fs::write(t.s("passwd"), &data).unwrap();
    assert_eq!(fs::read(t.m("passwd")).unwrap(), data);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !t.cache.join("meta/passwd").exists() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(20));
    }
    t.unmount();
    // The data file becomes another name of a file outside the cache (same size).
    fs::remove_file(t.c("passwd")).unwrap();
    fs::hard_link(outside.join("passwd"), t.c("passwd")).unwrap();
    // And a record with a hard link, too.
    fs::write(t.s("victim"), &data).unwrap();
    t.mount();
    assert_eq!(fs::read(t.m("victim")).unwrap(), data);
    t.unmount();
    fs::remove_file(t.cache.join("meta/victim")).unwrap();
    fs::hard_link(outside.join("victim"), t.cache.join("meta/victim")).unwrap();
    t.mount();
    // The record no longer vouches for the data file: the file is fetched again.
    assert_eq!(fs::read(t.m("passwd")).unwrap(), data);
    assert_eq!(fs::read(t.m("victim")).unwrap(), data);
    // And changed in the source, refetched again; and written through the mount.
    let data2 = pattern(CANARY.len(), 10);
    fs::write(t.s("passwd"), &data2).unwrap();
    assert_eq!(fs::read(t.m("passwd")).unwrap(), data2);
    fs::write(t.m("victim"), &data2).unwrap();
    assert_eq!(fs::read(t.m("victim")).unwrap(), data2);
    t.unmount();
    assert_canary_untouched(&outside);
    assert_eq!(fs::metadata(t.c("passwd")).unwrap().nlink(), 1);
}

#[test]
fn a_cache_subdirectory_of_the_wrong_type_is_replaced() {
    let _serial = serial();
    for sub in ["meta", "data", "dirs", "oplog"] {
        let mut t = TestMount::unmounted_at("mnt", &[]);
        t.expect_warnings();
        fill_source(&t);
        init_cache(&t);
        fs::write(t.cache.join(sub), b"not a directory").unwrap();
        t.mount();
        use_the_mount(&t);
        t.unmount();
        assert!(t.cache.join(sub).is_dir(), "{sub}");
    }
}

/// Runs a mount that should be refused; returns its stderr. A mount that is not refused
/// is unmounted again and fails the test.
fn refused(t: &TestMount) -> String {
    let child = Command::new(BIN)
        .arg(&t.src)
        .arg(&t.mnt)
        .arg("--cache-dir")
        .arg(&t.cache)
        .arg("-f")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline && !is_mounted(&t.mnt) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mounted = is_mounted(&t.mnt);
    if mounted {
        let _ = Command::new("umount").arg(&t.mnt).status();
    }
    let out = child.wait_with_output().unwrap();
    assert!(!mounted, "the cache directory was accepted");
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_refused_cache_directory_is_left_untouched() {
    let _serial = serial();
    let t = TestMount::unmounted_at("mnt", &[]);
    fill_source(&t);
    fs::create_dir(&t.cache).unwrap();
    fs::set_permissions(&t.cache, fs::Permissions::from_mode(0o755)).unwrap();
    fs::write(t.cache.join("precious"), b"mine").unwrap();
    let err = refused(&t);
    assert!(err.contains("not a hoardfs cache"), "{err}");
    assert_eq!(
        fs::metadata(&t.cache).unwrap().mode() & 0o7777,
        0o755,
        "the refused directory was chmodded"
    );
    let names: Vec<_> = fs::read_dir(&t.cache)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["precious"]);

    // A cache directory of another user is refused, untouched (its owner could plant
    // links in it).
    let t = TestMount::unmounted_at("mnt", &[]);
    fill_source(&t);
    init_cache(&t);
    fs::set_permissions(&t.cache, fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::chown(&t.cache, Some(65534), Some(65534)).unwrap();
    let err = refused(&t);
    assert!(err.contains("belongs to uid 65534"), "{err}");
    assert_eq!(fs::metadata(&t.cache).unwrap().mode() & 0o7777, 0o755);
    let names: Vec<_> = fs::read_dir(&t.cache)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["FORMAT"]);
}

fn files_holding(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap().flatten() {
        let ft = e.file_type().unwrap();
        if ft.is_dir() {
            out.extend(files_holding(&e.path(), needle));
        } else if ft.is_file()
            && fs::read(e.path())
                .unwrap()
                .windows(needle.len())
                .any(|w| w == needle)
        {
            out.push(e.path());
        }
    }
    out
}

#[test]
fn offline_replay_never_writes_through_nor_sends_planted_links() {
    let _serial = serial();
    let t = TestMount::new(&["--offline-writes", "log"]);
    // Offline, conflicts, planted links: all said in the log.
    t.expect_warnings();
    let outside = plant_canary(&t);
    fs::write(t.s("f"), b"original f\n").unwrap();
    fs::write(t.s("g"), b"original g\n").unwrap();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"original f\n");
    assert_eq!(fs::read(t.m("g")).unwrap(), b"original g\n");
    hoardfs_ok(&["offline", t.mnt.to_str().unwrap()]);
    fs::write(t.m("f"), b"mount's f\n").unwrap();
    fs::write(t.m("g"), b"mount's g\n").unwrap();
    // f changes on both sides: a conflict, reported in conflicts.log.
    fs::write(t.s("f"), b"source's f\n").unwrap();
    symlink(outside.join("victim"), t.cache.join("conflicts.log")).unwrap();
    // g's content waits in the last container: it becomes a link to a file outside.
    let mut seqs: Vec<u64> = fs::read_dir(t.cache.join("oplog/data"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_str().unwrap().parse().unwrap())
        .collect();
    seqs.sort();
    let last = t
        .cache
        .join("oplog/data")
        .join(seqs.last().unwrap().to_string());
    fs::remove_file(&last).unwrap();
    fs::hard_link(outside.join("passwd"), &last).unwrap();
    // The replay may fail on the planted container; it must not follow either link.
    let _ = Command::new(BIN)
        .args(["online", t.mnt.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(
        files_holding(&t.src, CANARY),
        Vec::<PathBuf>::new(),
        "bytes from outside the cache were sent to the source"
    );
    assert_canary_untouched(&outside);
    assert!(
        fs::symlink_metadata(t.cache.join("conflicts.log"))
            .unwrap()
            .is_file(),
        "the conflict was reported in the cache's own conflicts.log"
    );
}

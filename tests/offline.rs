//! Disconnected operation: what was warmed stays readable when the source is switched off,
//! stops answering or dies; the rest fails promptly; the mount comes back by itself.

mod common;

use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::{BIN, TestMount, is_mounted, wait_until};

/// One line per object of the tree under `root` (sorted per directory), as `describe`
/// puts it given the relative path, the `lstat` and the object's contents (the link target,
/// the bytes, or "dir").
fn tree_lines(root: &Path, describe: impl Fn(&str, &fs::Metadata, &str) -> String) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let mut names: Vec<PathBuf> = fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        for p in names {
            let m = fs::symlink_metadata(&p).unwrap();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let what = if m.is_dir() {
                stack.push(p.clone());
                "dir".to_string()
            } else if m.file_type().is_symlink() {
                format!("-> {}", fs::read_link(&p).unwrap().display())
            } else {
                let data = fs::read(&p).unwrap();
                if data.len() <= 64 {
                    String::from_utf8_lossy(&data).into_owned()
                } else {
                    format!("{} bytes, crc {:08x}", data.len(), crc32fast::hash(&data))
                }
            };
            out.push(describe(&rel, &m, &what));
        }
    }
    out
}

/// Everything `ls -lR` would show of a tree: path, type, mode, size, mtime, link target,
/// and the contents of regular files.
fn snapshot(root: &Path) -> Vec<String> {
    tree_lines(root, |rel, m, what| {
        format!("{rel} {:o} {} {} {what}", m.mode(), m.len(), m.mtime())
    })
}

fn make_tree(src: &Path) {
    fs::create_dir_all(src.join("hoard/sub")).unwrap();
    for i in 0..20 {
        fs::write(
            src.join(format!("hoard/f{i}")),
            format!("file {i}\n").repeat(i + 1),
        )
        .unwrap();
    }
    fs::write(src.join("hoard/sub/deep"), vec![7u8; 3 << 20]).unwrap();
    std::os::unix::fs::symlink("f1", src.join("hoard/link")).unwrap();
    fs::create_dir(src.join("never_listed")).unwrap();
    fs::write(src.join("never_listed/x"), b"x").unwrap();
    fs::write(src.join("uncached"), b"not warmed").unwrap();
}

fn hoardfs(args: &[&str], path: &Path) -> std::process::Output {
    Command::new(BIN).args(args).arg(path).output().unwrap()
}

/// `hoardfs online`, again while it is refused because files written offline are still
/// open: a close returns before the kernel's RELEASE reaches the daemon, and another
/// test's fork holds copies of this one's descriptors until its exec.
fn go_online(mnt: &Path) -> std::process::Output {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let out = hoardfs(&["online"], mnt);
        let still_open = String::from_utf8_lossy(&out.stderr).contains("are still open");
        if out.status.success() || !still_open || Instant::now() > until {
            return out;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The names in directory `dir`, sorted.
fn sorted_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

fn errno_of(r: std::io::Result<impl Sized>) -> Option<i32> {
    r.err().and_then(|e| e.raw_os_error())
}

#[test]
fn switched_offline_the_mount_serves_what_was_warmed() {
    let t = TestMount::new(&[]);
    t.expect_warnings();
    make_tree(&t.src);
    let out = hoardfs(&["warm"], &t.m("hoard"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("warmed 21 files"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let before = snapshot(&t.m("hoard"));

    assert!(hoardfs(&["offline"], &t.mnt).status.success());
    let s = t.stats().health;
    assert!(!s.online && s.manual, "{s:?}");
    // Names, attributes, symlinks and data: as they were.
    assert_eq!(snapshot(&t.m("hoard")), before);
    // What was never fetched or listed fails at once, with EIO.
    let t0 = Instant::now();
    assert_eq!(errno_of(fs::read(t.m("uncached"))), Some(libc::EIO));
    assert_eq!(errno_of(fs::read_dir(t.m("never_listed"))), Some(libc::EIO));
    assert!(t0.elapsed() < Duration::from_secs(1));
    // A name that a complete listing does not have does not exist.
    assert_eq!(
        fs::metadata(t.m("hoard/nope")).unwrap_err().kind(),
        ErrorKind::NotFound
    );
    // Changes are refused; nothing reaches the source.
    assert_eq!(
        errno_of(fs::write(t.m("hoard/new"), b"x")),
        Some(libc::EROFS)
    );
    assert_eq!(
        errno_of(fs::remove_file(t.m("hoard/f1"))),
        Some(libc::EROFS)
    );
    assert_eq!(errno_of(fs::create_dir(t.m("hoard/d"))), Some(libc::EROFS));
    assert_eq!(
        errno_of(fs::OpenOptions::new().append(true).open(t.m("hoard/f2"))),
        Some(libc::EROFS)
    );
    assert!(!t.s("hoard/new").exists() && t.s("hoard/f1").exists());
    // The source's own changes show once back online.
    fs::write(t.s("hoard/f3"), b"changed while offline").unwrap();
    assert!(go_online(&t.mnt).status.success());
    assert!(t.stats().health.online);
    assert_eq!(fs::read(t.m("hoard/f3")).unwrap(), b"changed while offline");
    assert_eq!(fs::read(t.m("uncached")).unwrap(), b"not warmed");
    fs::write(t.m("hoard/new"), b"x").unwrap();
    assert_eq!(fs::read(t.s("hoard/new")).unwrap(), b"x");
}

#[test]
fn an_offline_start_serves_the_cache_of_an_earlier_mount() {
    let mut t = TestMount::new(&[]);
    t.expect_warnings();
    make_tree(&t.src);
    assert!(hoardfs(&["warm"], &t.m("hoard")).status.success());
    let before = snapshot(&t.m("hoard"));
    t.unmount();
    t.extra_args = vec!["--offline".into()];
    t.mount();
    assert!(!t.stats().health.online);
    assert_eq!(snapshot(&t.m("hoard")), before);
}

/// A FUSE source (bindfs over a directory) standing in for sshfs: it can be made to hang
/// (SIGSTOP) and to die (SIGKILL), and be mounted again.
struct FuseSource {
    real: PathBuf,
    at: PathBuf,
    /// bindfs's own options.
    args: Vec<String>,
    child: Option<Child>,
}

impl FuseSource {
    fn start(real: &Path, at: &Path, args: &[&str]) -> FuseSource {
        let mut s = FuseSource {
            real: real.to_path_buf(),
            at: at.to_path_buf(),
            args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let child = Command::new("bindfs")
            .arg("-f")
            .args(&self.args)
            .arg(&self.real)
            .arg(&self.at)
            .spawn()
            .expect("bindfs (apt-get install bindfs)");
        self.child = Some(child);
        wait_until(Duration::from_secs(10), "bindfs mounted", || {
            fs::read_to_string("/proc/self/mountinfo")
                .unwrap()
                .lines()
                .any(|l| l.split(' ').nth(4) == self.at.to_str())
        });
    }

    fn signal(&self, sig: i32) {
        if let Some(child) = &self.child {
            unsafe { libc::kill(child.id() as i32, sig) };
        }
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

impl Drop for FuseSource {
    fn drop(&mut self) {
        self.signal(libc::SIGCONT);
        self.kill();
    }
}

/// Mount hoardfs over a bindfs source with a 1 s source timeout.
fn over_fuse_source(extra: &[&str]) -> (tempfile::TempDir, FuseSource, TestMountOver) {
    over_fuse_source_with(&[], extra)
}

/// `over_fuse_source` with bindfs options `bindfs`.
fn over_fuse_source_with(
    bindfs: &[&str],
    extra: &[&str],
) -> (tempfile::TempDir, FuseSource, TestMountOver) {
    let d = tempfile::tempdir().unwrap();
    let base = fs::canonicalize(d.path()).unwrap();
    let (real, src, mnt) = (base.join("real"), base.join("src"), base.join("mnt"));
    for p in [&real, &src, &mnt] {
        fs::create_dir(p).unwrap();
    }
    make_tree(&real);
    let source = FuseSource::start(&real, &src, bindfs);
    let m = TestMountOver::mount(&src, &mnt, &base.join("cache"), extra);
    (d, source, m)
}

/// A foreground hoardfs over a given source, unmounted on drop.
struct TestMountOver {
    mnt: PathBuf,
    child: Child,
}

impl TestMountOver {
    fn mount(src: &Path, mnt: &Path, cache: &Path, extra: &[&str]) -> TestMountOver {
        let child = Command::new(BIN)
            .arg(src)
            .arg(mnt)
            .arg("--cache-dir")
            .arg(cache)
            .args(["-f", "--source-timeout", "1"])
            .args(extra)
            .spawn()
            .unwrap();
        wait_until(Duration::from_secs(10), "hoardfs mounted", || {
            is_mounted(mnt) && hoardfs::control::request_stats(mnt).is_ok()
        });
        TestMountOver {
            mnt: mnt.to_path_buf(),
            child,
        }
    }

    fn m(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    fn online(&self) -> bool {
        hoardfs::control::request_stats(&self.mnt)
            .unwrap()
            .health
            .online
    }
}

impl Drop for TestMountOver {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mnt).status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if is_mounted(&self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
    }
}

#[test]
fn a_hung_source_never_wedges_the_mount() {
    let (_d, source, m) = over_fuse_source(&[]);
    assert!(hoardfs(&["warm"], &m.m("hoard")).status.success());
    let before = snapshot(&m.m("hoard"));
    source.signal(libc::SIGSTOP);

    // The first call to reach the hung source waits out the timeout, then the mount is
    // offline and everything warmed is served; nothing waits longer.
    let t0 = Instant::now();
    assert_eq!(snapshot(&m.m("hoard")), before);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    assert!(!m.online());
    let t0 = Instant::now();
    assert!(fs::read(m.m("uncached")).is_err());
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());

    source.signal(libc::SIGCONT);
    wait_until(Duration::from_secs(10), "back online by itself", || {
        m.online()
    });
    assert_eq!(fs::read(m.m("uncached")).unwrap(), b"not warmed");
    let s = hoardfs::control::request_stats(&m.mnt).unwrap().health;
    assert!(
        s.timeouts >= 1 && s.went_offline >= 1 && s.went_online >= 1,
        "{s:?}"
    );
}

#[test]
fn a_dead_source_goes_offline_and_a_restarted_one_is_taken_up_again() {
    let (_d, mut source, m) = over_fuse_source(&[]);
    assert!(hoardfs(&["warm"], &m.m("hoard")).status.success());
    let before = snapshot(&m.m("hoard"));
    source.kill(); // the FUSE connection is gone: ENOTCONN
    assert_eq!(snapshot(&m.m("hoard")), before);
    assert!(!m.online());
    fs::write(
        source.real.join("hoard/after"),
        b"written while we were away",
    )
    .unwrap();
    source.spawn();
    wait_until(Duration::from_secs(10), "back online by itself", || {
        m.online()
    });
    assert_eq!(
        fs::read(m.m("hoard/after")).unwrap(),
        b"written while we were away"
    );
    fs::write(m.m("hoard/through"), b"through the mount").unwrap();
    assert_eq!(
        fs::read(source.real.join("hoard/through")).unwrap(),
        b"through the mount"
    );
}

// ------------------------------------------------------------ --offline-writes=log

/// Like `snapshot`, without times (offline changes and the same changes made to a plain
/// directory get different mtimes).
fn shape(root: &Path) -> Vec<String> {
    tree_lines(root, |rel, m, what| format!("{rel} {:o} {what}", m.mode()))
}

/// After replay: the source's and the mount's `hoard` both look like `reference`'s.
fn assert_replayed(t: &TestMount, reference: &Path, what: &str) {
    let want = shape(&reference.join("hoard"));
    assert_eq!(shape(&t.s("hoard")), want, "the source, {what}");
    assert_eq!(shape(&t.m("hoard")), want, "the mount, {what}");
}

fn copy_tree(from: &Path, to: &Path) {
    let st = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap();
    assert!(st.success());
}

/// The offline changes of the tests below, applied under `root` (the mount, or a plain
/// copy of the source for the expected result).
fn offline_edits(root: &Path) {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let p = |r: &str| root.join(r);
    fs::OpenOptions::new()
        .append(true)
        .open(p("hoard/f2"))
        .unwrap()
        .write_all(b"appended offline\n")
        .unwrap();
    fs::write(p("hoard/f3"), b"rewritten offline\n").unwrap();
    fs::write(p("hoard/new"), b"made offline\n").unwrap();
    fs::create_dir(p("hoard/newdir")).unwrap();
    fs::write(p("hoard/newdir/inner"), b"inside a new directory\n").unwrap();
    fs::rename(p("hoard/f4"), p("hoard/f4.renamed")).unwrap();
    fs::rename(p("hoard/f6"), p("hoard/f7")).unwrap(); // over an existing file
    fs::remove_file(p("hoard/f5")).unwrap();
    fs::remove_dir(p("hoard/empty")).unwrap();
    fs::set_permissions(p("hoard/f8"), fs::Permissions::from_mode(0o600)).unwrap();
    // Written, renamed, then written again under the new name.
    fs::write(p("hoard/moved"), b"first\n").unwrap();
    fs::rename(p("hoard/moved"), p("hoard/moved2")).unwrap();
    fs::write(p("hoard/moved2"), b"second\n").unwrap();
    // Made and deleted offline: the source never sees it for long.
    fs::write(p("hoard/tmp"), b"scratch").unwrap();
    fs::remove_file(p("hoard/tmp")).unwrap();
    fs::OpenOptions::new()
        .write(true)
        .open(p("hoard/f9"))
        .unwrap()
        .set_len(3)
        .unwrap();
}

fn log_mount(t_args: &[&str]) -> TestMount {
    let mut args = vec!["--offline-writes", "log"];
    args.extend_from_slice(t_args);
    let mut t = TestMount::new(&args);
    // Its tests go offline, make conflicts or crash a replay: the daemon says so.
    t.expect_warnings();
    make_tree(&t.src);
    fs::create_dir(t.s("hoard/empty")).unwrap();
    // Warm the tree (files and listings), including the empty directory.
    let out = hoardfs(&["warm"], &t.m("hoard"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    fs::read_dir(t.m("hoard/empty")).unwrap().for_each(drop);
    t.extra_args = args.iter().map(|s| s.to_string()).collect();
    t
}

#[test]
fn offline_changes_are_kept_in_the_cache_and_replayed_on_reconnection() {
    let t = log_mount(&[]);
    let expected = t.base().join("expected");
    copy_tree(&t.src, &expected);
    offline_edits(&expected);
    let source_before = shape(&t.src);

    assert!(hoardfs(&["offline"], &t.mnt).status.success());
    offline_edits(&t.mnt);
    // The mount shows the changes at once; the source has none of them yet.
    assert_eq!(shape(&t.m("hoard")), shape(&expected.join("hoard")));
    assert_eq!(shape(&t.src), source_before);
    let h = t.stats().health;
    assert!(h.log_pending >= 10, "{h:?}");
    // The cleaner keeps what was changed offline (everything else may go).
    let out = Command::new(BIN)
        .args(["clean"])
        .arg(&t.mnt)
        .args(["--to", "0"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in [
        "hoard/f2",
        "hoard/f3",
        "hoard/new",
        "hoard/newdir/inner",
        "hoard/f4.renamed",
    ] {
        assert!(t.c(f).exists(), "{f} evicted");
    }
    assert!(!t.c("hoard/f11").exists(), "the cleaner did not run");
    // Unsupported offline: a directory rename (mv copies instead), a symlink.
    assert_eq!(
        errno_of(fs::rename(t.m("hoard/sub"), t.m("hoard/sub2"))),
        Some(libc::EXDEV)
    );
    assert_eq!(
        errno_of(std::os::unix::fs::symlink("x", t.m("hoard/l2"))),
        Some(libc::EROFS)
    );
    // Writing a file the cache does not hold whole is impossible offline.
    assert_eq!(
        errno_of(fs::OpenOptions::new().append(true).open(t.m("uncached"))),
        Some(libc::EIO)
    );

    let out = go_online(&t.mnt);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let h = t.stats().health;
    assert!(h.online && h.log_pending == 0 && h.conflicts == 0, "{h:?}");
    assert!(h.log_replayed >= 10, "{h:?}");
    let dot = |root: &Path| {
        shape(root)
            .into_iter()
            .filter(|l| !l.contains("hoardfs-"))
            .count()
    };
    assert_replayed(&t, &expected, "after replay");
    assert_eq!(dot(&t.src), shape(&t.src).len(), "no temporary files left");
    assert!(!t.cache.join("conflicts.log").exists());
}

#[test]
fn a_file_changed_on_both_sides_ends_as_two_files_and_a_report() {
    let t = log_mount(&[]);
    assert!(hoardfs(&["offline"], &t.mnt).status.success());
    fs::write(t.m("hoard/f1"), b"mount's version\n").unwrap();
    fs::remove_file(t.m("hoard/f2")).unwrap();
    fs::rename(t.m("hoard/f3"), t.m("hoard/f3.new")).unwrap();
    fs::write(t.m("hoard/f10"), b"mount's f10\n").unwrap();
    // Meanwhile, on the source:
    fs::write(t.s("hoard/f1"), b"source's version\n").unwrap();
    fs::write(t.s("hoard/f2"), b"source changed what the mount deleted\n").unwrap();
    fs::write(t.s("hoard/f3"), b"source changed what the mount renamed\n").unwrap();
    fs::remove_file(t.s("hoard/f10")).unwrap();

    let out = go_online(&t.mnt);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let h = t.stats().health;
    assert_eq!(
        (h.online, h.log_pending, h.conflicts),
        (true, 0, 4),
        "{h:?}"
    );
    // Both versions of f1; the source's under the name.
    assert_eq!(fs::read(t.s("hoard/f1")).unwrap(), b"source's version\n");
    let copies = |prefix: &str| -> Vec<PathBuf> {
        fs::read_dir(t.s("hoard"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                let n = p.file_name().unwrap().to_string_lossy().to_string();
                n.starts_with(&format!("{prefix}.hoardfs-conflict-"))
            })
            .collect()
    };
    let f1 = copies("f1");
    assert_eq!(f1.len(), 1, "{f1:?}");
    assert_eq!(fs::read(&f1[0]).unwrap(), b"mount's version\n");
    // A deletion and a rename of files changed on the source are not done.
    assert_eq!(
        fs::read(t.s("hoard/f2")).unwrap(),
        b"source changed what the mount deleted\n"
    );
    assert_eq!(
        fs::read(t.s("hoard/f3")).unwrap(),
        b"source changed what the mount renamed\n"
    );
    assert!(!t.s("hoard/f3.new").exists());
    // A file deleted on the source but written offline comes back beside its name.
    assert!(!t.s("hoard/f10").exists());
    let f10 = copies("f10");
    assert_eq!(f10.len(), 1, "{f10:?}");
    assert_eq!(fs::read(&f10[0]).unwrap(), b"mount's f10\n");
    let report = fs::read_to_string(t.cache.join("conflicts.log")).unwrap();
    assert_eq!(report.lines().count(), 4, "{report}");
    for name in ["hoard/f1", "hoard/f2", "hoard/f3", "hoard/f10"] {
        assert!(report.contains(name), "{name} not in {report}");
    }
    // The mount shows the source's versions now.
    assert_eq!(fs::read(t.m("hoard/f1")).unwrap(), b"source's version\n");
    assert_eq!(
        fs::read(t.mnt.join(f1[0].strip_prefix(&t.src).unwrap())).unwrap(),
        b"mount's version\n"
    );
}

#[test]
fn a_crash_during_replay_loses_and_repeats_nothing() {
    // Crash right after the k-th change reached the source, before replay recorded it;
    // the next daemon resumes the replay on its own.
    let mut k = 1;
    loop {
        let mut t = log_mount(&[]);
        let expected = t.base().join("expected");
        copy_tree(&t.src, &expected);
        offline_edits(&expected);
        assert!(hoardfs(&["offline"], &t.mnt).status.success());
        offline_edits(&t.mnt);
        let pending = t.stats().health.log_pending;
        t.unmount();
        t.env = vec![("HOARDFS_FAILPOINT_REPLAY_ABORT".into(), k.to_string())];
        // Started online with changes pending: the probe replays them, and the failpoint
        // kills the daemon after the k-th.
        t.extra_args = vec!["--offline-writes".into(), "log".into()];
        t.mount();
        wait_until(Duration::from_secs(10), "the failpoint fired", || {
            fs::read_to_string("/proc/self/mountinfo").is_ok()
                && hoardfs::control::request_stats(&t.mnt).is_err()
        });
        t.crash();
        t.env.clear();
        t.mount();
        wait_until(
            Duration::from_secs(10),
            "replay resumed and finished",
            || {
                let h = t.stats().health;
                h.online && h.log_pending == 0
            },
        );
        let h = t.stats().health;
        assert_eq!(h.conflicts, 0, "crash after change {k}: {h:?}");
        assert_replayed(&t, &expected, &format!("crash after change {k}"));
        k += std::env::var("HOARDFS_REPLAY_CRASH_STEP").map_or(3, |v| v.parse().unwrap()); // every third instant keeps CI short; the changes are of all kinds
        if k > pending {
            break;
        }
    }
}

#[test]
fn a_dead_source_comes_back_and_gets_the_changes_made_while_it_was_away() {
    let (d, mut source, m) = over_fuse_source(&["--offline-writes", "log"]);
    fs::create_dir(source.real.join("hoard/empty")).unwrap();
    assert!(hoardfs(&["warm"], &m.m("hoard")).status.success());
    fs::read_dir(m.m("hoard/empty")).unwrap().for_each(drop);
    let expected = d.path().join("expected");
    copy_tree(&source.real, &expected);
    offline_edits(&expected);

    source.kill();
    wait_until(Duration::from_secs(10), "offline", || {
        let _ = fs::read(m.m("uncached"));
        !m.online()
    });
    offline_edits(&m.mnt);
    assert_eq!(shape(&m.m("hoard")), shape(&expected.join("hoard")));
    source.spawn();
    wait_until(
        Duration::from_secs(10),
        "back online, the changes replayed",
        || m.online(),
    );
    assert_eq!(
        shape(&source.real.join("hoard")),
        shape(&expected.join("hoard"))
    );
    assert_eq!(shape(&m.m("hoard")), shape(&expected.join("hoard")));
}

mod offline_model {
    //! Random sequences of the changes supported offline, made to an offline mount and to
    //! a plain directory: every call answers alike, the mount shows the plain directory's
    //! tree, and after reconnection so does the source.
    use super::*;
    use proptest::prelude::*;
    use std::os::unix::fs::PermissionsExt;

    const FILES: &[&str] = &["a", "b", "c", "d/x", "d/y", "e/z"];
    const DIRS: &[&str] = &["d", "e", "f"];

    #[derive(Clone, Debug)]
    enum Change {
        Write {
            path: usize,
            data: Vec<u8>,
            append: bool,
        },
        Truncate {
            path: usize,
            len: u64,
        },
        Rename {
            from: usize,
            to: usize,
        },
        Unlink(usize),
        Mkdir(usize),
        Rmdir(usize),
        Chmod {
            path: usize,
            mode: u32,
        },
    }

    fn change() -> impl Strategy<Value = Change> {
        let f = 0..FILES.len();
        let d = 0..DIRS.len();
        prop_oneof![
            3 => (f.clone(), proptest::collection::vec(any::<u8>(), 0..300), any::<bool>())
                .prop_map(|(path, data, append)| Change::Write { path, data, append }),
            1 => (f.clone(), 0..400u64).prop_map(|(path, len)| Change::Truncate { path, len }),
            2 => (f.clone(), f.clone()).prop_map(|(from, to)| Change::Rename { from, to }),
            1 => f.clone().prop_map(Change::Unlink),
            1 => d.clone().prop_map(Change::Mkdir),
            1 => d.prop_map(Change::Rmdir),
            1 => (f, prop_oneof![Just(0o600u32), Just(0o644), Just(0o755)])
                .prop_map(|(path, mode)| Change::Chmod { path, mode }),
        ]
    }

    fn apply(root: &Path, c: &Change) -> Result<(), i32> {
        use std::io::Write;
        let p = |i: usize| root.join("hoard").join(FILES[i]);
        let d = |i: usize| root.join("hoard").join(DIRS[i]);
        let r = match c {
            Change::Write { path, data, append } => fs::OpenOptions::new()
                .create(true)
                .write(true)
                .append(*append)
                .truncate(!*append)
                .open(p(*path))
                .and_then(|mut f| f.write_all(data)),
            Change::Truncate { path, len } => fs::OpenOptions::new()
                .write(true)
                .open(p(*path))
                .and_then(|f| f.set_len(*len)),
            Change::Rename { from, to } => fs::rename(p(*from), p(*to)),
            Change::Unlink(i) => fs::remove_file(p(*i)),
            Change::Mkdir(i) => fs::create_dir(d(*i)),
            Change::Rmdir(i) => fs::remove_dir(d(*i)),
            Change::Chmod { path, mode } => {
                fs::set_permissions(p(*path), fs::Permissions::from_mode(*mode))
            }
        };
        r.map_err(|e| e.raw_os_error().unwrap_or(-1))
    }

    fn run(changes: &[Change]) {
        let t = TestMount::new(&["--offline-writes", "log"]);
        t.expect_warnings();
        fs::create_dir_all(t.s("hoard/d")).unwrap();
        fs::write(t.s("hoard/a"), b"source a").unwrap();
        fs::write(t.s("hoard/d/x"), b"source d/x").unwrap();
        assert!(hoardfs(&["warm"], &t.m("hoard")).status.success());
        let reference = t.base().join("reference");
        copy_tree(&t.src, &reference);
        assert!(hoardfs(&["offline"], &t.mnt).status.success());
        for (i, c) in changes.iter().enumerate() {
            let want = apply(&reference, c);
            let got = apply(&t.mnt, c);
            assert_eq!(got, want, "change {i}: {c:?}");
        }
        assert_eq!(
            shape(&t.m("hoard")),
            shape(&reference.join("hoard")),
            "offline view"
        );
        let out = go_online(&t.mnt);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let h = t.stats().health;
        assert_eq!((h.log_pending, h.conflicts), (0, 0), "{h:?}");
        assert_replayed(&t, &reference, "after reconnection");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: std::env::var("HOARDFS_OFFLINE_MODEL_CASES").map_or(40, |v| v.parse().unwrap()), failure_persistence: None, ..ProptestConfig::default() })]
        #[test]
        fn offline_changes_match_a_plain_directory(changes in proptest::collection::vec(change(), 1..25)) {
            run(&changes);
        }
    }
}

#[test]
fn a_change_behind_an_offline_mount_does_not_lose_an_open_files_writes() {
    // The watcher sees the source change while the mount is offline; the source cannot
    // be asked, which once made the open file look deleted and its writes vanish.
    use std::io::Write;
    let t = log_mount(&[]);
    assert!(hoardfs(&["offline"], &t.mnt).status.success());
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(t.m("hoard/f1"))
        .unwrap();
    fs::write(t.s("hoard/f1"), b"changed behind the mount\n").unwrap();
    std::thread::sleep(Duration::from_millis(300)); // the watcher's batch
    f.write_all(b"written offline\n").unwrap();
    drop(f);
    assert!(t.stats().health.log_pending >= 1);
    let out = go_online(&t.mnt);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(t.stats().health.conflicts, 1);
    assert_eq!(
        fs::read(t.s("hoard/f1")).unwrap(),
        b"changed behind the mount\n"
    );
    let copy = fs::read_dir(t.s("hoard"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("f1.hoardfs-conflict-"))
        .expect("a conflict copy");
    assert_eq!(
        fs::read(copy).unwrap(),
        b"file 1\nfile 1\nwritten offline\n"
    );
}

/// The cache directory and the source path of `over_fuse_source`'s mount.
fn fuse_source_paths(d: &tempfile::TempDir) -> (PathBuf, PathBuf, PathBuf) {
    let base = fs::canonicalize(d.path()).unwrap();
    (base.join("src"), base.join("mnt"), base.join("cache"))
}

#[test]
fn a_share_not_mounted_at_start_means_an_offline_start_until_it_is() {
    let (d, mut source, m) = over_fuse_source(&[]);
    let (src, mnt, cache) = fuse_source_paths(&d);
    assert!(hoardfs(&["warm"], &m.m("hoard")).status.success());
    let before = snapshot(&m.m("hoard"));
    drop(m);
    // The share is gone: its mount point is an empty local directory. Serving that would
    // hide the cache (and put new files in the wrong place).
    source.kill();
    assert_eq!(fs::read_dir(&src).unwrap().count(), 0);
    let m = TestMountOver::mount(&src, &mnt, &cache, &[]);
    let h = hoardfs::control::request_stats(&mnt).unwrap().health;
    assert!(!h.online && !h.manual, "{h:?}");
    assert!(h.reason.contains("not mounted?"), "{h:?}");
    assert_eq!(snapshot(&m.m("hoard")), before);
    assert_eq!(
        errno_of(fs::write(m.m("hoard/new"), b"x")),
        Some(libc::EROFS)
    );
    assert_eq!(
        fs::read_dir(&src).unwrap().count(),
        0,
        "nothing written there"
    );
    source.spawn();
    wait_until(
        Duration::from_secs(10),
        "online once the share is mounted",
        || m.online(),
    );
    fs::write(m.m("hoard/new"), b"through the mount").unwrap();
    assert_eq!(
        fs::read(source.real.join("hoard/new")).unwrap(),
        b"through the mount"
    );
}

#[test]
fn a_dead_share_at_start_means_an_offline_start_until_it_is_back() {
    let (d, mut source, m) = over_fuse_source(&[]);
    let (src, mnt, cache) = fuse_source_paths(&d);
    assert!(hoardfs(&["warm"], &m.m("hoard")).status.success());
    let before = snapshot(&m.m("hoard"));
    drop(m);
    // The FUSE server dies and its mount stays: every call on the path fails ENOTCONN.
    if let Some(mut c) = source.child.take() {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    assert_eq!(errno_of(fs::read_dir(&src)), Some(libc::ENOTCONN));
    let m = TestMountOver::mount(&src, &mnt, &cache, &[]);
    assert!(!m.online());
    assert_eq!(snapshot(&m.m("hoard")), before);
    let _ = Command::new("umount").arg("-l").arg(&src).status();
    source.spawn();
    wait_until(
        Duration::from_secs(10),
        "online once the share is back",
        || m.online(),
    );
    assert_eq!(
        fs::read(m.m("uncached")).unwrap(),
        b"not warmed",
        "the source answers again"
    );
}

/// Runs `work` on a thread of its own and fails the test if it takes longer than `limit`
/// (a caller stuck in the kernel on a hung mount cannot be interrupted from here).
fn answers_within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(work());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within {limit:?}"),
    }
}

/// A FUSE source stopped (SIGSTOP) while a cached file is held open: every cached read,
/// through the held handle and through new opens, answers within the source timeout plus
/// 1 s, with the whole and right bytes (never a short or empty read).
#[test]
fn a_hung_source_never_blocks_reads_of_cached_files_through_held_handles() {
    use std::io::{Read, Seek, SeekFrom};
    use std::os::unix::fs::FileExt;
    let (_d, source, m) = over_fuse_source(&[]);
    for i in 0..20 {
        fs::write(source.real.join(format!("hoard/w{i}")), b"to write").unwrap();
    }
    assert!(hoardfs(&["warm"], &m.m("hoard")).status.success());
    let expect_deep = vec![7u8; 3 << 20];
    let expect_f3 = "file 3\n".repeat(4).into_bytes();
    // Held open across the hang: a large file and a small one.
    let mut held_deep = fs::File::open(m.m("hoard/sub/deep")).unwrap();
    let held_f3 = fs::File::open(m.m("hoard/f3")).unwrap();
    let mut buf = Vec::new();
    held_deep.read_to_end(&mut buf).unwrap();
    assert_eq!(buf, expect_deep);
    // More handles than the daemon has threads, closed while the source hangs: closing
    // their source descriptors must not take the daemon's threads with it.
    let many: Vec<fs::File> = (0..40)
        .map(|i| fs::File::open(m.m(&format!("hoard/f{}", i % 20))).unwrap())
        .collect();
    let writers: Vec<fs::File> = (0..20)
        .map(|i| {
            fs::OpenOptions::new()
                .write(true)
                .open(m.m(&format!("hoard/w{i}")))
                .unwrap()
        })
        .collect();
    source.signal(libc::SIGSTOP);
    drop(many);
    drop(writers);
    let limit = Duration::from_secs(1 + 1);

    // Over several seconds, so that open files' validation leases expire meanwhile.
    for round in 0..6 {
        std::thread::sleep(Duration::from_millis(700));
        let t0 = Instant::now();
        let mut deep = held_deep.try_clone().unwrap();
        let (e, mnt) = (expect_deep.clone(), m.mnt.clone());
        answers_within(
            limit,
            &format!("round {round}: the held large file"),
            move || {
                deep.seek(SeekFrom::Start(0)).unwrap();
                let mut b = Vec::new();
                deep.read_to_end(&mut b).unwrap();
                assert!(
                    b == e,
                    "held large file: {} bytes, not the cached ones",
                    b.len()
                );
            },
        );
        let f3 = held_f3.try_clone().unwrap();
        let e = expect_f3.clone();
        answers_within(
            limit,
            &format!("round {round}: the held small file"),
            move || {
                let mut b = vec![0u8; e.len() + 10];
                let n = f3.read_at(&mut b, 0).unwrap();
                assert_eq!(&b[..n], &e[..]);
            },
        );
        let e = expect_deep.clone();
        answers_within(limit, &format!("round {round}: a new open"), move || {
            assert!(fs::read(mnt.join("hoard/sub/deep")).unwrap() == e);
            assert_eq!(
                fs::read(mnt.join("hoard/f3")).unwrap(),
                "file 3\n".repeat(4).into_bytes()
            );
            fs::metadata(mnt.join("hoard/f7")).unwrap();
        });
        eprintln!("round {round}: {:?}", t0.elapsed());
    }
    drop((held_deep, held_f3));
    source.signal(libc::SIGCONT);
}

/// A change through the mount keeps the directory's saved listing (it is taken again
/// shortly after): the directory and its cached files stay readable offline, and a file
/// created through the mount is listed offline once the listing was taken again.
#[test]
fn a_create_through_the_mount_keeps_the_directory_readable_offline() {
    let t = TestMount::new(&[]);
    t.expect_warnings();
    fs::create_dir(t.s("d")).unwrap();
    fs::write(t.s("d/f1"), b"one").unwrap();
    fs::read_dir(t.m("d")).unwrap().for_each(drop);
    assert_eq!(fs::read(t.m("d/f1")).unwrap(), b"one");
    fs::write(t.m("d/new"), b"x").unwrap();
    // At once: the old listing answers.
    assert!(hoardfs(&["offline"], &t.mnt).status.success());
    assert_eq!(fs::read(t.m("d/f1")).unwrap(), b"one");
    fs::read_dir(t.m("d")).unwrap().for_each(drop);
    assert!(go_online(&t.mnt).status.success());
    // Shortly after: the new listing, with the new file.
    fs::write(t.m("d/new2"), b"y").unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(hoardfs(&["offline"], &t.mnt).status.success());
    assert_eq!(sorted_names(&t.m("d")), ["f1", "new", "new2"]);
    assert_eq!(fs::read(t.m("d/f1")).unwrap(), b"one");
    assert_eq!(fs::read(t.m("d/new2")).unwrap(), b"y");
}

/// What the mount writes in a tree nobody listed or read through it (a program that
/// makes its files by path) is reachable offline once the changed directory's listing was
/// taken again: that listing's ancestors are listed with it, as an open's are.
#[test]
fn files_created_in_a_tree_never_listed_are_reachable_offline() {
    let t = TestMount::new(&[]);
    t.expect_warnings();
    fs::create_dir_all(t.s("a/b")).unwrap();
    fs::write(t.m("a/b/new"), b"written through the mount").unwrap();
    let listings = t.cache.join("dirs");
    let count = || {
        fs::read_dir(&listings).map_or(0, |d| {
            let saved = |e: &fs::DirEntry| !e.file_name().to_string_lossy().ends_with(".tmp");
            d.filter(|e| e.as_ref().is_ok_and(saved)).count()
        })
    };
    // The root, `a` and `a/b`.
    wait_until(Duration::from_secs(10), "three listings saved", || {
        count() >= 3
    });
    assert!(hoardfs(&["offline"], &t.mnt).status.success());
    assert_eq!(
        fs::read(t.m("a/b/new")).unwrap(),
        b"written through the mount"
    );
    assert_eq!(sorted_names(&t.m("a/b")), ["new"]);
    assert_eq!(sorted_names(&t.m("a")), ["b"]);
    assert_eq!(sorted_names(&t.mnt), ["a"]);
}

/// Creates through the mount racing the `relist` thread's listing of their directory, and
/// switches offline racing it too. Each of these once left a created file unreachable
/// offline for good: a listing read before a create and saved after it taken for current
/// (nothing marked the directory changed again), a relisting cut off by the switch
/// offline dropped, and a listing decoded offline while the relisting saved a newer one
/// kept. A big directory widens the window between the read and the save; zero TTLs send
/// every offline look to the daemon's saved listings. `HOARDFS_RELIST_ROUNDS` (4) rounds.
#[test]
fn creates_racing_the_relisting_are_all_reachable_offline() {
    creates_racing_the_relisting(false);
}

/// The same with `--offline-writes=log`, and a file created offline right after each
/// switch: a relisting begun online and saved after that create once replaced the
/// listing the create had edited, and the file was gone from it.
#[test]
fn offline_creates_racing_a_relisting_stay_listed() {
    creates_racing_the_relisting(true);
}

fn creates_racing_the_relisting(offline_writes: bool) {
    let mut args = vec!["--entry-ttl", "0", "--attr-ttl", "0", "--negative-ttl", "0"];
    if offline_writes {
        args.extend(["--offline-writes", "log"]);
    }
    let t = TestMount::new(&args);
    t.expect_warnings();
    fs::create_dir(t.s("big")).unwrap();
    for i in 0..20_000 {
        fs::write(t.s(&format!("big/old{i}")), b"").unwrap();
    }
    // Listed once, so that a change is possible offline from the first round.
    for dir in ["", "big"] {
        fs::read_dir(t.m(dir)).unwrap().for_each(drop);
    }
    let rounds: u64 = std::env::var("HOARDFS_RELIST_ROUNDS").map_or(4, |v| v.parse().unwrap());
    for round in 0..rounds {
        // Creates every few ms, across relistings (each create a change of `big`); the
        // last one may land inside one.
        let t0 = Instant::now();
        let mut names = Vec::new();
        while t0.elapsed() < Duration::from_millis(700 + 97 * round) {
            names.push(format!("big/r{round}n{}", names.len()));
            fs::write(t.m(names.last().unwrap()), b"x").unwrap();
            std::thread::sleep(Duration::from_millis(7));
        }
        if offline_writes {
            // Made offline at once, while a relisting may be on its way; still there once
            // that has ended.
            assert!(hoardfs(&["offline"], &t.mnt).status.success());
            let made = format!("big/offline{round}");
            fs::write(t.m(&made), b"y").unwrap();
            std::thread::sleep(Duration::from_millis(500));
            assert!(
                fs::symlink_metadata(t.m(&made)).is_ok(),
                "round {round}: {made} made offline is gone from the listing"
            );
            assert!(go_online(&t.mnt).status.success());
            names.push(made);
        }
        // Within a few relistings every name is listed offline; a lost one never is.
        let missing = |t: &TestMount| {
            names.iter().find_map(|n| {
                fs::symlink_metadata(t.m(n))
                    .err()
                    .map(|e| format!("{n}: {e}"))
            })
        };
        let waited = Instant::now();
        let mut online_for = Duration::from_millis(300);
        let last = loop {
            std::thread::sleep(online_for);
            assert!(hoardfs(&["offline"], &t.mnt).status.success());
            let m = missing(&t);
            if m.is_none() || waited.elapsed() > Duration::from_secs(20) {
                break m;
            }
            // Long enough for a relisting to run whole (a switch offline cuts it off).
            online_for = Duration::from_secs(1);
            assert!(go_online(&t.mnt).status.success());
        };
        assert_eq!(
            last,
            None,
            "round {round}: not listed offline ({} created)",
            names.len()
        );
        assert!(go_online(&t.mnt).status.success());
    }
}

/// One call on a held descriptor, as the hang test issues it: its name and the call.
type FdCall = (&'static str, fn(i32) -> std::io::Result<()>);

/// The calls issued on every held handle while the source hangs.
fn calls_on_a_held_handle() -> Vec<FdCall> {
    fn check(r: i64) -> std::io::Result<()> {
        if r < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
    fn lock(fd: i32, cmd: i32) -> std::io::Result<()> {
        // A write lock where the descriptor allows one (the kernel refuses it otherwise).
        let writable = unsafe { libc::fcntl(fd, libc::F_GETFL) } & libc::O_ACCMODE != 0;
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = if writable {
            libc::F_WRLCK
        } else {
            libc::F_RDLCK
        } as i16;
        fl.l_whence = libc::SEEK_SET as i16;
        fl.l_start = 100;
        fl.l_len = 10;
        check(unsafe { libc::fcntl(fd, cmd, &mut fl) } as i64)
    }
    vec![
        ("fstat", |fd| {
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            check(unsafe { libc::fstat(fd, &mut st) } as i64)
        }),
        ("fsync", |fd| check(unsafe { libc::fsync(fd) } as i64)),
        ("fdatasync", |fd| {
            check(unsafe { libc::fdatasync(fd) } as i64)
        }),
        ("write", |fd| {
            let b = b"during the hang";
            check(unsafe { libc::pwrite(fd, b.as_ptr().cast(), b.len(), 4096) } as i64)
        }),
        ("ftruncate", |fd| {
            check(unsafe { libc::ftruncate(fd, 8192) } as i64)
        }),
        ("fallocate", |fd| {
            check(unsafe { libc::fallocate(fd, 0, 0, 8192) } as i64)
        }),
        ("SEEK_DATA", |fd| {
            check(unsafe { libc::lseek(fd, 0, libc::SEEK_DATA) })
        }),
        ("SEEK_HOLE", |fd| {
            check(unsafe { libc::lseek(fd, 0, libc::SEEK_HOLE) })
        }),
        ("F_SETLK", |fd| lock(fd, libc::F_SETLK)),
        ("F_GETLK", |fd| lock(fd, libc::F_GETLK)),
        ("F_OFD_SETLK", |fd| lock(fd, libc::F_OFD_SETLK)),
        ("flock", |fd| {
            check(unsafe { libc::flock(fd, libc::LOCK_SH | libc::LOCK_NB) } as i64)
        }),
        ("fchmod", |fd| {
            check(unsafe { libc::fchmod(fd, 0o644) } as i64)
        }),
        ("fgetxattr", |fd| {
            let mut b = [0u8; 64];
            let name = c"user.hoardfs-test";
            let r = unsafe { libc::fgetxattr(fd, name.as_ptr(), b.as_mut_ptr().cast(), 64) };
            check(r as i64)
        }),
        // Closing any descriptor of a file drops the process's POSIX locks on it: FLUSH.
        ("close", |fd| {
            let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
            check(dup as i64)?;
            check(unsafe { libc::close(dup) } as i64)
        }),
    ]
}

/// A FUSE source stopped (SIGSTOP) while file handles are held open, read-only and
/// writable, cached and not, one of them holding a POSIX lock: every call on each of them
/// (attributes, syncs, a write, truncation, allocation, holes, locks, mode, xattrs, close)
/// answers, with success or an errno, within the source timeout plus 1 s, all issued at
/// once from many more threads than the daemon has request threads, while cached reads
/// through other handles keep answering as fast. After SIGCONT the mount comes back and
/// every write acknowledged, before the hang or during it, is on the source.
#[test]
fn a_hung_source_never_blocks_calls_on_held_handles() {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    // Locks forwarded to the source's own file system: bindfs then answers every close
    // (FLUSH) and every lock itself, and a stopped bindfs hangs them.
    let (_d, source, m) = over_fuse_source_with(
        &["--multithreaded", "--enable-lock-forwarding"],
        &["-o", "threads=2", "-o", "whole_file_threshold=4096"],
    );
    let big = vec![3u8; 256 << 10];
    fs::write(source.real.join("big"), &big).unwrap();
    assert!(hoardfs(&["warm"], &m.m("hoard")).status.success());
    let open = |rel: &str, write: bool| {
        fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(m.m(rel))
            .unwrap()
    };
    let new = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(m.m("hoard/new"))
        .unwrap();
    let held: Vec<(&str, &str, fs::File)> = vec![
        ("cached read-only", "hoard/f3", open("hoard/f3", false)),
        ("uncached read-only", "big", open("big", false)),
        ("cached writable", "hoard/f4", open("hoard/f4", true)),
        ("uncached writable", "hoard/new", new),
        ("locked", "hoard/f5", open("hoard/f5", true)),
    ];
    // Acknowledged before the hang: on the source afterwards, whatever happens meanwhile.
    let acked = b"acknowledged before the hang";
    for (_, _, f) in &held[2..] {
        f.write_all_at(acked, 0).unwrap();
    }
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_len = 50;
    let locked_fd = held[4].2.as_raw_fd();
    assert_eq!(unsafe { libc::fcntl(locked_fd, libc::F_SETLK, &fl) }, 0);
    // Cached files read through other handles: one of them a daemon read (the file is
    // open for writing, so no passthrough), the other passthrough.
    let expect_f4 = fs::read(source.real.join("hoard/f4")).unwrap();
    let readers: Vec<(fs::File, Vec<u8>)> = vec![
        (open("hoard/f4", false), expect_f4),
        (open("hoard/sub/deep", false), vec![7u8; 3 << 20]),
    ];
    let held: Vec<(&str, &str, Arc<fs::File>)> = held
        .into_iter()
        .map(|(what, rel, f)| (what, rel, Arc::new(f)))
        .collect();

    source.signal(libc::SIGSTOP);
    let limit = Duration::from_secs(1 + 1);
    let t0 = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    let mut issued = 0;
    for (what, _, f) in &held {
        for (call, run) in calls_on_a_held_handle() {
            let (tx, f, what) = (tx.clone(), f.clone(), *what);
            issued += 1;
            std::thread::spawn(move || {
                let t = Instant::now();
                let r = run(f.as_raw_fd()).map_err(|e| e.raw_os_error().unwrap_or(0));
                // Before the answer: the handle's close below is its last.
                drop(f);
                let _ = tx.send((what, call, r, t.elapsed()));
            });
        }
    }
    let reading = Arc::new(AtomicBool::new(true));
    let read_threads: Vec<_> = readers
        .into_iter()
        .map(|(f, expect)| {
            let reading = reading.clone();
            std::thread::spawn(move || {
                let mut slowest = Duration::ZERO;
                while reading.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let mut b = vec![0u8; expect.len()];
                    let n = f.read_at(&mut b, 0).unwrap();
                    slowest = slowest.max(t.elapsed());
                    assert!(b[..n] == expect[..n] && n > 0, "a cached read changed");
                    std::thread::sleep(Duration::from_millis(20));
                }
                slowest
            })
        })
        .collect();
    let mut answers = Vec::new();
    while answers.len() < issued {
        match rx.recv_timeout(
            (t0 + limit + Duration::from_millis(500)).saturating_duration_since(Instant::now()),
        ) {
            Ok(a) => answers.push(a),
            Err(_) => break,
        }
    }
    // The handles themselves closed while the source still hangs.
    let mut closes = Vec::new();
    for (what, _, f) in held.iter() {
        let f = f.clone();
        assert!(
            Arc::strong_count(&f) == 2 || answers.len() < issued,
            "{what}: the close is the last"
        );
        let t = Instant::now();
        let (ctx, crx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(f);
            let _ = ctx.send(());
        });
        closes.push((*what, t, crx));
    }
    let (held_rels, _): (Vec<_>, Vec<_>) = held.iter().map(|(w, r, _)| ((*w, *r), ())).unzip();
    drop(held);
    let closed: Vec<(&str, bool)> = closes
        .into_iter()
        .map(|(what, t, crx)| {
            let left = (t + limit).saturating_duration_since(Instant::now());
            (what, crx.recv_timeout(left).is_ok())
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    reading.store(false, Ordering::Relaxed);
    // Joined side by side, each within `limit` of now: a reader stuck in the kernel
    // cannot be joined at all.
    let joined: Vec<_> = read_threads
        .into_iter()
        .map(|t| {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(t.join());
            });
            rx
        })
        .collect();
    let end = Instant::now() + limit;
    let slowest_reads: Vec<Option<Duration>> = joined
        .into_iter()
        .map(|rx| {
            let left = end.saturating_duration_since(Instant::now());
            rx.recv_timeout(left).ok().and_then(|r| r.ok())
        })
        .collect();
    let hang = t0.elapsed();
    source.signal(libc::SIGCONT);

    let mut table: Vec<String> = answers
        .iter()
        .map(|(what, call, r, took)| {
            let r = match r {
                Ok(()) => "ok".to_string(),
                Err(e) => std::io::Error::from_raw_os_error(*e).to_string(),
            };
            format!("{what:>20} {call:>12}: {r} in {took:.2?}")
        })
        .collect();
    table.sort();
    eprintln!("hang of {hang:.2?}:\n{}", table.join("\n"));
    eprintln!("closes: {closed:?}; slowest cached reads: {slowest_reads:?}");
    assert_eq!(
        answers.len(),
        issued,
        "calls with no answer within {limit:?}"
    );
    for (what, call, _, took) in &answers {
        assert!(*took <= limit, "{what} {call}: {took:?}");
    }
    for (what, ok) in &closed {
        assert!(ok, "closing the {what} handle: no answer within {limit:?}");
    }
    // An open file's attributes are known offline too, also those of a file created
    // through the mount since its directory was last listed.
    for (what, call, r, _) in &answers {
        assert!(*call != "fstat" || r.is_ok(), "{what} fstat: {r:?}");
    }
    for slowest in &slowest_reads {
        assert!(
            slowest.is_some_and(|s| s <= limit),
            "cached reads: {slowest_reads:?}"
        );
    }

    // Back online: every acknowledged write is on the source, and the mount shows it.
    wait_until(Duration::from_secs(10), "back online by itself", || {
        m.online()
    });
    let written_during: Vec<&str> = answers
        .iter()
        .filter(|(_, call, r, _)| *call == "write" && r.is_ok())
        .map(|(what, ..)| *what)
        .collect();
    for (what, rel) in &held_rels[2..] {
        let on_source = fs::read(source.real.join(rel)).unwrap();
        assert_eq!(&on_source[..acked.len()], acked, "{what}: lost a write");
        if written_during.contains(what) {
            let during = b"during the hang";
            assert_eq!(&on_source[4096..4096 + during.len()], during, "{what}");
        }
        assert_eq!(
            fs::read(m.m(rel)).unwrap(),
            on_source,
            "{what} through the mount"
        );
    }
    assert_eq!(fs::read(m.m("big")).unwrap(), big);
    fs::write(m.m("hoard/after"), b"after the hang").unwrap();
    assert_eq!(
        fs::read(source.real.join("hoard/after")).unwrap(),
        b"after the hang"
    );
}

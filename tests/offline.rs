//! Disconnected operation: what was warmed stays readable when the source is switched off,
//! stops answering or dies; the rest fails promptly; the mount comes back by itself.

mod common;

use std::fs;
use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use common::{BIN, TestMount, is_mounted};

/// Everything `ls -lR` would show of a tree: path, type, mode, size, mtime, link target,
/// and the contents of regular files.
fn snapshot(root: &Path) -> Vec<String> {
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
                format!("{:?}", fs::read(&p).unwrap())
            };
            out.push(format!(
                "{rel} {:o} {} {} {what}",
                m.mode(),
                m.len(),
                m.mtime()
            ));
        }
    }
    out
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

fn errno_of(r: std::io::Result<impl Sized>) -> Option<i32> {
    r.err().and_then(|e| e.raw_os_error())
}

fn within(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let t = Instant::now();
    while !cond() {
        assert!(t.elapsed() < limit, "not within {limit:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn switched_offline_the_mount_serves_what_was_warmed() {
    let t = TestMount::new(&[]);
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
    assert!(hoardfs(&["online"], &t.mnt).status.success());
    assert!(t.stats().health.online);
    assert_eq!(fs::read(t.m("hoard/f3")).unwrap(), b"changed while offline");
    assert_eq!(fs::read(t.m("uncached")).unwrap(), b"not warmed");
    fs::write(t.m("hoard/new"), b"x").unwrap();
    assert_eq!(fs::read(t.s("hoard/new")).unwrap(), b"x");
}

#[test]
fn an_offline_start_serves_the_cache_of_an_earlier_mount() {
    let mut t = TestMount::new(&[]);
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
    child: Option<Child>,
}

impl FuseSource {
    fn start(real: &Path, at: &Path) -> FuseSource {
        let mut s = FuseSource {
            real: real.to_path_buf(),
            at: at.to_path_buf(),
            child: None,
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let child = Command::new("bindfs")
            .arg("-f")
            .arg(&self.real)
            .arg(&self.at)
            .spawn()
            .expect("bindfs (apt-get install bindfs)");
        self.child = Some(child);
        within(Duration::from_secs(10), "bindfs mounted", || {
            fs::read_to_string("/proc/self/mountinfo")
                .unwrap()
                .lines()
                .any(|l| l.split(' ').nth(4) == self.at.to_str())
        });
    }

    fn signal(&self, sig: i32) {
        let pid = self.child.as_ref().unwrap().id() as i32;
        unsafe { libc::kill(pid, sig) };
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
fn over_fuse_source() -> (tempfile::TempDir, FuseSource, TestMountOver) {
    let d = tempfile::tempdir().unwrap();
    let base = fs::canonicalize(d.path()).unwrap();
    let (real, src, mnt) = (base.join("real"), base.join("src"), base.join("mnt"));
    for p in [&real, &src, &mnt] {
        fs::create_dir(p).unwrap();
    }
    make_tree(&real);
    let source = FuseSource::start(&real, &src);
    let m = TestMountOver::mount(&src, &mnt, &base.join("cache"));
    (d, source, m)
}

/// A foreground hoardfs over a given source, unmounted on drop.
struct TestMountOver {
    mnt: PathBuf,
    child: Child,
}

impl TestMountOver {
    fn mount(src: &Path, mnt: &Path, cache: &Path) -> TestMountOver {
        let child = Command::new(BIN)
            .arg(src)
            .arg(mnt)
            .arg("--cache-dir")
            .arg(cache)
            .args(["-f", "--source-timeout", "1"])
            .spawn()
            .unwrap();
        within(Duration::from_secs(10), "hoardfs mounted", || {
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
    let (_d, source, m) = over_fuse_source();
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
    within(Duration::from_secs(10), "back online by itself", || {
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
    let (_d, mut source, m) = over_fuse_source();
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
    within(Duration::from_secs(10), "back online by itself", || {
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

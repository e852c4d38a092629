//! Faults of the cache's and the source's file systems, made with small tmpfs mounts:
//! a full cache (ENOSPC), a read-only cache, a full source, a read-only source and a source
//! unmounted lazily under the mount; and a source disk that fails reads (EIO), made with a
//! loop device whose backing file is cut short; and a source that denies access (EACCES),
//! a bindfs without the capability to override modes. Needs root; skipped otherwise.

mod common;

use std::fs;
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{TestMount, pattern};

/// A tmpfs of `size` mounted on a fresh directory, unmounted (lazily if busy) on drop.
struct Tmpfs {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Tmpfs {
    fn new(size: &str) -> Tmpfs {
        let dir = tempfile::Builder::new()
            .prefix("hoardfs-tmpfs")
            .tempdir()
            .unwrap();
        let path = dir.path().join("fs");
        fs::create_dir(&path).unwrap();
        let st = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0755"),
                "hoardfs-test",
            ])
            .arg(&path)
            .status()
            .unwrap();
        assert!(st.success(), "mount tmpfs");
        Tmpfs { _dir: dir, path }
    }

    /// Remounts with `opts`, retrying while releases of files open for writing (FUSE
    /// releases are asynchronous) keep a read-only remount busy.
    fn remount(&self, opts: &str) {
        for _ in 0..100 {
            let out = Command::new("mount")
                .args(["-o", &format!("remount,{opts}")])
                .arg(&self.path)
                .output()
                .unwrap();
            if out.status.success() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("remount {opts} failed");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let quiet = |args: &[&str]| {
            Command::new("umount")
                .args(args)
                .arg(&self.path)
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        if !quiet(&[]) {
            quiet(&["-l"]);
        }
    }
}

fn root() -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    eprintln!("skipped: needs root");
    false
}

fn errno_of<T>(r: std::io::Result<T>) -> i32 {
    r.err().and_then(|e| e.raw_os_error()).unwrap_or(0)
}

/// Runs `f` and asserts it returns within `secs` (the mount is not wedged).
fn bounded<T>(secs: u64, what: &str, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let r = f();
    assert!(
        start.elapsed() < Duration::from_secs(secs),
        "{what} took {:?}",
        start.elapsed()
    );
    r
}

fn cached(t: &TestMount, name: &str) -> bool {
    fs::read(t.c(name))
        .map(|b| b == fs::read(t.s(name)).unwrap())
        .unwrap_or(false)
}

#[test]
fn a_full_or_read_only_cache_degrades_to_the_source_and_recovers() {
    if !root() {
        return;
    }
    // Declared first, dropped last: after the daemon is gone.
    let cachefs = Tmpfs::new("1m");
    let mut t = TestMount::unmounted_at(
        "mnt",
        &[
            "--whole-file-threshold",
            "256K",
            "--chunk-size",
            "64K",
            // Limits far above the file system's size: the file system itself fills up.
            "--cache-size",
            "1G",
            "--min-free",
            "0",
        ],
    );
    t.cache = cachefs.path.join("cache");
    // A full and a read-only cache: the daemon says what it could not cache.
    t.expect_warnings();
    t.mount();
    let t = &mut t;
    for i in 0..6 {
        fs::write(t.s(&format!("f{i}")), pattern(200_000, i)).unwrap();
    }
    fs::write(t.s("big"), pattern(2_000_000, 99)).unwrap();

    // Full: every read and write still succeeds, from and to the source.
    for i in 0..6 {
        let name = format!("f{i}");
        assert!(
            fs::read(t.m(&name)).unwrap() == pattern(200_000, i),
            "{name}"
        );
    }
    assert!(fs::read(t.m("big")).unwrap() == pattern(2_000_000, 99));
    let mut f = fs::File::create(t.m("new")).unwrap();
    for k in 0..20 {
        f.write_all(&pattern(100_000, 500 + k)).unwrap();
    }
    f.sync_all().unwrap();
    drop(f);
    assert_eq!(fs::metadata(t.s("new")).unwrap().len(), 2_000_000);
    assert!(fs::read(t.m("new")).unwrap() == fs::read(t.s("new")).unwrap());
    let errors_full = t.stats().cache.cache_errors;
    assert!(errors_full > 0, "a full cache file system was not reported");
    assert!(!cached(t, "big"), "2 MB cannot be in a 1 MB cache");

    // Read-only: same, for reads, writes and namespace operations. A running daemon keeps
    // its lock and log open for writing, so the cache file system cannot be remounted
    // read-only under it (EBUSY); what it can meet is a cache tree it cannot modify:
    // every file and directory of the cache made immutable (EPERM on any change).
    let chattr = |flag: &str| {
        for sub in ["data", "meta"] {
            let st = Command::new("chattr")
                .args(["-R", flag])
                .arg(t.cache.join(sub))
                .status()
                .unwrap();
            assert!(st.success(), "chattr {flag}");
        }
    };
    chattr("+i");
    fs::write(t.s("g"), pattern(100_000, 7)).unwrap();
    assert!(fs::read(t.m("g")).unwrap() == pattern(100_000, 7));
    fs::write(t.m("h"), b"written while the cache is read-only").unwrap();
    assert_eq!(
        fs::read(t.s("h")).unwrap(),
        b"written while the cache is read-only"
    );
    fs::rename(t.m("f0"), t.m("f0-renamed")).unwrap();
    fs::remove_file(t.m("f1")).unwrap();
    assert!(fs::read(t.m("f0-renamed")).unwrap() == pattern(200_000, 0));
    // What the read-only cache still holds for the removed and renamed names is never
    // served for new files under those names.
    fs::write(t.m("f1"), b"a new f1").unwrap();
    assert_eq!(fs::read(t.m("f1")).unwrap(), b"a new f1");
    fs::write(t.s("f0"), b"a new f0").unwrap();
    assert_eq!(fs::read(t.m("f0")).unwrap(), b"a new f0");
    assert!(
        t.stats().cache.cache_errors > errors_full,
        "a read-only cache was not reported"
    );

    // Space returns and the cache is writable again: caching resumes, nothing stale.
    chattr("-i");
    cachefs.remount("size=64m");
    fs::write(t.s("later"), pattern(300_000, 8)).unwrap();
    assert!(fs::read(t.m("later")).unwrap() == pattern(300_000, 8));
    assert!(fs::read(t.m("big")).unwrap() == pattern(2_000_000, 99));
    assert!(cached(t, "later"), "caching did not resume");
    assert!(cached(t, "big"), "caching did not resume");
    for name in ["f0", "f1", "f0-renamed", "g", "h", "new"] {
        assert!(
            fs::read(t.m(name)).unwrap() == fs::read(t.s(name)).unwrap(),
            "{name}"
        );
    }
    t.unmount();
    t.mount();
    for name in ["f0", "f1", "f0-renamed", "g", "h", "new", "big", "later"] {
        assert!(
            fs::read(t.m(name)).unwrap() == fs::read(t.s(name)).unwrap(),
            "{name} after remount"
        );
    }
}

#[test]
fn source_faults_return_their_errno_and_wedge_nothing() {
    if !root() {
        return;
    }
    let srcfs = Tmpfs::new("1m");
    let mut t = TestMount::unmounted_at("mnt", &[]);
    t.src = srcfs.path.clone();
    t.mount();
    let t = &mut t;
    fs::write(t.s("keep"), b"kept").unwrap();

    // ENOSPC from the source reaches the writer; other operations go on.
    let mut f = fs::File::create(t.m("fill")).unwrap();
    let mut r = Ok(());
    for _ in 0..40 {
        r = f.write_all(&[7u8; 64 << 10]).and_then(|_| f.flush());
        if r.is_err() {
            break;
        }
    }
    let r = r.and_then(|_| f.sync_all());
    assert_eq!(errno_of(r), libc::ENOSPC);
    drop(f);
    assert_eq!(fs::read(t.m("keep")).unwrap(), b"kept");
    assert_eq!(
        errno_of(fs::create_dir(t.m("d")).and_then(|_| {
            // tmpfs may still have an inode for a directory: fill the rest with a file.
            fs::write(t.m("d/x"), vec![1u8; 1 << 20])
        })),
        libc::ENOSPC
    );
    // The source's view of the file is what the mount serves.
    assert!(fs::read(t.m("fill")).unwrap() == fs::read(t.s("fill")).unwrap());
    fs::remove_file(t.m("fill")).unwrap();
    // The space comes back once every descriptor of the unlinked file is closed; FUSE
    // releases are asynchronous, so give the daemon's a moment.
    let deadline = Instant::now() + Duration::from_secs(5);
    while let Err(e) = fs::write(t.m("after"), b"room again") {
        assert!(
            e.raw_os_error() == Some(libc::ENOSPC) && Instant::now() < deadline,
            "{e}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(fs::read(t.s("after")).unwrap(), b"room again");

    // A read-only source: EROFS for writes, reads still served.
    srcfs.remount("ro");
    assert_eq!(errno_of(fs::write(t.m("new"), b"x")), libc::EROFS);
    assert_eq!(
        errno_of(fs::OpenOptions::new().write(true).open(t.m("keep"))),
        libc::EROFS
    );
    assert_eq!(errno_of(fs::rename(t.m("keep"), t.m("k2"))), libc::EROFS);
    assert_eq!(errno_of(fs::remove_file(t.m("after"))), libc::EROFS);
    assert_eq!(fs::read(t.m("keep")).unwrap(), b"kept");
    srcfs.remount("rw");

    // The source vanishes (lazy unmount): the daemon keeps its detached tree; every
    // operation answers promptly, and the mount unmounts cleanly.
    let st = Command::new("umount")
        .arg("-l")
        .arg(&t.src)
        .status()
        .unwrap();
    assert!(st.success());
    bounded(5, "read after the source vanished", || {
        let _ = fs::read(t.m("keep"));
    });
    bounded(5, "write after the source vanished", || {
        let _ = fs::write(t.m("w"), b"x");
    });
    bounded(5, "listing after the source vanished", || {
        let _ = fs::read_dir(&t.mnt).map(|d| d.count());
    });
    assert!(
        t.stats().requests["lookup"] > 0,
        "the daemon stopped answering"
    );
    t.unmount();
}

/// ext4 on a loop device whose backing file is then cut short: reads of blocks beyond the
/// cut fail in the block layer, and the file system answers EIO, as a failing disk does.
struct ShrunkDisk {
    _dir: tempfile::TempDir,
    image: PathBuf,
    path: PathBuf,
    dev: String,
}

impl ShrunkDisk {
    fn new() -> Option<ShrunkDisk> {
        let dir = tempfile::Builder::new()
            .prefix("hoardfs-eio")
            .tempdir()
            .unwrap();
        let image = dir.path().join("disk.img");
        let path = dir.path().join("fs");
        fs::create_dir(&path).unwrap();
        fs::File::create(&image).unwrap().set_len(64 << 20).unwrap();
        let mkfs = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"])
            .arg(&image)
            .status();
        if !mkfs.is_ok_and(|s| s.success()) {
            eprintln!("skipped: mkfs.ext4 (e2fsprogs) not available");
            return None;
        }
        let out = Command::new("losetup")
            .args(["--find", "--show", "--direct-io=on"])
            .arg(&image)
            .output()
            .unwrap();
        if !out.status.success() {
            eprintln!("skipped: no loop device");
            return None;
        }
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let disk = ShrunkDisk {
            _dir: dir,
            image,
            path,
            dev,
        };
        let st = Command::new("mount")
            .arg(&disk.dev)
            .arg(&disk.path)
            .status()
            .unwrap();
        assert!(st.success(), "mount {}", disk.dev);
        Some(disk)
    }

    /// Cuts the backing file to `len` bytes and drops its files' pages from the page cache
    /// (theirs only: no drop_caches), so reads reach the (now partly missing) device.
    fn cut(&self, len: u64) {
        fs::OpenOptions::new()
            .write(true)
            .open(&self.image)
            .unwrap()
            .set_len(len)
            .unwrap();
        let _ = Command::new("losetup")
            .args(["--set-capacity", &self.dev])
            .status();
        for e in fs::read_dir(&self.path).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() {
                let f = fs::File::open(&p).unwrap();
                rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
            }
        }
    }
}

impl Drop for ShrunkDisk {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.path)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
        let _ = Command::new("losetup").args(["-d", &self.dev]).status();
    }
}

#[test]
fn a_source_disk_that_fails_reads_gives_eio_and_nothing_else_breaks() {
    if !root() {
        return;
    }
    let Some(disk) = ShrunkDisk::new() else {
        return;
    };
    // A file written last lands high on the device; the small one low.
    fs::write(disk.path.join("small"), b"low blocks").unwrap();
    fs::write(disk.path.join("big"), pattern(40 << 20, 3)).unwrap();
    Command::new("sync").status().unwrap();
    let mut t = TestMount::unmounted_at("mnt", &[]);
    t.src = disk.path.clone();
    t.mount();
    assert_eq!(fs::read(t.m("small")).unwrap(), b"low blocks");
    disk.cut(24 << 20);

    // The lost blocks: EIO, promptly, through the mount; nothing of them is cached.
    let r = bounded(10, "read of lost blocks", || fs::read(t.m("big")));
    assert_eq!(errno_of(r), libc::EIO);
    // The mount stays online (the source's root still answers) and serves the rest.
    let s = t.stats();
    assert!(s.health.online, "{:?}", s.health);
    assert_eq!(fs::read(t.m("small")).unwrap(), b"low blocks");
    let rec = fs::read(t.cache.join("meta/big")).ok();
    if let Some(rec) = rec
        && let Ok(rec) = hoardfs::cache::CacheRecord::decode(&rec)
    {
        assert!(
            !rec.is_complete(),
            "a file that failed to read is not complete"
        );
    }
    t.unmount();
}

/// A source that denies access the mount's attributes allow: bindfs running without the
/// capability to override file modes shows a file of nobody's with mode 0600 as 0666, but
/// its own reads of it fail with EACCES. The mount passes that EACCES on, caches nothing of
/// the file, and serves the rest.
#[test]
fn a_source_that_denies_access_gives_eacces() {
    if !root() {
        return;
    }
    let mut t = TestMount::unmounted_at("mnt", &[]);
    let base = t.base();
    let (real, src) = (base.join("real"), base.join("fusesrc"));
    for p in [&real, &src] {
        fs::create_dir_all(p).unwrap();
    }
    fs::write(real.join("secret"), b"nobody's only").unwrap();
    std::os::unix::fs::chown(real.join("secret"), Some(65534), Some(65534)).unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(real.join("secret"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::write(real.join("open"), b"for all").unwrap();
    let st = Command::new("setpriv")
        .args([
            "--bounding-set=-dac_override,-dac_read_search",
            "--inh-caps=-dac_override,-dac_read_search",
            "bindfs",
            "--perms=a+rw",
        ])
        .arg(&real)
        .arg(&src)
        .status();
    if !st.is_ok_and(|s| s.success()) {
        eprintln!("skipped: bindfs without DAC override did not mount");
        return;
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _bindfs = Unmount(src.clone());
    t.src = src;
    t.mount();
    let r = bounded(10, "read of a denied file", || fs::read(t.m("secret")));
    assert_eq!(errno_of(r), libc::EACCES);
    assert_eq!(fs::read(t.m("open")).unwrap(), b"for all");
    let cached = fs::read(t.c("secret")).unwrap_or_default();
    assert!(cached.iter().all(|b| *b == 0), "denied bytes were cached");
    assert!(t.stats().health.online);
    t.unmount();
}

//! Security: symlinks planted in the source (plainly and in a rename race) never lead the
//! daemon outside the source and cache roots, and the mount and the cache directory give
//! other users nothing the source's modes deny them. See docs/security.md.

mod common;

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::TestMount;
use rustix::fs::{Mode, OFlags};

/// Bytes that exist only in the canary file outside the source.
const CANARY: &[u8] = b"CANARY-3f9c1e7a-outside-the-source-and-cache";

/// Every regular file under `dir` (never following symlinks), with its bytes.
fn files_under(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let Ok(rd) = fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let ft = e.file_type().unwrap();
        if ft.is_dir() {
            out.extend(files_under(&e.path()));
        } else if ft.is_file() {
            out.push((e.path(), fs::read(e.path()).unwrap_or_default()));
        }
    }
    out
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// Asserts no file in the cache holds the canary's bytes, and the cache holds no symlink.
fn assert_cache_clean(t: &TestMount) {
    for (p, bytes) in files_under(&t.cache) {
        assert!(
            !contains(&bytes, CANARY),
            "{} holds bytes from outside the source",
            p.display()
        );
    }
    let out = Command::new("find")
        .arg(&t.cache)
        .args(["-type", "l"])
        .output()
        .unwrap();
    assert!(out.stdout.is_empty(), "symlinks in the cache: {out:?}");
}

/// Whether reading a file whose atime is older than its mtime updates the atime here
/// (relatime or strictatime): then an unchanged atime proves a file was not read.
fn atime_shows_reads(dir: &Path) -> bool {
    let p = dir.join("atime-probe");
    fs::write(&p, b"x").unwrap();
    set_atime(&p, 1);
    let _ = fs::read(&p).unwrap();
    let ok = fs::metadata(&p).unwrap().atime() != 1;
    fs::remove_file(&p).unwrap();
    ok
}

fn set_atime(p: &Path, secs: i64) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let times = [
        libc::timespec {
            tv_sec: secs,
            tv_nsec: 0,
        },
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
    ];
    assert_eq!(
        unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) },
        0
    );
}

/// A canary directory beside the source holding the canary file, with its atime set far
/// in the past so that any read of it shows.
fn plant_canary(base: &Path) -> PathBuf {
    let outside = base.join("outside");
    fs::create_dir(&outside).unwrap();
    fs::write(outside.join("canary"), CANARY).unwrap();
    set_atime(&outside.join("canary"), 1);
    outside
}

fn assert_canary_untouched(outside: &Path, check_atime: bool) {
    let names: Vec<_> = fs::read_dir(outside)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names,
        ["canary"],
        "something was created outside the source"
    );
    if check_atime {
        assert_eq!(
            fs::metadata(outside.join("canary")).unwrap().atime(),
            1,
            "the canary outside the source was read"
        );
    }
    assert_eq!(fs::read(outside.join("canary")).unwrap(), CANARY);
}

#[test]
fn planted_symlinks_are_served_as_links_and_never_followed_by_the_daemon() {
    // The mount point is deeper than the source, so a relative link in the source that
    // reaches the canary from the source's directory reaches nothing from the mount's.
    let t = &mut TestMount::new_at("a/b/mnt", &["--whole-file-threshold", "4K"]);
    let outside = plant_canary(&t.base());
    let check_atime = atime_shows_reads(&t.base());
    let canary = outside.join("canary");
    symlink("/etc/shadow", t.s("victim")).unwrap();
    symlink(&canary, t.s("abs")).unwrap();
    symlink("../outside/canary", t.s("rel")).unwrap();
    symlink("/", t.s("root")).unwrap();
    symlink("../outside", t.s("reldir")).unwrap();
    symlink("../../../../../../../../outside", t.s("deep")).unwrap();
    fs::create_dir(t.s("sub")).unwrap();
    symlink("../../outside/canary", t.s("sub/up")).unwrap();

    // Reading a link through the mount answers the link's text.
    for (name, text) in [
        ("victim", "/etc/shadow"),
        ("rel", "../outside/canary"),
        ("root", "/"),
        ("sub/up", "../../outside/canary"),
    ] {
        assert_eq!(fs::read_link(t.m(name)).unwrap(), Path::new(text));
        assert!(fs::symlink_metadata(t.m(name)).unwrap().is_symlink());
    }
    assert_eq!(
        fs::read_link(t.m("abs")).unwrap(),
        canary,
        "absolute link text"
    );
    // Relative links resolve in the caller's view, from the mount point: there they lead
    // nowhere, so nothing can come from the daemon following them.
    for name in ["rel", "sub/up", "reldir/canary"] {
        let e = fs::read(t.m(name)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{name}");
    }
    assert!(fs::File::create(t.m("reldir/new")).is_err());
    assert!(fs::create_dir(t.m("reldir/newdir")).is_err());
    // Opening links with O_NOFOLLOW|O_PATH, statting through them, listing them: no daemon
    // operation follows them either.
    for name in ["victim", "abs", "rel", "root", "reldir", "deep", "sub/up"] {
        let f = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(t.m(name));
        assert_eq!(
            f.unwrap_err().raw_os_error(),
            Some(libc::ELOOP),
            "O_NOFOLLOW open of {name}"
        );
        let _ = fs::metadata(t.m(name));
    }
    // Renaming, hard-linking and removing the links through the mount acts on the links.
    fs::rename(t.m("rel"), t.m("rel2")).unwrap();
    fs::hard_link(t.m("rel2"), t.m("rel3")).unwrap();
    assert_eq!(
        fs::read_link(t.s("rel3")).unwrap(),
        Path::new("../outside/canary")
    );
    fs::remove_file(t.m("rel3")).unwrap();
    // An absolute link is followed by the kernel in the caller's view: root may read the
    // canary that way (as it could without hoardfs), but the daemon has nothing to do
    // with it and caches nothing of it.
    assert_eq!(fs::read(t.m("abs")).unwrap(), CANARY);
    set_atime(&canary, 1);
    assert_cache_clean(t);
    // The control socket's pin does not follow links either.
    let out = Command::new(common::BIN)
        .arg("pin")
        .arg(t.m("reldir/canary"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "pin through a link: {out:?}");
    t.unmount();
    assert_cache_clean(t);
    assert_canary_untouched(&outside, check_atime);
}

use std::os::unix::fs::OpenOptionsExt;

fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    let ca = std::ffi::CString::new(a.as_os_str().as_encoded_bytes()).unwrap();
    let cb = std::ffi::CString::new(b.as_os_str().as_encoded_bytes()).unwrap();
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// One racing run: a thread swaps the source directory `d` with a symlink to the canary
/// directory while workers open, read, create, rename, truncate and list under `d`
/// through the mount.
fn race(t: &TestMount, link_text: &str, duration: Duration) -> u64 {
    // A fresh start when run again: `d` and `swap` may be either thing after a swap.
    for name in ["d", "swap"] {
        let p = t.s(name);
        match fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => fs::remove_dir_all(&p).unwrap(),
            Ok(_) => fs::remove_file(&p).unwrap(),
            Err(_) => {}
        }
    }
    fs::create_dir(t.s("d")).unwrap();
    for i in 0..4 {
        fs::write(t.s(&format!("d/f{i}")), format!("inside {i}").repeat(500)).unwrap();
    }
    fs::create_dir(t.s("d/canary")).unwrap();
    symlink(link_text, t.s("swap")).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicU64::new(0));
    let swapper = {
        let (stop, swaps) = (stop.clone(), swaps.clone());
        let (d, swap) = (t.s("d"), t.s("swap"));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                exchange(&d, &swap).unwrap();
                swaps.fetch_add(1, Ordering::Relaxed);
                // Short pauses let whole operations succeed in between, so that both the
                // "directory" and the "symlink" states meet operations in flight.
                std::thread::sleep(Duration::from_micros(50));
            }
        })
    };
    let ops = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..3)
        .map(|w| {
            let (stop, ops) = (stop.clone(), ops.clone());
            let mnt = t.mnt.clone();
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let d = mnt.join("d");
                    let mut buf = Vec::new();
                    if let Ok(mut f) = fs::File::open(d.join("canary")) {
                        let _ = f.read_to_end(&mut buf);
                    }
                    if let Ok(mut f) = fs::File::open(d.join(format!("f{}", i % 4))) {
                        let _ = f.read_to_end(&mut buf);
                    }
                    assert!(!contains(&buf, CANARY), "the mount served the canary");
                    let new = d.join(format!("w{w}-{i}"));
                    if let Ok(mut f) = fs::File::create(&new) {
                        let _ = f.write_all(b"written through the mount");
                    }
                    let _ = fs::rename(&new, d.join(format!("r{w}-{i}")));
                    let _ = fs::OpenOptions::new()
                        .write(true)
                        .open(d.join(format!("f{}", i % 4)))
                        .and_then(|f| f.set_len(100));
                    let _ = fs::create_dir(d.join(format!("dir{w}-{i}")));
                    let _ = fs::remove_file(d.join(format!("r{w}-{}", i.saturating_sub(2))));
                    let _ = fs::read_dir(&d).map(|rd| rd.count());
                    let _ = fs::metadata(d.join("canary"));
                    // Through a descriptor of `d` taken while it was the directory: the
                    // kernel keeps that node, while the daemon resolves its path anew.
                    if let Ok(dir) =
                        rustix::fs::open(&d, OFlags::PATH | OFlags::DIRECTORY, Mode::empty())
                    {
                        for k in 0..20 {
                            let (a, b) = (format!("x{w}-{k}"), format!("y{w}-{k}"));
                            if let Ok(f) = rustix::fs::openat(
                                &dir,
                                &a,
                                OFlags::CREATE | OFlags::WRONLY,
                                Mode::from_raw_mode(0o644),
                            ) {
                                let _ = rustix::io::write(&f, b"through a held directory");
                            }
                            let _ = rustix::fs::renameat(&dir, &a, &dir, &b);
                            if let Ok(f) =
                                rustix::fs::openat(&dir, "canary", OFlags::RDONLY, Mode::empty())
                            {
                                let mut buf = [0u8; 128];
                                let n = rustix::io::read(&f, &mut buf).unwrap_or(0);
                                assert!(
                                    !contains(&buf[..n], CANARY),
                                    "the mount served the canary"
                                );
                            }
                            let _ = rustix::fs::unlinkat(&dir, &b, rustix::fs::AtFlags::empty());
                        }
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    std::thread::sleep(duration);
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    for w in workers {
        w.join()
            .expect("a worker saw bytes from outside the source");
    }
    assert!(swaps.load(Ordering::Relaxed) > 100, "the race did not race");
    ops.load(Ordering::Relaxed)
}

#[test]
fn a_directory_swapped_for_a_symlink_in_a_rename_race_never_leads_the_daemon_out() {
    let secs = std::env::var("HOARDFS_RACE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    // No kernel caching of names: every access looks `d` up anew, so the daemon sees the
    // swap between lookups and between a lookup and the operation on the looked-up node.
    let t = &mut TestMount::new_at(
        "a/b/mnt",
        &[
            "--whole-file-threshold",
            "4K",
            "--entry-ttl",
            "0",
            "--attr-ttl",
            "0",
            "--negative-ttl",
            "0",
        ],
    );
    t.allow_time(Duration::from_secs(secs));
    let outside = plant_canary(&t.base());
    // `canary` exists as a name inside the canary directory, so that opening `d/canary`
    // through a followed link would reach it.
    let check_atime = atime_shows_reads(&t.base());
    // The daemon itself must be in the race: it creates, opens and renames under `d`. How
    // many of those reach it in a given time depends on the machine's load, so the race
    // goes on (up to ten rounds, each from a fresh start) until each kind has.
    let wanted = [
        "create", "open", "rename", "lookup", "setattr", "mkdir", "unlink",
    ];
    let mut ops = 0;
    for _ in 0..10 {
        ops += race(t, "../outside", Duration::from_secs(secs));
        let req = t.stats().requests;
        if wanted.iter().all(|op| req[*op] > 10) {
            break;
        }
    }
    assert!(ops > 20, "only {ops} rounds of operations");
    let req = t.stats().requests;
    eprintln!("{ops} rounds; requests {req:?}");
    for op in wanted {
        assert!(
            req[op] > 10,
            "too few {op} requests reached the daemon: {req:?}"
        );
    }
    // The mount still works, and serves the source's bytes.
    fs::write(t.m("after"), b"fine").unwrap();
    assert_eq!(fs::read(t.m("after")).unwrap(), b"fine");
    assert_cache_clean(t);
    t.unmount();
    assert_cache_clean(t);
    assert_canary_untouched(&outside, check_atime);
}

#[test]
fn the_same_race_with_an_absolute_link() {
    // Absolute links are followed by the kernel in the caller's view when it sees one, so
    // here the canary directory may legitimately be reached by the workers themselves; only
    // the cache is checked, and that the mount survives.
    let t = &mut TestMount::new_at("a/b/mnt", &["--whole-file-threshold", "4K"]);
    let outside = t.base().join("elsewhere");
    fs::create_dir(&outside).unwrap();
    fs::write(outside.join("canary"), CANARY).unwrap();
    let link = outside.to_str().unwrap().to_string();
    let stop = Arc::new(AtomicBool::new(false));
    // The workers may read the canary through the kernel's own resolution; `race` would
    // flag that, so run the swap with workers that only create and rename.
    fs::create_dir(t.s("d")).unwrap();
    symlink(&link, t.s("swap")).unwrap();
    let swapper = {
        let stop = stop.clone();
        let (d, swap) = (t.s("d"), t.s("swap"));
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                exchange(&d, &swap).unwrap();
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut i = 0;
    while Instant::now() < deadline {
        i += 1;
        let _ = fs::File::open(t.m("d/canary")).map(|mut f| f.read_to_end(&mut Vec::new()));
        let _ = fs::write(t.m(&format!("d/n{i}")), b"x");
        let _ = fs::rename(t.m(&format!("d/n{i}")), t.m(&format!("d/m{i}")));
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    assert_cache_clean(t);
    t.unmount();
    assert_cache_clean(t);
}

fn as_nobody(args: &[&str]) -> std::process::Output {
    Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--reset-env",
        ])
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn other_users_get_nothing_the_source_denies_them() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    // Without --allow-other, another user cannot use the mount at all.
    let t = &mut TestMount::new(&[]);
    fs::set_permissions(t.base(), fs::Permissions::from_mode(0o755)).unwrap();
    fs::write(t.s("public"), b"public bytes").unwrap();
    fs::set_permissions(t.s("public"), fs::Permissions::from_mode(0o644)).unwrap();
    let out = as_nobody(&["cat", t.m("public").to_str().unwrap()]);
    assert!(
        !out.status.success(),
        "nobody used a mount without allow_other"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{out:?}"
    );
    t.unmount();

    t.extra_args.push("--allow-other".into());
    t.mount();
    fs::write(t.s("secret"), b"root only").unwrap();
    fs::set_permissions(t.s("secret"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::create_dir(t.s("private")).unwrap();
    fs::set_permissions(t.s("private"), fs::Permissions::from_mode(0o700)).unwrap();
    fs::write(t.s("private/inner"), b"hidden").unwrap();
    fs::set_permissions(t.s("private/inner"), fs::Permissions::from_mode(0o644)).unwrap();
    // Root reads them, so they are cached (and passed through).
    assert_eq!(fs::read(t.m("secret")).unwrap(), b"root only");
    assert_eq!(fs::read(t.m("private/inner")).unwrap(), b"hidden");
    assert_eq!(fs::read(t.m("public")).unwrap(), b"public bytes");
    assert_eq!(fs::read(t.c("secret")).unwrap(), b"root only");

    // With allow_other the mode bits decide: the public file is readable (so the checks
    // below can fail), the private ones are not, through the mount or the cache.
    let out = as_nobody(&["cat", t.m("public").to_str().unwrap()]);
    assert_eq!(out.stdout, b"public bytes", "{out:?}");
    for p in [
        t.m("secret"),
        t.m("private/inner"),
        t.c("secret"),
        t.c("private/inner"),
        t.c("public"),
        t.cache.join("meta/secret"),
    ] {
        let out = as_nobody(&["cat", p.to_str().unwrap()]);
        assert!(!out.status.success(), "nobody read {}", p.display());
        assert!(out.stdout.is_empty());
    }
    for d in [t.cache.clone(), t.cache.join("data"), t.m("private")] {
        let out = as_nobody(&["ls", d.to_str().unwrap()]);
        assert!(!out.status.success(), "nobody listed {}", d.display());
    }
    let out = as_nobody(&["sh", "-c", &format!("echo x > {}", t.m("secret").display())]);
    assert!(!out.status.success(), "nobody wrote a 0600 root file");
    assert_eq!(fs::read(t.s("secret")).unwrap(), b"root only");
    // Nothing in the cache is more open than owner-only.
    let out = Command::new("find")
        .arg(&t.cache)
        .args(["-perm", "/077", "-not", "-name", "*.log"])
        .args(["-not", "-name", "lock", "-not", "-name", "FORMAT"])
        .output()
        .unwrap();
    assert!(out.stdout.is_empty(), "open modes in the cache: {out:?}");
    assert_eq!(fs::metadata(&t.cache).unwrap().mode() & 0o777, 0o700);
}

/// Writes and truncations by a user without CAP_FSETID clear set-ID bits on the source, as
/// on a local disk, although the daemon writes as root (FUSE_HANDLE_KILLPRIV_V2: the
/// daemon clears them). Root's writes keep them. And the kernel no longer asks for
/// `security.capability` before every write.
#[test]
fn writes_by_other_users_clear_set_id_bits() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let t = &mut TestMount::new(&["--allow-other"]);
    fs::set_permissions(t.base(), fs::Permissions::from_mode(0o755)).unwrap();
    let mode_of = |name: &str| fs::metadata(t.s(name)).unwrap().permissions().mode() & 0o7777;
    for (name, mode) in [
        ("suid", 0o4777),
        ("sgid-x", 0o2777),
        ("sgid-nox", 0o2767),
        ("trunc", 0o6777),
        ("root", 0o6777),
    ] {
        fs::write(t.s(name), b"0123456789").unwrap();
        std::os::unix::fs::chown(t.s(name), Some(65534), Some(65534)).unwrap();
        fs::set_permissions(t.s(name), fs::Permissions::from_mode(mode)).unwrap();
    }
    let write_as_nobody = |name: &str| {
        let out = as_nobody(&[
            "dd",
            "conv=notrunc",
            "bs=4",
            "count=1",
            "if=/dev/zero",
            &format!("of={}", t.m(name).display()),
        ]);
        assert!(out.status.success(), "{out:?}");
    };
    write_as_nobody("suid");
    assert_eq!(mode_of("suid"), 0o777);
    write_as_nobody("sgid-x");
    assert_eq!(mode_of("sgid-x"), 0o777);
    // Set-group-ID without group execute is mandatory locking: it stays.
    write_as_nobody("sgid-nox");
    assert_eq!(mode_of("sgid-nox"), 0o2767);
    let out = as_nobody(&["truncate", "-s", "3", t.m("trunc").to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(mode_of("trunc"), 0o777);
    assert_eq!(fs::metadata(t.s("trunc")).unwrap().len(), 3);
    // Root writes: the bits stay.
    let f = fs::OpenOptions::new()
        .write(true)
        .open(t.m("root"))
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"x", 0).unwrap();
    drop(f);
    assert_eq!(mode_of("root"), 0o6777);
    // A file without set-ID bits: the kernel asks about capabilities at its first write
    // only (it used to before each one).
    fs::write(t.s("plain"), b"").unwrap();
    let f = fs::OpenOptions::new()
        .write(true)
        .open(t.m("plain"))
        .unwrap();
    let before = t.stats().requests.get("getxattr").copied().unwrap_or(0);
    for i in 0..50u64 {
        std::os::unix::fs::FileExt::write_all_at(&f, b"x", i).unwrap();
    }
    drop(f);
    let asked = t.stats().requests.get("getxattr").copied().unwrap_or(0) - before;
    assert!(asked <= 2, "{asked} getxattr requests for 50 writes");
}

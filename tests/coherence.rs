//! Coherence: changes made to the source behind the mount show through the mount even with
//! long kernel TTLs, warm scans never reach the daemon, and two mounts over one source see
//! each other's writes and locks.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{BIN, TestMount, wait_until};

/// Polls `cond` for up to `limit`, returning how long it took to hold.
const ONE_SECOND: Duration = Duration::from_secs(1);

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

fn delta(a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>, op: &str) -> u64 {
    b[op] - a[op]
}

#[test]
fn changes_behind_the_mount_show_within_a_second_despite_long_ttls() {
    let t = TestMount::new(&[]);
    let s = t.stats().coherence;
    assert!(s.watching, "a local source is watched by default: {s:?}");
    assert_eq!(s.attr_ttl_ms, None, "TTLs automatic (long where watched)");
    fs::create_dir(t.s("d")).unwrap();
    fs::write(t.s("d/f"), b"version one").unwrap();
    fs::write(t.s("d/gone"), b"x").unwrap();

    // The kernel learns everything: names, attributes, the listing, the data, and that
    // "later" does not exist.
    assert_eq!(names(&t.m("d")), ["f", "gone"]);
    assert_eq!(fs::read(t.m("d/f")).unwrap(), b"version one");
    assert_eq!(fs::metadata(t.m("d/gone")).unwrap().len(), 1);
    assert!(fs::metadata(t.m("d/later")).is_err());
    let held = fs::File::open(t.m("d/f")).unwrap();
    let mut buf = [0u8; 64];
    assert_eq!(held.read_at(&mut buf, 0).unwrap(), 11);

    // In-place rewrite (same inode): stat and a new open see it; the handle opened before
    // keeps the version it opened (session semantics, tests/versions.rs).
    {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(t.s("d/f"))
            .unwrap();
        f.write_all(b"version two, longer").unwrap();
    }
    let took = wait_until(ONE_SECOND, "new size via stat", || {
        fs::metadata(t.m("d/f")).unwrap().len() == 19
    });
    eprintln!("size change seen after {took:?}");
    assert_eq!(fs::read(t.m("d/f")).unwrap(), b"version two, longer");
    let n = held.read_at(&mut buf, 0).unwrap();
    assert_eq!(
        &buf[..n],
        b"version one",
        "the old handle keeps its version"
    );

    // Truncate.
    fs::OpenOptions::new()
        .write(true)
        .open(t.s("d/f"))
        .unwrap()
        .set_len(7)
        .unwrap();
    wait_until(ONE_SECOND, "truncation", || {
        fs::metadata(t.m("d/f")).unwrap().len() == 7
    });
    assert_eq!(fs::read(t.m("d/f")).unwrap(), b"version");

    // Rename, delete, create (over a remembered "does not exist").
    fs::rename(t.s("d/f"), t.s("d/renamed")).unwrap();
    fs::remove_file(t.s("d/gone")).unwrap();
    fs::write(t.s("d/later"), b"new").unwrap();
    wait_until(ONE_SECOND, "listing after rename, delete, create", || {
        names(&t.m("d")) == ["later", "renamed"]
    });
    wait_until(ONE_SECOND, "old names gone", || {
        fs::metadata(t.m("d/f")).is_err() && fs::metadata(t.m("d/gone")).is_err()
    });
    assert_eq!(fs::read(t.m("d/renamed")).unwrap(), b"version");
    assert_eq!(fs::read(t.m("d/later")).unwrap(), b"new");
    // The handle opened at the start still reads the version it opened.
    let n = held.read_at(&mut buf, 0).unwrap();
    assert_eq!(&buf[..n], b"version one");

    // A directory renamed behind the mount keeps working under its new name.
    fs::create_dir(t.s("d/sub")).unwrap();
    fs::write(t.s("d/sub/x"), b"inside").unwrap();
    assert_eq!(fs::read(t.m("d/sub/x")).unwrap(), b"inside");
    fs::rename(t.s("d/sub"), t.s("moved")).unwrap();
    wait_until(ONE_SECOND, "moved directory", || {
        fs::read(t.m("moved/x")).is_ok_and(|d| d == b"inside") && !t.m("d/sub").exists()
    });

    let s = t.stats().coherence;
    assert!(
        s.watcher_events > 0 && s.inval_entry > 0 && s.inval_inode > 0,
        "{s:?}"
    );
    assert!(s.changes_detected > 0, "{s:?}");
}

/// The Coda paper's Table 2: once warm, scanning and reading a tree sends no lookup, no
/// getattr and no read to the daemon (opens still validate, close-to-open).
#[test]
fn warm_scan_and_read_send_no_lookups_getattrs_or_reads() {
    // The tree is made before the mount: the watcher's notices of a tree made behind a
    // live mount could arrive after the kernel learned its names, and take them again.
    let mut t = TestMount::unmounted_at("mnt", &[]);
    for d in 0..10 {
        fs::create_dir(t.s(&format!("d{d}"))).unwrap();
        for f in 0..20 {
            fs::write(t.s(&format!("d{d}/f{f}")), format!("{d}/{f}").repeat(100)).unwrap();
        }
    }
    t.mount();
    let files = |t: &TestMount| -> Vec<std::path::PathBuf> {
        let mut v = Vec::new();
        for d in names(&t.mnt) {
            for f in names(&t.m(&d)) {
                v.push(t.m(&format!("{d}/{f}")));
            }
        }
        v
    };
    let scan = |t: &TestMount| {
        for p in files(t) {
            let _ = fs::symlink_metadata(&p).unwrap();
        }
    };
    // Reads without a stat (fs::read would fstat for a size hint).
    let read_all = |t: &TestMount| {
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0;
        for p in files(t) {
            let mut f = fs::File::open(&p).unwrap();
            loop {
                let n = f.read(&mut buf).unwrap();
                if n == 0 {
                    break;
                }
                total += n;
            }
        }
        total
    };
    // Cold: everything reaches the daemon once.
    scan(&t);
    let total = read_all(&t);
    let expected: usize = (0..10)
        .flat_map(|d| (0..20).map(move |f| format!("{d}/{f}").len() * 100))
        .sum();
    assert_eq!(total, expected);
    // The reads went through passthrough, and on this kernel each passthrough read (and
    // each listing read from the daemon) invalidates the atime (fs/fuse/passthrough.c,
    // fuse_file_accessed), so the next stat asking for it fetches attributes once:
    // "getattr only for what changed".
    let r0 = t.stats().requests;
    scan(&t);
    let r1 = t.stats().requests;
    assert!(delta(&r0, &r1, "getattr") <= 200 + 11, "{r1:?}");
    assert_eq!(delta(&r0, &r1, "lookup"), 0, "{r1:?}");
    // Warm ScanDir and ReadAll: nothing but the opens' validation.
    scan(&t);
    let r2 = t.stats().requests;
    assert_eq!(read_all(&t), total);
    let r3 = t.stats().requests;
    for op in ["lookup", "getattr", "readdir", "readdirplus"] {
        assert_eq!(delta(&r1, &r2, op), 0, "warm scan sent {op}: {r2:?}");
    }
    for op in ["lookup", "getattr", "read", "readdir", "readdirplus"] {
        assert_eq!(delta(&r2, &r3, op), 0, "warm read sent {op}: {r3:?}");
    }
    assert_eq!(delta(&r2, &r3, "open"), 200, "every open validates");
}

#[test]
fn without_a_watcher_leases_revalidate_open_files() {
    let t = TestMount::new(&["--watch", "off", "--attr-ttl", "0.3"]);
    assert!(!t.stats().coherence.watching);
    fs::write(t.s("f"), b"old contents").unwrap();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"old contents");
    let mut held = fs::File::open(t.m("f")).unwrap();
    let mut s = String::new();
    held.read_to_string(&mut s).unwrap();
    assert_eq!(s, "old contents");
    // Same length, same inode: only a revalidation can notice.
    fs::OpenOptions::new()
        .write(true)
        .open(t.s("f"))
        .unwrap()
        .write_all(b"NEW")
        .unwrap();
    wait_until(Duration::from_secs(3), "lease expiry revalidates", || {
        t.stats().coherence.changes_detected > 0
    });
    // The open handle keeps the version it opened; a new open reads the new one.
    held.seek(SeekFrom::Start(0)).unwrap();
    let mut s = String::new();
    held.read_to_string(&mut s).unwrap();
    assert_eq!(s, "old contents");
    assert_eq!(fs::read(t.m("f")).unwrap(), b"NEW contents");
    let c = t.stats().coherence;
    assert!(c.leases_expired > 0 && c.changes_detected > 0, "{c:?}");
}

#[test]
fn ttls_and_switches_change_on_a_live_mount() {
    let t = TestMount::new(&[]);
    let set = |kv: &str| {
        let out = Command::new(BIN)
            .arg("set")
            .arg(&t.mnt)
            .arg(kv)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{kv}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    set("attr_ttl=0");
    set("stale_check=off");
    set("watch=off");
    let c = t.stats().coherence;
    assert_eq!(c.attr_ttl_ms, Some(0));
    assert!(!c.stale_check && !c.watching, "{c:?}");
    // With attr_ttl=0 every stat reaches the daemon.
    fs::write(t.s("f"), b"x").unwrap();
    let _ = fs::metadata(t.m("f")).unwrap();
    let a = t.stats().requests;
    let _ = fs::metadata(t.m("f")).unwrap();
    let _ = fs::metadata(t.m("f")).unwrap();
    assert!(delta(&a, &t.stats().requests, "getattr") >= 2);
    let bad = Command::new(BIN)
        .arg("set")
        .arg(&t.mnt)
        .arg("watch=maybe")
        .output()
        .unwrap();
    assert!(!bad.status.success());
    set("watch=on");
    set("attr_ttl=auto");
    assert!(t.stats().coherence.watching);
}

/// Two mounts over one source, as two machines would have: each sees the other's closed
/// writes on its next open, and flock and POSIX locks exclude across them.
#[test]
fn two_mounts_see_each_others_writes_and_locks() {
    let a = TestMount::new(&[]);
    let b = a.another(&[]);

    fs::write(a.m("shared"), b"written by a").unwrap();
    assert_eq!(fs::read(b.m("shared")).unwrap(), b"written by a");
    for i in 0..5 {
        let text = format!("version {i} from b");
        fs::write(b.m("shared"), &text).unwrap();
        assert_eq!(fs::read_to_string(a.m("shared")).unwrap(), text);
        let text = format!("version {i} from a, longer");
        fs::write(a.m("shared"), &text).unwrap();
        assert_eq!(fs::read_to_string(b.m("shared")).unwrap(), text);
    }

    let fa = fs::File::open(a.m("shared")).unwrap();
    let fb = fs::File::open(b.m("shared")).unwrap();
    let flock = |f: &fs::File, op: i32| unsafe { libc::flock(f.as_raw_fd(), op) };
    assert_eq!(flock(&fa, libc::LOCK_EX | libc::LOCK_NB), 0);
    assert_eq!(
        flock(&fb, libc::LOCK_EX | libc::LOCK_NB),
        -1,
        "flock through the other mount must conflict"
    );
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EWOULDBLOCK)
    );
    drop(fa); // closing releases the flock
    wait_until(ONE_SECOND, "flock released on close", || {
        flock(&fb, libc::LOCK_EX | libc::LOCK_NB) == 0
    });
    assert_eq!(flock(&fb, libc::LOCK_UN), 0);
}

/// Writers change their own directories through the mount and list after each change,
/// while listers read the same directories (names and lstat) in a loop: every listing
/// begun after a change returned shows it, on a watched source (whose listings the kernel
/// caches) and on an unwatched one. Before, a lister's handle opened before a change
/// filled the kernel's cache with the older listing, which then stayed for minutes.
#[test]
fn listings_begun_after_a_change_through_the_mount_show_it_under_concurrent_listers() {
    for args in [&[][..], &["--watch", "off"][..]] {
        let t = TestMount::new(args);
        let writers = 4;
        for w in 0..writers {
            std::fs::create_dir(t.s(&format!("d{w}"))).unwrap();
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let listers: Vec<_> = (0..3)
            .map(|_| {
                let (mnt, stop) = (t.mnt.clone(), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        for w in 0..writers {
                            let d = mnt.join(format!("d{w}"));
                            if let Ok(rd) = std::fs::read_dir(&d) {
                                for e in rd.flatten() {
                                    let _ = std::fs::symlink_metadata(e.path());
                                }
                            }
                        }
                    }
                })
            })
            .collect();
        let ws: Vec<_> = (0..writers)
            .map(|w| {
                let d = t.m(&format!("d{w}"));
                std::thread::spawn(move || {
                    let mut wrong = Vec::new();
                    for n in 0..150 {
                        let (a, b) = (format!("a{n}"), format!("b{n}"));
                        std::fs::write(d.join(&a), b"x").unwrap();
                        let l = names(&d);
                        if !l.contains(&a) {
                            wrong.push(format!("after create {a}: {l:?}"));
                        }
                        std::fs::rename(d.join(&a), d.join(&b)).unwrap();
                        let l = names(&d);
                        if !l.contains(&b) || l.contains(&a) {
                            wrong.push(format!("after rename {a} -> {b}: {l:?}"));
                        }
                        std::fs::remove_file(d.join(&b)).unwrap();
                        let l = names(&d);
                        if l.contains(&b) {
                            wrong.push(format!("after unlink {b}: {l:?}"));
                        }
                    }
                    wrong
                })
            })
            .collect();
        let wrong: Vec<String> = ws.into_iter().flat_map(|w| w.join().unwrap()).collect();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for l in listers {
            l.join().unwrap();
        }
        assert!(
            wrong.is_empty(),
            "{args:?}: {} of {} listings were wrong, e.g. {:?}",
            wrong.len(),
            writers * 150 * 3,
            &wrong[..wrong.len().min(3)]
        );
    }
}

/// Unmounts a loop-mounted source at drop (after the hoardfs mount over it is gone).
struct LoopMount(std::path::PathBuf);

impl Drop for LoopMount {
    /// Lazily, so that it goes even when a failed test left the hoardfs mount above it;
    /// `mount -o loop` set autoclear, so the loop device goes with it.
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// A file deleted behind the mount whose inode number the source gives to a new file: the
/// new file gets a node of its own, never the old file's attributes or pages in the kernel.
/// The source is a small ext4 with 16 inodes, which hands a freed inode number to the next
/// file at once.
#[test]
fn a_reused_inode_number_never_serves_the_old_files_bytes() {
    use std::os::unix::fs::MetadataExt;
    use std::process::Command;
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root (loop mount)");
        return;
    }
    for args in [&[][..], &["--watch", "off"][..]] {
        let mut t = TestMount::unmounted_at("mnt", args);
        let img = t.base().join("img");
        fs::File::create(&img).unwrap().set_len(8 << 20).unwrap();
        // Under a timeout: mkfs scans the mounts, and a stuck one elsewhere must not hang us.
        let st = Command::new("timeout")
            .args(["60", "mkfs.ext4", "-q", "-F", "-N", "16"])
            .arg(&img)
            .status()
            .unwrap();
        assert!(st.success(), "mkfs.ext4: {st}");
        let st = Command::new("mount")
            .args(["-o", "loop"])
            .arg(&img)
            .arg(&t.src)
            .status()
            .unwrap();
        assert!(st.success(), "mount -o loop: {st}");
        let _loop = LoopMount(t.src.clone());
        t.mount();
        let mut reused = 0;
        for round in 0..5 {
            let (a, b) = (format!("a{round}"), format!("b{round}"));
            let old = vec![b'o'; 12288];
            fs::write(t.s(&a), &old).unwrap();
            let ino = fs::metadata(t.s(&a)).unwrap().ino();
            assert_eq!(fs::read(t.m(&a)).unwrap(), old);
            // The daemon lets go of a's source descriptors once the release arrives.
            t.wait_released();
            // Behind the mount: delete a, then create b, which gets a's inode number.
            fs::remove_file(t.s(&a)).unwrap();
            let new = vec![b'n'; 8192];
            fs::write(t.s(&b), &new).unwrap();
            if fs::metadata(t.s(&b)).unwrap().ino() != ino {
                fs::remove_file(t.s(&b)).unwrap();
                continue;
            }
            reused += 1;
            let got = fs::read(t.m(&b)).unwrap();
            assert!(
                got == new,
                "{args:?} round {round}: {} bytes of {:?}, not b's",
                got.len(),
                got.first()
            );
            assert_eq!(fs::metadata(t.m(&b)).unwrap().len(), 8192);
            fs::remove_file(t.s(&b)).unwrap();
        }
        assert!(
            reused > 0,
            "the source never reused an inode number: nothing tested"
        );
        t.unmount();
    }
}

/// A file replaced by a rename over it behind the mount, about 100 times a second, opened
/// through the mount all the while: every open finds a version of the file, never ENOENT
/// for a name that always existed. A node whose file was replaced answers ESTALE and the
/// kernel retries the open once after looking the name up again; a retry that finds the
/// file replaced yet again gets the version just replaced, if the daemon still holds it
/// whole. Only when it does not (every handle on it closed) does ESTALE reach the caller:
/// allowed here at most once per 50 opens (measured: about 1 in 10,000 on an idle machine,
/// 1 in 200 with the rest of the suite running beside it; before the retry was served, 1 in
/// 10 when idle).
#[test]
fn opens_racing_a_rename_over_behind_the_mount_find_the_new_file() {
    for args in [&[][..], &["--watch", "off"][..]] {
        let t = TestMount::new(args);
        fs::write(t.s("f"), b"v0").unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let opener = {
            let (p, stop) = (t.m("f"), stop.clone());
            std::thread::spawn(move || {
                let (mut n, mut failed) = (0u64, Vec::new());
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    n += 1;
                    match fs::read(&p) {
                        Ok(b) if b.starts_with(b"v") => {}
                        Ok(b) => failed.push(format!("{b:?}")),
                        Err(e) => failed.push(e.to_string()),
                    }
                }
                (n, failed)
            })
        };
        // About 100 replacements a second.
        for v in 1..150 {
            let tmp = t.s(".tmp");
            fs::write(&tmp, format!("v{v}")).unwrap();
            fs::rename(&tmp, t.s("f")).unwrap();
            std::thread::sleep(Duration::from_millis(10));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (n, failed) = opener.join().unwrap();
        let stale = failed.iter().filter(|e| e.contains("os error 116")).count();
        eprintln!("{args:?}: {stale} ESTALE in {n} opens");
        assert!(
            failed.len() == stale && stale as u64 * 50 <= n,
            "{args:?}: {} of {n} opens failed, e.g. {:?}",
            failed.len(),
            &failed[..failed.len().min(3)]
        );
    }
}

/// Where the watcher covers a file, a look at the source stands until an event breaks it
/// (`coherence::Callback`): opens and stats then ask the source nothing. Every change
/// behind the mount, made just before an open, is still what that open reads: in place,
/// truncated, renamed over, and through a hard link made outside the source after the
/// callback was granted (which no event in the file's directory reports).
#[test]
fn callbacks_answer_opens_until_any_change_breaks_them() {
    let t = TestMount::new(&[]);
    let outside = t.base().join("outside");
    fs::create_dir_all(&outside).unwrap();
    let src = t.s("f");
    fs::write(&src, b"v0000").unwrap();
    let hits = |t: &TestMount| t.stats().coherence.callback_hits;
    for round in 0..48u32 {
        // A look grants the callback (once the change's own events are handled, which
        // break it); later opens are answered by it.
        let now = format!("v{round:04}");
        wait_until(
            Duration::from_secs(5),
            "an open answered by a callback",
            || {
                let before = hits(&t);
                assert_eq!(fs::read(t.m("f")).unwrap(), now.as_bytes());
                hits(&t) > before
            },
        );
        let next = format!("v{:04}", round + 1);
        match round % 4 {
            how @ 0..=2 => change_f_behind(&t, how, &next),
            // Through a hard link made outside the source after the grant: only the
            // watch on the file itself sees the new link and the write.
            _ => {
                let link = outside.join("f");
                let _ = fs::remove_file(&link);
                fs::hard_link(&src, &link).unwrap();
                fs::OpenOptions::new()
                    .write(true)
                    .open(&link)
                    .unwrap()
                    .write_all_at(next.as_bytes(), 0)
                    .unwrap();
                fs::remove_file(&link).unwrap();
            }
        }
        // At once (the change's events not handled yet: the open looks at the source),
        // or once the watcher has handled them (the callback must be broken by then).
        if round % 8 >= 4 {
            std::thread::sleep(Duration::from_millis(150));
        }
        assert_eq!(
            String::from_utf8(fs::read(t.m("f")).unwrap()).unwrap(),
            next,
            "round {round}: an open right after the change"
        );
        assert_eq!(fs::metadata(t.m("f")).unwrap().len(), 5);
    }
    let s = t.stats().coherence;
    assert!(s.callbacks_broken >= 40, "{s:?}");
    // close_to_open=on: every open asks the source again.
    hoardfs_set(&t, "close_to_open=on");
    fs::read(t.m("f")).unwrap();
    let before = hits(&t);
    fs::read(t.m("f")).unwrap();
    assert_eq!(
        hits(&t),
        before,
        "close_to_open=on answers no open by callback"
    );
}

/// A file's callback answers lookups too (`CachingFs::called_back`): with the kernel
/// keeping no name (`--entry-ttl 0`, as after `drop_caches` took its dentries), every stat
/// sends a lookup, which asks the source nothing while the callback stands. A change
/// behind the mount made just before a stat is what that stat shows: in place, truncated
/// and rewritten, renamed over, removed and made again, and through a hard link made
/// outside the source (which no event in the file's directory reports). Each change
/// makes the file one byte longer, so that a size from before it is seen for what it is.
#[test]
fn callbacks_answer_lookups_until_any_change_breaks_them() {
    let t = TestMount::new(&["--entry-ttl", "0"]);
    let outside = t.base().join("outside");
    fs::create_dir_all(&outside).unwrap();
    let src = t.s("f");
    let body = |len: u64| vec![b'x'; len as usize];
    fs::write(&src, body(1)).unwrap();
    let hits = |t: &TestMount| t.stats().coherence.callback_names;
    let lookups = |t: &TestMount| t.stats().requests["lookup"];
    for round in 0..40u64 {
        let len = round + 1;
        // An open grants the callback (once the change's own events are handled, which
        // break it); then a stat's lookup is answered by it.
        wait_until(
            Duration::from_secs(5),
            "a lookup answered by a callback",
            || {
                assert_eq!(fs::read(t.m("f")).unwrap().len() as u64, len);
                let (h, l) = (hits(&t), lookups(&t));
                assert_eq!(fs::symlink_metadata(t.m("f")).unwrap().len(), len);
                assert!(lookups(&t) > l, "round {round}: a stat sent no lookup");
                hits(&t) > h
            },
        );
        let next = body(len + 1);
        match round % 5 {
            0 => fs::OpenOptions::new()
                .write(true)
                .open(&src)
                .unwrap()
                .write_all_at(&next, 0)
                .unwrap(),
            1 => fs::write(&src, &next).unwrap(),
            2 => {
                let tmp = t.s(".f.tmp");
                fs::write(&tmp, &next).unwrap();
                fs::rename(&tmp, &src).unwrap();
            }
            3 => {
                fs::remove_file(&src).unwrap();
                fs::write(&src, &next).unwrap();
            }
            _ => {
                let link = outside.join("f");
                let _ = fs::remove_file(&link);
                fs::hard_link(&src, &link).unwrap();
                fs::OpenOptions::new()
                    .append(true)
                    .open(&link)
                    .unwrap()
                    .write_all(b"x")
                    .unwrap();
                fs::remove_file(&link).unwrap();
            }
        }
        // At once (the change's events not handled yet: the lookup asks the source), or
        // once the watcher has handled them (the callback must be broken by then).
        if round % 10 >= 5 {
            std::thread::sleep(Duration::from_millis(150));
        }
        assert_eq!(
            fs::symlink_metadata(t.m("f")).unwrap().len(),
            len + 1,
            "round {round}: a stat right after the change"
        );
    }
}

/// Lookups answered by callbacks race changes behind the mount: a writer makes the file
/// one byte longer again and again (in place, resized and rewritten, renamed over), a
/// reader's opens grant callbacks, and two threads stat the name with no entry TTL (a
/// lookup each). A stat may show a size older than the last change that had returned
/// when it began only within the README's bound for stats on a watched source ("within
/// about 50 ms"; the kernel may keep its attributes when a lookup's reply raced another
/// request, until the watcher's notice drops them): a callback left standing after the
/// change would show the old size for the watched TTL, 60 s.
#[test]
fn lookups_under_callbacks_never_show_a_size_older_than_a_finished_change() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    use std::sync::{Arc, Mutex};
    use std::time::Instant;
    const BOUND: Duration = Duration::from_millis(100);
    let t = TestMount::new(&["--entry-ttl", "0"]);
    let src = t.s("f");
    fs::write(&src, b"x").unwrap();
    // When each length's change returned (index: the length).
    let done_at: Arc<Mutex<Vec<Instant>>> = Arc::new(Mutex::new(vec![Instant::now(); 2]));
    let stop = Arc::new(AtomicBool::new(false));
    let late: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let wrong: Arc<Mutex<Vec<String>>> = Arc::default();
    let (stats, errors) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let hits_before = t.stats().coherence.callback_names;
    let mnt_f = t.m("f");
    let mut threads = Vec::new();
    // The reader's opens grant callbacks only in the writer's quiet spells, so that a
    // callback left standing after a change would be replaced by no new one for longer
    // than the bound.
    let reading = Arc::new(AtomicBool::new(false));
    {
        let (stop, f, reading) = (stop.clone(), mnt_f.clone(), reading.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(SeqCst) {
                if reading.load(SeqCst) {
                    let _ = fs::read(&f);
                } else {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }));
    }
    for _ in 0..2 {
        let (stop, f, done_at) = (stop.clone(), mnt_f.clone(), done_at.clone());
        let (late, wrong) = (late.clone(), wrong.clone());
        let (stats, errors) = (stats.clone(), errors.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(SeqCst) {
                let floor = done_at.lock().unwrap().len() as u64 - 1;
                let began = Instant::now();
                match fs::symlink_metadata(&f) {
                    Ok(m) if m.len() < floor => {
                        // The first change it missed had returned this long before.
                        let lag = began - done_at.lock().unwrap()[m.len() as usize + 1];
                        late.lock().unwrap().push(lag);
                        if lag > BOUND {
                            wrong.lock().unwrap().push(format!(
                                "size {} {lag:?} after version {} had returned",
                                m.len(),
                                m.len() + 1
                            ));
                        }
                    }
                    Ok(_) => {}
                    Err(_) => {
                        errors.fetch_add(1, SeqCst);
                    }
                }
                stats.fetch_add(1, SeqCst);
            }
        }));
    }
    let started = Instant::now();
    let mut len = 1u64;
    while started.elapsed() < Duration::from_secs(3) && len < 2000 {
        len += 1;
        let body = vec![b'x'; len as usize];
        match len % 3 {
            0 => fs::OpenOptions::new()
                .write(true)
                .open(&src)
                .unwrap()
                .write_all_at(&body, 0)
                .unwrap(),
            // Resized first (never shorter than before: a truncation to 0 and a rewrite
            // would show an older size while it runs, which is no error).
            1 => {
                let f = fs::OpenOptions::new().write(true).open(&src).unwrap();
                f.set_len(len).unwrap();
                f.write_all_at(&body, 0).unwrap();
            }
            _ => {
                let tmp = t.s(".f.tmp");
                fs::write(&tmp, &body).unwrap();
                fs::rename(&tmp, &src).unwrap();
            }
        }
        done_at.lock().unwrap().push(Instant::now());
        if len.is_multiple_of(16) {
            // A quiet spell, in which the reader's opens grant callbacks.
            reading.store(true, SeqCst);
            std::thread::sleep(Duration::from_millis(40));
            reading.store(false, SeqCst);
        } else {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    stop.store(true, SeqCst);
    for th in threads {
        th.join().unwrap();
    }
    let hits = t.stats().coherence.callback_names - hits_before;
    let (n, errors) = (stats.load(SeqCst), errors.load(SeqCst));
    let (wrong, late) = (wrong.lock().unwrap(), late.lock().unwrap());
    eprintln!(
        "{n} stats, {hits} lookups answered by callbacks; {} older sizes, the latest {:?} after the change",
        late.len(),
        late.iter().max()
    );
    assert!(
        wrong.is_empty() && errors * 50 <= n,
        "{} of {n} stats showed a size older than {BOUND:?} after the change, e.g. {:?}; {errors} failed",
        wrong.len(),
        &wrong[..wrong.len().min(3)]
    );
    assert!(
        hits > 100,
        "only {hits} lookups answered by callbacks in {n} stats"
    );
}

/// With `--kernel-dir-opens` the kernel opens directories itself and keeps their listings
/// between opens: no opendir reaches the daemon. A name made, removed or renamed behind
/// the mount is listed once the watcher's notice has dropped the kernel's listing (the
/// watched TTL is 60 s: nothing else would), and where nothing is watched once the
/// unwatched attribute TTL (1 s) has passed. There the kernel, which checks permissions
/// itself, refreshes an open's attributes after the TTL and drops a listing older than
/// the directory's mtime; the daemon's notice at the end of the listing's lease
/// (`kernel_listing`) covers the changes that leave the mtime as it was, which this test
/// does not make. The listings are taken through `/proc/self/fd` of an open descriptor
/// of the directory, so that no lookup of its name comes between. A name made through
/// the mount is listed at once.
#[test]
fn kernel_dir_opens_keep_listings_until_a_notice_or_the_ttl() {
    for watched in [true, false] {
        let args: &[&str] = if watched {
            &["--kernel-dir-opens"]
        } else {
            &["--kernel-dir-opens", "--watch", "off"]
        };
        let t = TestMount::new(args);
        fs::create_dir(t.s("d")).unwrap();
        fs::write(t.s("d/a0"), b"x").unwrap();
        let dir = fs::File::open(t.m("d")).unwrap();
        let by_fd = Path::new("/proc/self/fd").join(dir.as_raw_fd().to_string());
        // The first opendir is the one answered ENOSYS; the kernel keeps the listings
        // of the opens after it.
        for _ in 0..2 {
            assert_eq!(names(&by_fd), names(&t.s("d")));
        }
        let opendirs = t.stats().requests["opendir"];
        let bound = if watched {
            Duration::from_millis(500)
        } else {
            Duration::from_millis(1500)
        };
        for round in 0..6u32 {
            let first = names(&t.s("d")).into_iter().next().unwrap();
            match round % 3 {
                0 => fs::write(t.s(&format!("d/b{round}")), b"x").unwrap(),
                1 => fs::rename(t.s(&format!("d/{first}")), t.s(&format!("d/r{round}"))).unwrap(),
                _ => fs::remove_file(t.s(&format!("d/{first}"))).unwrap(),
            }
            wait_until(
                bound,
                &format!("{args:?} round {round}: the change behind the mount listed"),
                || names(&by_fd) == names(&t.s("d")),
            );
            fs::write(t.m(&format!("d/m{round}")), b"").unwrap();
            assert_eq!(
                names(&by_fd),
                names(&t.s("d")),
                "{args:?} round {round}: a name made through the mount"
            );
        }
        assert_eq!(
            t.stats().requests["opendir"],
            opendirs,
            "{args:?}: an opendir reached the daemon"
        );
    }
}

/// Writes `data` to the source's `f` behind the mount: 0 in place (same size), 1
/// truncated and rewritten, 2 renamed over.
fn change_f_behind(t: &TestMount, how: u32, data: &str) {
    let src = t.s("f");
    match how {
        0 => fs::OpenOptions::new()
            .write(true)
            .open(&src)
            .unwrap()
            .write_all_at(data.as_bytes(), 0)
            .unwrap(),
        1 => fs::write(&src, data).unwrap(),
        _ => {
            let tmp = t.s(".f.tmp");
            fs::write(&tmp, data).unwrap();
            fs::rename(&tmp, &src).unwrap();
        }
    }
}

fn hoardfs_set(t: &TestMount, kv: &str) {
    let out = Command::new(BIN)
        .args(["set", t.mnt.to_str().unwrap(), kv])
        .output()
        .unwrap();
    assert!(out.status.success(), "hoardfs set {kv}: {out:?}");
}

/// A directory's listing held under callback answers its opendirs (the source is not read)
/// until a change of one of its names: behind the mount (create, unlink, rename within,
/// into and out of it) the listing shows the change once the watcher has handled it, as
/// the README states for listings; through the mount at once. Without the breaks, the
/// held listing would be served for the watched TTL (60 s).
#[test]
fn held_listings_answer_opendirs_until_a_change_of_a_name_breaks_them() {
    let t = TestMount::new(&[]);
    let (d, e) = (t.s("d"), t.s("e"));
    fs::create_dir(&d).unwrap();
    fs::create_dir(&e).unwrap();
    fs::write(d.join("f0"), b"x").unwrap();
    let hits = |t: &TestMount| t.stats().coherence.listing_hits;
    for round in 0..24u32 {
        wait_until(
            Duration::from_secs(5),
            "an opendir answered by the held listing",
            || {
                let before = hits(&t);
                assert_eq!(names(&t.m("d")), names(&d));
                hits(&t) > before
            },
        );
        let first = names(&d).into_iter().next().unwrap();
        match round % 6 {
            0 => fs::write(d.join(format!("n{round}")), b"x").unwrap(),
            1 => {
                fs::write(d.join(format!("gone{round}")), b"x").unwrap();
                wait_until(ONE_SECOND * 2, "the new name listed", || {
                    names(&t.m("d")) == names(&d)
                });
                fs::remove_file(d.join(format!("gone{round}"))).unwrap();
            }
            2 => fs::rename(d.join(&first), d.join(format!("r{round}"))).unwrap(),
            3 => {
                fs::write(e.join("in"), b"x").unwrap();
                fs::rename(e.join("in"), d.join(format!("in{round}"))).unwrap();
            }
            4 => fs::rename(d.join(&first), e.join(format!("out{round}"))).unwrap(),
            _ => {
                // Through the mount: the next listing shows it, with no wait.
                fs::write(t.m(&format!("d/m{round}")), b"x").unwrap();
                assert_eq!(names(&t.m("d")), names(&d), "round {round}");
                continue;
            }
        }
        // At once (the event not handled yet: the opendir reads the source), or once the
        // watcher has handled it (the held listing must be broken by then).
        if round % 12 >= 6 {
            std::thread::sleep(Duration::from_millis(150));
        }
        wait_until(
            ONE_SECOND * 2,
            &format!("round {round}: the change listed"),
            || names(&t.m("d")) == names(&d),
        );
    }
}

/// Listers open a directory over and over while its names change behind the mount as
/// fast as they can: a listing read before a change must never be held after the
/// change's event was handled. Once the changes stop, the listing settles on the source's
/// within the watcher's delay and stays there, also after one last change that no lister
/// read.
#[test]
fn held_listings_settle_on_the_source_under_changes_racing_listers() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    let t = TestMount::new(&[]);
    let d = t.s("r");
    fs::create_dir(&d).unwrap();
    let hits_before = t.stats().coherence.listing_hits;
    for round in 0..6u32 {
        let stop = Arc::new(AtomicBool::new(false));
        let listers: Vec<_> = (0..2)
            .map(|_| {
                let (m, stop) = (t.m("r"), stop.clone());
                std::thread::spawn(move || {
                    while !stop.load(Relaxed) {
                        let _ = fs::read_dir(&m).map(|rd| rd.count());
                    }
                })
            })
            .collect();
        for i in 0..400u32 {
            let (a, b) = (
                d.join(format!("a{}", i % 17)),
                d.join(format!("b{}", i % 13)),
            );
            match (i + round) % 3 {
                0 => fs::write(&a, b"x").unwrap(),
                1 => {
                    let _ = fs::rename(&a, &b);
                }
                _ => {
                    let _ = fs::remove_file(&b);
                }
            }
        }
        stop.store(true, Relaxed);
        for l in listers {
            l.join().unwrap();
        }
        // One more change with no lister after it, and time for the watcher to handle it:
        // the listing held from before it must be gone.
        fs::write(d.join(format!("last{round}")), b"x").unwrap();
        std::thread::sleep(Duration::from_millis(150));
        wait_until(
            ONE_SECOND * 3,
            &format!("round {round}: the listing settles on the source's"),
            || names(&t.m("r")) == names(&d),
        );
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(30));
            assert_eq!(names(&t.m("r")), names(&d), "round {round}: and stays");
        }
    }
    assert!(
        t.stats().coherence.listing_hits > hits_before,
        "the listers' opendirs were answered by held listings"
    );
}

/// A node's first open tells the kernel nothing (it holds no pages of the file yet): a
/// cold pass sends no invalidation, and on a read-only mount the pass after it asks no
/// `getattr`. Once a handle was given out, an open that finds the file changed behind the
/// mount still drops the pages earlier handles left: with reads through the kernel's page
/// cache (no passthrough) and nothing watched, the files are rewritten in place at the
/// same size and every read after gives the new bytes, over rounds racing a reader that
/// keeps a handle open.
#[test]
fn first_opens_send_no_invalidation_and_later_opens_drop_old_pages() {
    for args in [&["--watch", "off", "--no-passthrough"][..], &["-r"][..]] {
        // The files are made before the mount: events of their making would reach the
        // watcher of the read-only mount and tell the kernel about the directory.
        let mut t = TestMount::unmounted_at("mnt", args);
        let n = 40;
        let body = |v: u32, i: u32| format!("{v:04}-{i:04}-").repeat(512).into_bytes();
        for i in 0..n {
            fs::write(t.s(&format!("f{i}")), body(0, i)).unwrap();
        }
        t.mount();
        let before = t.stats();
        for i in 0..n {
            assert_eq!(fs::read(t.m(&format!("f{i}"))).unwrap(), body(0, i));
        }
        let after = t.stats();
        assert_eq!(
            after.coherence.inval_inode, before.coherence.inval_inode,
            "{args:?}: first opens sent invalidations"
        );
        if args == ["-r"] {
            let getattrs =
                |s: &hoardfs::stats::Snapshot| s.requests.get("getattr").copied().unwrap_or(0);
            for i in 0..n {
                fs::metadata(t.m(&format!("f{i}"))).unwrap();
                assert_eq!(fs::read(t.m(&format!("f{i}"))).unwrap(), body(0, i));
            }
            assert_eq!(getattrs(&t.stats()), getattrs(&after), "a getattr per file");
            continue;
        }
        let held = fs::File::open(t.m("f0")).unwrap();
        for v in 1..6u32 {
            for i in 0..n {
                fs::OpenOptions::new()
                    .write(true)
                    .open(t.s(&format!("f{i}")))
                    .unwrap()
                    .write_all_at(&body(v, i), 0)
                    .unwrap();
            }
            for i in 0..n {
                assert_eq!(
                    fs::read(t.m(&format!("f{i}"))).unwrap(),
                    body(v, i),
                    "round {v}, f{i}"
                );
            }
            let mut old = vec![0u8; 16];
            held.read_at(&mut old, 0).unwrap();
        }
    }
}

/// Where nothing is watched, `--open-lease` lets one look at a file answer the opens after
/// it for the lease's length: they read the cached version without asking the source. A
/// change behind the mount is read by every open that begins a lease after the look that
/// preceded it, and no later; a change through the mount by the next open at once.
#[test]
fn open_leases_answer_opens_for_their_length_and_own_writes_at_once() {
    const LEASE: Duration = Duration::from_millis(400);
    let t = TestMount::new(&["--watch", "off", "--open-lease", "0.4"]);
    let src = t.s("f");
    fs::write(&src, b"v0000").unwrap();
    let hits = |t: &TestMount| t.stats().coherence.open_lease_hits;
    let mut hits_seen = 0;
    for round in 0..12u32 {
        let now = format!("v{round:04}");
        // The first open looks (and leaves the lease), the next ones are answered by it.
        assert_eq!(fs::read(t.m("f")).unwrap(), now.as_bytes(), "round {round}");
        let before = hits(&t);
        assert_eq!(fs::read(t.m("f")).unwrap(), now.as_bytes(), "round {round}");
        hits_seen += hits(&t) - before;
        let next = format!("v{:04}", round + 1);
        let changed = std::time::Instant::now();
        match round % 4 {
            how @ 0..=2 => change_f_behind(&t, how, &next),
            // Through the mount: the next open reads it, lease or not.
            _ => {
                fs::OpenOptions::new()
                    .write(true)
                    .open(t.m("f"))
                    .unwrap()
                    .write_all_at(next.as_bytes(), 0)
                    .unwrap();
                assert_eq!(
                    fs::read(t.m("f")).unwrap(),
                    next.as_bytes(),
                    "round {round}"
                );
                continue;
            }
        }
        // Within the lease an open reads either version, whole; once a lease's length has
        // passed since the change, only the new one.
        loop {
            let started = changed.elapsed();
            let got = fs::read(t.m("f")).unwrap();
            if got == next.as_bytes() {
                break;
            }
            assert_eq!(got, now.as_bytes(), "round {round}: neither version");
            assert!(
                started < LEASE,
                "round {round}: the old version read {started:?} after the change"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    assert!(hits_seen >= 10, "opens answered by a lease: {hits_seen}");
    let c = t.stats().coherence;
    assert!(c.open_leases_granted >= 12, "{c:?}");
    // 0 ends every lease: each open asks the source again.
    hoardfs_set(&t, "open_lease=0");
    fs::read(t.m("f")).unwrap();
    let before = hits(&t);
    fs::read(t.m("f")).unwrap();
    assert_eq!(hits(&t), before, "open_lease=0 answers no open by lease");
}

/// Open leases against writes racing them: a writer through the mount, a writer behind
/// it (on another file) and readers opening both in a loop. A reader never reads a version
/// older than the last one written through the mount before its open began, nor older
/// than the last one written behind the mount a lease's length before its open began.
#[test]
fn open_leases_never_hide_own_writes_and_lapse_in_time_under_racing_writers() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    use std::time::Instant;
    const LEASE: Duration = Duration::from_millis(200);
    // Readers' and writers' opens of one file through the daemon (no passthrough, which
    // would make a writer wait for readers' releases).
    let t = TestMount::new(&["--watch", "off", "--open-lease", "0.2", "--no-passthrough"]);
    let version = |v: u64| format!("{v:016}");
    fs::write(t.s("own"), version(0)).unwrap();
    fs::write(t.s("behind"), version(0)).unwrap();
    let own_acked = Arc::new(AtomicU64::new(0));
    // (when, version) of every write behind the mount, in order.
    let behind_acked = Arc::new(std::sync::Mutex::new(vec![(Instant::now(), 0u64)]));
    let stop = Arc::new(AtomicBool::new(false));
    let base = Instant::now();
    std::thread::scope(|s| {
        let (m, acked, stop2) = (t.m("own"), own_acked.clone(), stop.clone());
        s.spawn(move || {
            for v in 1.. {
                if stop2.load(SeqCst) {
                    break;
                }
                let f = fs::OpenOptions::new().write(true).open(&m).unwrap();
                f.write_all_at(version(v).as_bytes(), 0).unwrap();
                drop(f);
                acked.store(v, SeqCst);
                std::thread::sleep(Duration::from_millis(3));
            }
        });
        let (p, acked, stop2) = (t.s("behind"), behind_acked.clone(), stop.clone());
        s.spawn(move || {
            for v in 1.. {
                if stop2.load(SeqCst) {
                    break;
                }
                // Alternately in place and renamed over.
                if v % 2 == 0 {
                    let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
                    f.write_all_at(version(v).as_bytes(), 0).unwrap();
                } else {
                    let tmp = p.with_file_name(".behind.tmp");
                    fs::write(&tmp, version(v)).unwrap();
                    fs::rename(&tmp, &p).unwrap();
                }
                acked.lock().unwrap().push((Instant::now(), v));
                std::thread::sleep(Duration::from_millis(7));
            }
        });
        for _ in 0..2 {
            let (own_m, behind_m) = (t.m("own"), t.m("behind"));
            let (own_acked, behind_acked) = (own_acked.clone(), behind_acked.clone());
            s.spawn(move || {
                let (mut reads, mut stale) = (0u64, 0u64);
                while base.elapsed() < Duration::from_secs(3) {
                    let floor = own_acked.load(SeqCst);
                    let got = fs::read_to_string(&own_m).unwrap();
                    let got: u64 = got.parse().unwrap_or_else(|_| panic!("own: {got:?}"));
                    assert!(got >= floor, "own: read {got} after {floor} was written");
                    let began = Instant::now();
                    let floor = behind_acked
                        .lock()
                        .unwrap()
                        .iter()
                        .rev()
                        .find(|(at, _)| *at + LEASE <= began)
                        .map_or(0, |&(_, v)| v);
                    let got = match fs::read_to_string(&behind_m) {
                        Ok(got) => got,
                        // Renamed over again between the open's ESTALE and the kernel's
                        // retry of it: the kernel gives up (rarely; the hunt allows it too).
                        Err(e) if e.raw_os_error() == Some(libc::ESTALE) => {
                            stale += 1;
                            continue;
                        }
                        Err(e) => panic!("behind: {e}"),
                    };
                    let got: u64 = got.parse().unwrap_or_else(|_| panic!("behind: {got:?}"));
                    assert!(
                        got >= floor,
                        "behind: read {got}, but {floor} was written a lease's length before"
                    );
                    reads += 1;
                }
                assert!(
                    reads > 50 && stale * 20 < reads,
                    "reads: {reads}, ESTALE: {stale}"
                );
            });
        }
        std::thread::sleep(Duration::from_secs(3));
        stop.store(true, SeqCst);
    });
    let c = t.stats().coherence;
    assert!(c.open_lease_hits > 0, "{c:?}");
}

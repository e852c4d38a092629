//! Bad input: every kind of invalid invocation gets a clear message and exit status, a
//! second daemon on a cache in use is refused, and names with any byte a Linux name may
//! hold, PATH_MAX paths and deep trees work through the mount.

mod common;

use std::ffi::{OsStr, OsString};
use std::fs;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{BIN, TestMount};

/// Runs hoardfs in the foreground with `args`; a run that mounts would hang, so every case
/// here must fail before mounting.
fn run(args: &[&OsStr]) -> (i32, String) {
    let out = Command::new(BIN)
        .args(args)
        .arg("-f")
        .env("HOARDFS_LOG", "error")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn invalid_invocations_get_clear_messages() {
    let d = tempfile::tempdir().unwrap();
    let b = fs::canonicalize(d.path()).unwrap();
    let p = |s: &str| b.join(s);
    for dir in ["src", "mnt", "cache/mnt", "src/inner"] {
        fs::create_dir_all(p(dir)).unwrap();
    }
    fs::write(p("file"), b"x").unwrap();
    let o = |s: &str| -> OsString { OsString::from(s) };
    let cases: Vec<(Vec<OsString>, i32, &str)> = vec![
        (vec![p("nope").into(), p("mnt").into()], 1, "source"),
        (
            vec![o("gs://bucket/prefix"), p("mnt").into()],
            1,
            "the only object-store sources are s3://BUCKET[/PREFIX]",
        ),
        (
            vec![p("file").into(), p("mnt").into()],
            1,
            "is not a directory",
        ),
        (vec![p("src").into(), p("nope").into()], 1, "mount point"),
        (
            vec![p("src").into(), p("file").into()],
            1,
            "is not a directory",
        ),
        (
            vec![p("src").into(), p("src").into()],
            1,
            "is the source itself",
        ),
        (
            vec![
                p("src").into(),
                p("src/inner").into(),
                o("--cache-dir"),
                p("c").into(),
            ],
            1,
            "must not be inside the source",
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("--cache-dir"),
                p("src/inner").into(),
            ],
            1,
            "must not be inside the source",
        ),
        (
            vec![
                p("src/inner").into(),
                p("mnt").into(),
                o("--cache-dir"),
                p("src").into(),
            ],
            1,
            "or contain it",
        ),
        (
            vec![
                p("src").into(),
                p("cache/mnt").into(),
                o("--cache-dir"),
                p("cache").into(),
            ],
            1,
            "must not be inside the mount point",
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("--cache-dir"),
                p("mnt/c").into(),
            ],
            1,
            "must not be inside the mount point",
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("--cache-dir"),
                p("file/sub").into(),
            ],
            1,
            "cannot create",
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("--cache-dir"),
                p("file").into(),
            ],
            1,
            "is not a directory",
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("--cache-size"),
                o("12Q"),
            ],
            2,
            "invalid size unit",
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("--cache-size"),
                o("99999999999T"),
            ],
            2,
            "too large",
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("-o"),
                o("cache_size=abc"),
            ],
            2,
            "invalid size",
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("--chunk-size"),
                o("3000"),
            ],
            2,
            "power of two",
        ),
        (
            vec![p("src").into(), p("mnt").into(), o("--chunk-size"), o("3K")],
            2,
            "power of two",
        ),
        (
            vec![p("src").into(), p("mnt").into(), o("--chunk-size"), o("1K")],
            2,
            "at least 4 KiB",
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("--low-watermark"),
                o("95"),
            ],
            2,
            "watermarks",
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("--high-watermark"),
                o("101"),
            ],
            2,
            "101",
        ),
        (
            vec![p("src").into(), p("mnt").into(), o("--cache-share"), o("0")],
            2,
            "1..=100",
        ),
        (
            vec![p("src").into(), p("mnt").into(), o("--threads"), o("0")],
            2,
            "threads",
        ),
        (
            vec![p("src").into(), p("mnt").into(), o("-o"), o("threads=0")],
            2,
            "threads",
        ),
        (
            vec![p("src").into(), p("mnt").into(), o("--max-inodes"), o("0")],
            2,
            "max_inodes",
        ),
        (
            vec![
                o("s3://bucket"),
                p("mnt").into(),
                o("--offline-writes"),
                o("log"),
            ],
            2,
            if cfg!(feature = "s3") {
                "not available for object-store sources"
            } else {
                "built without the s3 feature"
            },
        ),
        (
            vec![o("s3://bucket"), p("mnt").into(), o("--kernel-opens")],
            2,
            if cfg!(feature = "s3") {
                "kernel_opens is not available for object-store sources"
            } else {
                "built without the s3 feature"
            },
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("--source-reads"),
                o("--kernel-opens"),
            ],
            2,
            "source_reads needs a directory source and passthrough",
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("--entry-ttl"),
                o("soon"),
            ],
            2,
            "invalid duration",
        ),
        (
            vec![p("src").into(), p("mnt").into(), o("-o"), o("frobnicate")],
            2,
            "unknown mount option",
        ),
    ];
    for (args, code, msg) in &cases {
        let mut args = args.clone();
        // A cache directory that does not exist yet (as the default one would not) where
        // the case names none: a rejected invocation must leave none behind.
        if !args.iter().any(|a| a == "--cache-dir") {
            args.extend([o("--cache-dir"), p("fresh/cache").into()]);
        }
        let refs: Vec<&OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        let (got, err) = run(&refs);
        assert_eq!(got, *code, "{args:?}: {err}");
        assert!(err.contains(msg), "{args:?}: expected {msg:?} in {err:?}");
        assert!(
            err.lines().count() <= 6,
            "{args:?}: message too long: {err}"
        );
        assert!(!p("fresh").exists(), "{args:?} left {:?}", p("fresh/cache"));
        assert!(!p("c").exists(), "{args:?} left {:?}", p("c"));
    }
    // None of these mounted anything or wrote a cache into the source.
    assert!(!p("src/inner").join("FORMAT").exists());
}

/// A hoardfs built without the `s3` feature (`--no-default-features`) refuses an `s3://`
/// source as bad usage, saying how to get one that takes it (`.ci/run` runs this test in
/// that build).
#[cfg(not(feature = "s3"))]
#[test]
fn without_the_s3_feature_an_object_source_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let (mnt, cache) = (d.path().join("mnt"), d.path().join("cache"));
    fs::create_dir(&mnt).unwrap();
    let (code, err) = run(&[
        OsStr::new("s3://bucket/prefix"),
        mnt.as_os_str(),
        OsStr::new("--cache-dir"),
        cache.as_os_str(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(
            "s3://bucket/prefix: this hoardfs was built without the s3 feature; \
             rebuild with --features s3"
        ),
        "{err}"
    );
    assert!(!cache.exists(), "left {cache:?}");
}

/// A directory for the user nobody (65534) under a root-owned 0755 base, for the tests
/// that run hoardfs as a user.
fn nobody_dirs(dirs: &[&str]) -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let d = tempfile::tempdir().unwrap();
    fs::set_permissions(d.path(), fs::Permissions::from_mode(0o755)).unwrap();
    for dir in dirs {
        let p = d.path().join(dir);
        fs::create_dir(&p).unwrap();
        std::os::unix::fs::chown(&p, Some(65534), Some(65534)).unwrap();
    }
    d
}

/// The default cache directory of a user (under XDG_CACHE_HOME) is not made by an
/// invocation that is then rejected.
#[test]
fn a_rejected_invocation_leaves_no_default_cache_directory() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to run as another user");
        return;
    }
    let d = nobody_dirs(&["src", "mnt", "xdg", "home"]);
    let b = fs::canonicalize(d.path()).unwrap();
    for bad in [["--chunk-size", "3K"], ["--threads", "0"]] {
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(BIN)
            .arg(b.join("src"))
            .arg(b.join("mnt"))
            .args(bad)
            .arg("-f")
            .env("XDG_CACHE_HOME", b.join("xdg"))
            .env("HOME", b.join("home"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {err}");
        let left: Vec<_> = fs::read_dir(b.join("xdg"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert!(left.is_empty(), "{bad:?} left {left:?}");
    }
}

/// `hoardfs EMPTYDIR DATADIR` (arguments swapped) would hide DATADIR under the mount:
/// refused unless `--nonempty` / `-o nonempty`.
#[test]
fn a_non_empty_mount_point_is_refused_unless_nonempty() {
    let mut t = TestMount::unmounted_at("data", &[]);
    fs::write(t.mnt.join("precious"), b"mine").unwrap();
    // Without -f: if it mounted (the bug), it returns and the guard below unmounts.
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            if common::is_mounted(self.0) {
                let _ = Command::new("umount").arg(self.0).status();
            }
        }
    }
    let _guard = Unmount(&t.mnt);
    let out = Command::new(BIN)
        .arg(&t.src)
        .arg(&t.mnt)
        .arg("--cache-dir")
        .arg(&t.cache)
        .env("HOARDFS_LOG", "error")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!common::is_mounted(&t.mnt), "mounted over a non-empty dir");
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("is not empty") && err.contains("--nonempty"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!t.cache.exists(), "a cache was made for a refused mount");
    assert_eq!(fs::read(t.mnt.join("precious")).unwrap(), b"mine");
    drop(_guard);
    // Asked for, it mounts over it (and the file is hidden while mounted).
    t.extra_args = vec!["-o".into(), "nonempty".into()];
    fs::write(t.src.join("from-source"), b"x").unwrap();
    t.mount();
    assert!(!t.mnt.join("precious").exists());
    assert!(t.mnt.join("from-source").exists());
    t.unmount();
    assert_eq!(fs::read(t.mnt.join("precious")).unwrap(), b"mine");
}

/// A user who may not open /dev/fuse is told so once, with the fix.
#[test]
fn no_access_to_dev_fuse_is_explained_once() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to run as another user");
        return;
    }
    let d = nobody_dirs(&["src", "mnt", "cache"]);
    let b = fs::canonicalize(d.path()).unwrap();
    // /dev/fuse as a file only root may open, in a mount namespace of this test's own
    // (the machine's may well be 0666).
    let fake = b.join("fuse");
    fs::write(&fake, b"").unwrap();
    let script = r#"mount --bind "$1" /dev/fuse && shift && exec setpriv --reuid=65534 --regid=65534 --clear-groups "$@""#;
    let out = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
        ])
        .arg(&fake)
        .arg(BIN)
        .arg(b.join("src"))
        .arg(b.join("mnt"))
        .arg("--cache-dir")
        .arg(b.join("cache"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(
        err.contains("/dev/fuse") && err.contains("Permission denied"),
        "{err}"
    );
    assert!(err.contains("chmod 0666 /dev/fuse"), "the fix: {err}");
    assert!(!common::is_mounted(&b.join("mnt")));
}

/// `hoardfs set MNT log=…` takes a level or a filter, nothing else (a bare word would be
/// a target name and silence the whole log).
#[test]
fn set_log_rejects_what_is_not_a_level_or_filter() {
    let t = TestMount::new(&[]);
    let set = |v: &str| {
        Command::new(BIN)
            .args(["set", t.mnt.to_str().unwrap(), v])
            .output()
            .unwrap()
    };
    for bad in ["log=verbose", "log=hoardfs=loud", "log=info,chatty"] {
        let out = set(bad);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad} accepted");
        assert!(err.contains("not a level"), "{bad}: {err}");
    }
    for good in [
        "log=debug",
        "log=WARN",
        "log=hoardfs::cleaner=debug,info",
        "log=off",
        "log=info",
    ] {
        let out = set(good);
        assert!(out.status.success(), "{good}: {out:?}");
    }
}

/// Every key `hoardfs set` takes (docs/CONFIGURATION.md, "Settings of a running mount").
const LIVE_KEYS: &[&str] = &[
    "cache_size",
    "high_watermark",
    "low_watermark",
    "min_free",
    "stale_check",
    "close_to_open",
    "fetch_window",
    "fetch_inflight",
    "fetch_fds",
    "fetch_dir_prefetch",
    "entry_ttl",
    "attr_ttl",
    "negative_ttl",
    "watch",
    "source_timeout",
    "online",
    "max_inodes",
    "inode_free_min",
    "inode_min_age",
    "inode_max_age",
    "inode_freeing",
    "log",
];

/// `hoardfs set MNT foo=1` is refused, and its message names every key there is.
#[test]
fn set_unknown_key_error_names_every_live_key() {
    let t = TestMount::new(&[]);
    let out = Command::new(BIN)
        .args(["set", t.mnt.to_str().unwrap(), "foo=1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "foo=1 accepted");
    assert!(err.contains("unknown setting \"foo\""), "{err}");
    for k in LIVE_KEYS {
        assert!(err.contains(k), "{k} missing from {err}");
    }
}

/// `hoardfs set --help` (and `-h`) names every key `set` takes.
#[test]
fn set_help_names_every_live_key() {
    for flag in ["--help", "-h"] {
        let help = Command::new(BIN).args(["set", flag]).output().unwrap();
        assert!(help.status.success());
        let help = String::from_utf8_lossy(&help.stdout);
        for k in LIVE_KEYS {
            assert!(
                help.contains(&format!("{k}=")),
                "set {flag} omits {k}: {help}"
            );
        }
    }
}

/// `auto` restores a default on a live mount as at mount time: `cache_size=auto` is
/// `--cache-share` (80 %) of the cache's file system, `min_free=auto` 5 % of it.
#[test]
fn set_cache_size_auto_restores_the_default_limit() {
    let t = TestMount::new(&["--cache-size", "4M", "--min-free", "1M"]);
    let st = rustix::fs::statvfs(&t.cache).unwrap();
    let fs_bytes = st.f_blocks * st.f_frsize;
    let cleaner = || {
        let out = Command::new(BIN)
            .args(["stats", t.mnt.to_str().unwrap(), "--json"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let c = &v["cleaner"];
        (
            c["limit_bytes"].as_u64().unwrap(),
            c["min_free_bytes"].as_u64().unwrap(),
        )
    };
    assert_eq!(cleaner(), (4 << 20, 1 << 20));
    let out = Command::new(BIN)
        .args([
            "set",
            t.mnt.to_str().unwrap(),
            "cache_size=auto",
            "min_free=auto",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(cleaner(), (fs_bytes / 100 * 80, fs_bytes / 20));
    // A fixed default too, and a TTL.
    let out = Command::new(BIN)
        .args([
            "set",
            t.mnt.to_str().unwrap(),
            "high_watermark=95",
            "attr_ttl=3",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let out = Command::new(BIN)
        .args([
            "set",
            t.mnt.to_str().unwrap(),
            "high_watermark=auto",
            "attr_ttl=auto",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = t.stats();
    assert_eq!(
        s.cleaner.high_watermark_bytes,
        fs_bytes / 100 * 80 / 100 * 90
    );
    assert_eq!(s.coherence.attr_ttl_ms, None);
}

#[test]
fn generate_is_listed_and_writes_man_pages_with_option_values() {
    let help = Command::new(BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("generate"), "{help}");
    let d = tempfile::tempdir().unwrap();
    // A directory that does not exist is refused, not made.
    let missing = d.path().join("no/such/dir");
    let out = Command::new(BIN)
        .args(["generate", "man"])
        .arg(&missing)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("does not exist"), "{err}");
    assert!(!d.path().join("no").exists());
    let out = Command::new(BIN)
        .args(["generate", "man"])
        .arg(d.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let page = fs::read_to_string(d.path().join("hoardfs.1")).unwrap();
    let synopsis = &page[page.find(".SH SYNOPSIS").unwrap()..page.find(".SH DESCRIPTION").unwrap()];
    for want in [
        r"[\-\-cache\-dir CACHE_DIR]",
        r"[\-o OPTIONS]",
        r"[\-\-threads THREADS]",
        "SOURCE MOUNTPOINT",
    ] {
        assert!(synopsis.contains(want), "{want:?} not in {synopsis}");
    }
    let clean = fs::read_to_string(d.path().join("hoardfs-clean.1")).unwrap();
    assert!(clean.contains(r"[\-\-to SIZE] MOUNTPOINT"), "{clean}");
}

#[test]
fn a_second_daemon_on_the_same_cache_is_refused() {
    let t = TestMount::new(&[]);
    let other = tempfile::tempdir().unwrap();
    let (code, err) = run(&[
        t.src.as_os_str(),
        other.path().as_os_str(),
        "--cache-dir".as_ref(),
        t.cache.as_os_str(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("in use by another hoardfs mount"), "{err}");
    // The first mount is unharmed.
    fs::write(t.s("f"), b"still here").unwrap();
    assert_eq!(fs::read(t.m("f")).unwrap(), b"still here");
}

#[test]
fn an_unwritable_cache_directory_is_refused_clearly() {
    if !rustix::process::geteuid().is_root() {
        return;
    }
    // A user who cannot write the cache directory: nobody over a root-owned 0755 dir.
    let d = tempfile::tempdir().unwrap();
    let b = fs::canonicalize(d.path()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(&b, fs::Permissions::from_mode(0o755)).unwrap();
    for dir in ["src", "mnt", "cache"] {
        fs::create_dir(b.join(dir)).unwrap();
        fs::set_permissions(b.join(dir), fs::Permissions::from_mode(0o755)).unwrap();
    }
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(BIN)
        .arg(b.join("src"))
        .arg(b.join("mnt"))
        .arg("--cache-dir")
        .arg(b.join("cache"))
        .arg("-f")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cache directory"), "{err}");
    assert!(
        err.contains("Permission denied") || err.contains("Operation not permitted"),
        "{err}"
    );
}

/// Every byte a name may hold (all but `/` and NUL), invalid UTF-8, newlines, 255 bytes.
fn hostile_names() -> Vec<OsString> {
    let mut v: Vec<Vec<u8>> = vec![
        b"new\nline".to_vec(),
        b"\n".to_vec(),
        b"tab\there".to_vec(),
        vec![0xff, 0xfe, 0x80],
        b"-rf".to_vec(),
        b" leading and trailing ".to_vec(),
        b"...".to_vec(),
        b"*?[]{}$`'\"\\".to_vec(),
        vec![b'n'; 255],
        [vec![0xc3; 200], vec![0x28; 55]].concat(),
    ];
    let all: Vec<u8> = (1..=255u8).filter(|&c| c != b'/').collect();
    v.push(all[..127].to_vec());
    v.push(all[127..].to_vec());
    v.into_iter().map(OsString::from_vec).collect()
}

#[test]
fn names_with_any_byte_work_through_the_mount_and_the_cache() {
    let t = &mut TestMount::new(&[]);
    for (i, name) in hostile_names().iter().enumerate() {
        let content = format!("file {i}").into_bytes();
        // Made through the mount, read back through the mount and from the source.
        fs::write(t.mnt.join(name), &content).unwrap();
        assert_eq!(fs::read(t.src.join(name)).unwrap(), content, "{name:?}");
        assert_eq!(fs::read(t.mnt.join(name)).unwrap(), content, "{name:?}");
        // Made on the source, read through the mount (cached), renamed and listed.
        let dir = t.src.join(format!("d{i}"));
        fs::create_dir(&dir).unwrap();
        fs::write(dir.join(name), &content).unwrap();
        assert_eq!(
            fs::read(t.mnt.join(format!("d{i}")).join(name)).unwrap(),
            content
        );
        let mut renamed = name.clone();
        renamed.push("~");
        if renamed.len() <= 255 {
            fs::rename(t.mnt.join(name), t.mnt.join(&renamed)).unwrap();
            assert_eq!(fs::read(t.src.join(&renamed)).unwrap(), content);
        }
    }
    // A 256-byte name is refused with ENAMETOOLONG.
    let long = OsString::from_vec(vec![b'x'; 256]);
    assert_eq!(
        fs::write(t.mnt.join(&long), b"x")
            .unwrap_err()
            .raw_os_error(),
        Some(libc::ENAMETOOLONG)
    );
    let listed: Vec<OsString> = fs::read_dir(&t.mnt)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let on_source: Vec<OsString> = fs::read_dir(&t.src)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let (mut a, mut b) = (listed, on_source);
    a.sort();
    b.sort();
    assert_eq!(a, b);
    // The cached copies are under the same names, and survive a remount.
    t.remount();
    for (i, name) in hostile_names().iter().enumerate() {
        let p = Path::new(&format!("d{i}")).join(name);
        assert_eq!(
            fs::read(t.mnt.join(&p)).unwrap(),
            format!("file {i}").into_bytes()
        );
        assert!(t.cache.join("data").join(&p).is_file(), "{p:?} not cached");
    }
    assert!(
        hostile_names()
            .iter()
            .any(|n| n.as_bytes().contains(&b'\n'))
    );
}

#[test]
fn path_max_paths_and_deep_trees() {
    let t = &mut TestMount::new(&[]);
    // Deep: 400 levels, made through the mount.
    let mut deep = t.mnt.clone();
    for _ in 0..400 {
        deep.push("d");
    }
    fs::create_dir_all(&deep).unwrap();
    fs::write(deep.join("f"), b"deep").unwrap();
    let rel: PathBuf = deep.strip_prefix(&t.mnt).unwrap().join("f");
    assert_eq!(fs::read(t.src.join(&rel)).unwrap(), b"deep");
    assert_eq!(fs::read(t.mnt.join(&rel)).unwrap(), b"deep");
    // Long: components of 255 bytes up to just under PATH_MAX through the mount, then
    // past PATH_MAX reached by chdir (relative paths), where hoardfs walks in pieces.
    let comp = "p".repeat(255);
    let mut long = t.mnt.clone();
    while long.as_os_str().len() + 256 < libc::PATH_MAX as usize - 10 {
        long.push(&comp);
    }
    fs::create_dir_all(&long).unwrap();
    fs::write(long.join("f"), b"long").unwrap();
    assert_eq!(fs::read(long.join("f")).unwrap(), b"long");
    let too_long = long.join(&comp).join("f");
    assert!(too_long.as_os_str().len() > libc::PATH_MAX as usize);
    assert_eq!(
        fs::write(&too_long, b"x").unwrap_err().raw_os_error(),
        Some(libc::ENAMETOOLONG)
    );
    // Beyond PATH_MAX from the mount's root, in a child that chdirs down step by step
    // (relative paths only: the kernel never sees the whole path; hoardfs does, and walks
    // it in pieces).
    let down = |make: bool| {
        let script = r#"
            my ($c, $make) = @ARGV;
            for (1..8) { mkdir $c if $make; chdir $c or die "chdir: $!\n" }
            if ($make) { open(F, ">f") or die "create: $!\n"; print F "beyond\n"; close F }
            open(F, "<f") or die "open: $!\n"; print <F>;
        "#;
        Command::new("perl")
            .args(["-e", script, &comp, if make { "1" } else { "" }])
            .current_dir(&long)
            .output()
            .unwrap()
    };
    let out = down(true);
    assert_eq!(out.stdout, b"beyond\n", "{out:?}");
    let beyond_len = long.as_os_str().len() + 8 * 256 + 2;
    assert!(beyond_len > libc::PATH_MAX as usize);
    t.remount();
    let out = down(false);
    assert_eq!(out.stdout, b"beyond\n", "{out:?}");
    assert_eq!(fs::read(t.mnt.join(&rel)).unwrap(), b"deep");
}

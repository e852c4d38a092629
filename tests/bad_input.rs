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
            1,
            "power of two",
        ),
        (
            vec![p("src").into(), p("mnt").into(), o("--chunk-size"), o("1K")],
            1,
            "at least 4 KiB",
        ),
        (
            vec![
                p("src").into(),
                p("mnt").into(),
                o("--low-watermark"),
                o("95"),
            ],
            1,
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
            1,
            "threads",
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
        let refs: Vec<&OsStr> = args.iter().map(|a| a.as_os_str()).collect();
        let (got, err) = run(&refs);
        assert_eq!(got, *code, "{args:?}: {err}");
        assert!(err.contains(msg), "{args:?}: expected {msg:?} in {err:?}");
        assert!(
            err.lines().count() <= 6,
            "{args:?}: message too long: {err}"
        );
    }
    // None of these mounted anything or wrote a cache into the source.
    assert!(!p("src/inner").join("FORMAT").exists());
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

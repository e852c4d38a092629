//! Mounts of an S3 bucket (versitygw on loopback): each claim of docs/SEMANTICS.md has a
//! test here, checked against the bucket itself through `ObjectSource`, the way another
//! S3 client sees it.

mod common;
#[path = "common/s3.rs"]
mod s3;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{TestMount, pattern, wait_until};
use hoardfs::object_source::{ObjKind, ObjMeta, ObjectSource, ObjectUrl};
use s3::{ACCESS_KEY, SECRET_KEY, Versity};

const BUCKET: &str = "hoard";

/// The bucket as another S3 client sees it.
fn client(v: &Versity) -> ObjectSource {
    let url = ObjectUrl::parse(&format!("s3://{BUCKET}")).unwrap();
    ObjectSource::open_with_env(&url, s3::client_options(&v.endpoint), &|_| None, false).unwrap()
}

fn put(c: &ObjectSource, rel: &str, data: &[u8]) {
    let mut f = tempfile::tempfile().unwrap();
    std::io::Write::write_all(&mut f, data).unwrap();
    c.put(Path::new(rel), &f, &ObjMeta::default()).unwrap();
}

fn get(c: &ObjectSource, rel: &str) -> Vec<u8> {
    let st = c.stat(Path::new(rel)).unwrap();
    c.read_range(Path::new(rel), 0, st.size, None)
        .unwrap()
        .to_vec()
}

fn unmounted(v: &Versity, url: &str, args: &[&str]) -> TestMount {
    let mut m = TestMount::unmounted_at("mnt", args);
    m.src = PathBuf::from(url);
    m.extra_args
        .extend(["--s3-endpoint".to_string(), v.endpoint.clone()]);
    m.env.extend([
        ("AWS_ACCESS_KEY_ID".to_string(), ACCESS_KEY.to_string()),
        ("AWS_SECRET_ACCESS_KEY".to_string(), SECRET_KEY.to_string()),
        ("AWS_REGION".to_string(), "us-east-1".to_string()),
        // No profile files of the machine's user.
        ("AWS_CONFIG_FILE".to_string(), "/nonexistent".to_string()),
        (
            "AWS_SHARED_CREDENTIALS_FILE".to_string(),
            "/nonexistent".to_string(),
        ),
    ]);
    m
}

fn mount(v: &Versity, args: &[&str]) -> TestMount {
    let mut m = unmounted(v, &format!("s3://{BUCKET}"), args);
    m.mount();
    m
}

#[test]
fn reads_cold_then_warm_from_the_cache_alone() {
    let v = Versity::start(&[BUCKET]);
    let c = client(&v);
    let big = pattern(20 << 20, 1);
    put(&c, "data/big.bin", &big);
    for i in 0..20 {
        put(
            &c,
            &format!("data/small/{i:02}.txt"),
            format!("file {i}\n").as_bytes(),
        );
    }
    let mut m = mount(&v, &[]);
    // Listing from prefixes, the cold read by ranged GETs.
    let mut names: Vec<String> = std::fs::read_dir(m.m("data/small"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 20);
    assert!(std::fs::metadata(m.m("data")).unwrap().is_dir());
    assert_eq!(std::fs::read(m.m("data/big.bin")).unwrap(), big);
    for i in 0..20 {
        let got = std::fs::read(m.m(&format!("data/small/{i:02}.txt"))).unwrap();
        assert_eq!(got, format!("file {i}\n").as_bytes());
    }
    let cold = m.stats().cache;
    assert!(cold.bytes_from_source >= big.len() as u64, "{cold:?}");
    // Chunks of 8 MiB on an object store, each one GET: 3 for 20 MiB, 1 per small file.
    assert_eq!(cold.chunks_fetched, 3 + 20, "{cold:?}");

    // Warm after a remount: validated by HEAD, served by passthrough, no GET.
    m.remount();
    assert_eq!(std::fs::read(m.m("data/big.bin")).unwrap(), big);
    for i in 0..20 {
        std::fs::read(m.m(&format!("data/small/{i:02}.txt"))).unwrap();
    }
    let warm = m.stats().cache;
    assert_eq!(warm.bytes_from_source, 0, "{warm:?}");
    assert_eq!(warm.open_hits, 21, "{warm:?}");
    assert!(warm.passthrough_opens >= 21, "{warm:?}");
}

#[test]
fn writes_reach_the_bucket_on_close_with_their_metadata() {
    let v = Versity::start(&[BUCKET]);
    let c = client(&v);
    put(&c, "old.txt", b"0123456789");
    let m = mount(&v, &[]);

    // Create: the object exists at once, its content on close.
    std::fs::write(m.m("new.txt"), b"hello").unwrap();
    assert_eq!(get(&c, "new.txt"), b"hello");
    let st = c.stat(Path::new("new.txt")).unwrap();
    assert_eq!(st.meta.mode, Some(0o644), "{st:?}");
    assert_eq!(st.meta.uid, Some(rustix::process::geteuid().as_raw()));

    // A partial overwrite of an existing object: read, modify, upload.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(m.m("old.txt"))
            .unwrap();
        f.write_all_at(b"ab", 4).unwrap();
        // fsync uploads too.
        f.sync_all().unwrap();
        assert_eq!(get(&c, "old.txt"), b"0123ab6789");
        f.write_all_at(b"XYZ", 10).unwrap();
        // Until close the mount shows the written size, the store the older object.
        assert_eq!(std::fs::metadata(m.m("old.txt")).unwrap().len(), 13);
    }
    assert_eq!(get(&c, "old.txt"), b"0123ab6789XYZ");
    assert_eq!(std::fs::read(m.m("old.txt")).unwrap(), b"0123ab6789XYZ");

    // Truncation, mode and mtime.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(m.m("old.txt"))
        .unwrap();
    f.set_len(4).unwrap();
    drop(f);
    assert_eq!(get(&c, "old.txt"), b"0123");
    std::fs::set_permissions(m.m("old.txt"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let t = UNIX_EPOCH + Duration::from_secs(1_600_000_000);
    std::fs::File::options()
        .write(true)
        .open(m.m("old.txt"))
        .unwrap()
        .set_modified(t)
        .unwrap();
    let st = c.stat(Path::new("old.txt")).unwrap();
    assert_eq!(st.meta.mode, Some(0o600), "{st:?}");
    assert_eq!(st.mtime, t, "{st:?}");
    let md = std::fs::metadata(m.m("old.txt")).unwrap();
    assert_eq!(md.mode() & 0o7777, 0o600);
    assert_eq!(md.mtime(), 1_600_000_000);
    assert_eq!(
        get(&c, "old.txt"),
        b"0123",
        "content kept by metadata changes"
    );

    // Rename of a file is copy + delete; unlink deletes.
    std::fs::rename(m.m("old.txt"), m.m("moved.txt")).unwrap();
    assert_eq!(get(&c, "moved.txt"), b"0123");
    assert_eq!(
        c.stat(Path::new("old.txt")).unwrap_err().raw_os_error(),
        Some(libc::ENOENT)
    );
    std::fs::remove_file(m.m("moved.txt")).unwrap();
    assert!(c.stat(Path::new("moved.txt")).is_err());

    // Directories are `dir/` markers; a large file goes up in parts.
    std::fs::create_dir(m.m("d")).unwrap();
    assert_eq!(c.stat(Path::new("d")).unwrap().kind, ObjKind::Dir);
    let big = pattern(40 << 20, 7);
    std::fs::write(m.m("d/big.bin"), &big).unwrap();
    assert!(get(&c, "d/big.bin") == big, "multipart upload differs");
    std::fs::remove_file(m.m("d/big.bin")).unwrap();
    std::fs::remove_dir(m.m("d")).unwrap();
    assert!(c.stat(Path::new("d")).is_err());
    let s = m.stats().cache;
    assert!(
        s.uploads >= 5 && s.bytes_uploaded >= big.len() as u64,
        "{s:?}"
    );
}

/// `aws` (the AWS CLI, which `.ci/run` installs) against the test server: JSON out.
fn aws(v: &Versity, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new("aws")
        .args([
            "--endpoint-url",
            &v.endpoint,
            "--region",
            "us-east-1",
            "--output",
            "json",
        ])
        .args(args)
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        .env("AWS_CONFIG_FILE", "/nonexistent")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .output()
        .expect("the aws CLI (installed by .ci/run)");
    assert!(
        out.status.success(),
        "aws {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

#[test]
fn the_aws_cli_sees_what_the_semantics_document_says() {
    let v = Versity::start(&[BUCKET]);
    let c = client(&v);
    put(&c, "gone.txt", b"x");
    let m = mount(&v, &[]);
    // Write, overwrite in part, chmod, set the mtime, rename, mkdir, delete.
    std::fs::write(m.m("a.txt"), b"first version").unwrap();
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(m.m("a.txt"))
            .unwrap();
        f.write_all_at(b"FIRST", 0).unwrap();
    }
    std::fs::set_permissions(m.m("a.txt"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::File::options()
        .write(true)
        .open(m.m("a.txt"))
        .unwrap()
        .set_modified(UNIX_EPOCH + Duration::from_secs(1_600_000_000))
        .unwrap();
    std::fs::rename(m.m("a.txt"), m.m("b.txt")).unwrap();
    std::fs::create_dir(m.m("d")).unwrap();
    std::fs::write(m.m("d/e.txt"), b"e").unwrap();
    std::fs::remove_file(m.m("gone.txt")).unwrap();

    // The keys: the renamed object, the directory's marker, the new file; nothing else.
    let list = aws(&v, &["s3api", "list-objects-v2", "--bucket", BUCKET]);
    let mut keys: Vec<&str> = list["Contents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["Key"].as_str().unwrap())
        .collect();
    keys.sort();
    assert_eq!(keys, ["b.txt", "d/", "d/e.txt"], "{list}");

    // The object: its bytes, and mode, owner and mtime in s3fs/rclone metadata, kept by
    // the rename (copy + delete).
    let head = aws(
        &v,
        &["s3api", "head-object", "--bucket", BUCKET, "--key", "b.txt"],
    );
    assert_eq!(head["ContentLength"], 13, "{head}");
    let meta = &head["Metadata"];
    assert_eq!(meta["mode"], (libc::S_IFREG | 0o640).to_string(), "{head}");
    assert_eq!(meta["uid"], rustix::process::geteuid().as_raw().to_string());
    assert_eq!(meta["gid"], rustix::process::getegid().as_raw().to_string());
    let mtime: f64 = meta["mtime"].as_str().unwrap().parse().unwrap();
    assert_eq!(mtime, 1_600_000_000.0, "{head}");
    let out = tempfile::NamedTempFile::new().unwrap();
    aws(
        &v,
        &["s3", "cp", "s3://hoard/b.txt", out.path().to_str().unwrap()],
    );
    assert_eq!(std::fs::read(out.path()).unwrap(), b"FIRST version");
}

#[test]
fn a_file_unlinked_or_renamed_while_open_for_writing_behaves_as_on_a_disk() {
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    let v = Versity::start(&[BUCKET]);
    let c = client(&v);
    let m = mount(&v, &[]);
    // Unlinked while open: writes, reads and fstat go on (the cache file holds them),
    // close succeeds, and no object comes back.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.m("tmp.txt"))
        .unwrap();
    f.write_all(b"before").unwrap();
    std::fs::remove_file(m.m("tmp.txt")).unwrap();
    f.write_all(b" after").unwrap();
    let mut buf = [0u8; 12];
    f.read_exact_at(&mut buf, 0).unwrap();
    assert_eq!(&buf, b"before after");
    let st = f.metadata().unwrap();
    assert_eq!((st.len(), st.nlink()), (12, 0));
    drop(f);
    assert!(c.stat(Path::new("tmp.txt")).is_err());
    assert!(!m.m("tmp.txt").exists());

    // Renamed while open: the close uploads everything under the new name.
    let mut f = std::fs::File::create(m.m("r1.txt")).unwrap();
    f.write_all(b"one").unwrap();
    std::fs::rename(m.m("r1.txt"), m.m("r2.txt")).unwrap();
    f.write_all(b" two").unwrap();
    drop(f);
    assert_eq!(get(&c, "r2.txt"), b"one two");
    assert!(c.stat(Path::new("r1.txt")).is_err());
}

/// A flush uploads the file while other threads stat it: a stat never shows the store's
/// older object once a write has returned (the stat's HEAD may come before an upload
/// that clears the pending mark before the answer is made).
#[test]
fn stats_racing_flushes_never_show_a_size_older_than_the_last_write() {
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let v = Versity::start(&[BUCKET]);
    let m = mount(&v, &[]);
    let f = std::fs::File::create(m.m("grow.txt")).unwrap();
    let acked = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    let rounds = 150u64;
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let mut stats = 0u64;
                while !done.load(Ordering::Acquire) {
                    let low = acked.load(Ordering::Acquire);
                    let len = std::fs::metadata(m.m("grow.txt")).unwrap().len();
                    assert!(len >= low, "stat gave {len} bytes after a write made {low}");
                    stats += 1;
                }
                assert!(stats > 10, "only {stats} stats raced the flushes");
            });
        }
        for n in 0..rounds {
            f.write_all_at(b"x", n).unwrap();
            acked.store(n + 1, Ordering::Release);
            // close(dup(fd)) sends FLUSH, which uploads (as an exec'd child's close does).
            drop(f.as_fd().try_clone_to_owned().unwrap());
        }
        done.store(true, Ordering::Release);
    });
    drop(f);
    assert_eq!(get(&client(&v), "grow.txt"), vec![b'x'; rounds as usize]);
}

#[test]
fn an_emptied_prefix_directory_stays_until_rmdir() {
    let v = Versity::start(&[BUCKET]);
    let c = client(&v);
    put(&c, "p/only.txt", b"x");
    put(&c, "q/a.txt", b"a");
    put(&c, "q/sub/b.txt", b"b");
    let m = mount(&v, &[]);
    std::fs::remove_file(m.m("p/only.txt")).unwrap();
    assert!(std::fs::metadata(m.m("p")).unwrap().is_dir());
    assert_eq!(c.stat(Path::new("p")).unwrap().kind, ObjKind::Dir);
    std::fs::remove_dir(m.m("p")).unwrap();
    assert!(c.stat(Path::new("p")).is_err());

    // A directory rename answers EXDEV, and mv copies the tree instead.
    let e = std::fs::rename(m.m("q"), m.m("r")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EXDEV));
    let st = std::process::Command::new("mv")
        .arg(m.m("q"))
        .arg(m.m("r"))
        .status()
        .unwrap();
    assert!(st.success());
    assert_eq!(get(&c, "r/a.txt"), b"a");
    assert_eq!(get(&c, "r/sub/b.txt"), b"b");
    assert!(c.stat(Path::new("q")).is_err());
}

#[test]
fn what_an_object_store_cannot_do_answers_a_clear_errno() {
    let v = Versity::start(&[BUCKET]);
    let c = client(&v);
    put(&c, "f.txt", b"f");
    let m = mount(&v, &[]);
    let errno = |r: std::io::Result<()>| r.unwrap_err().raw_os_error();
    assert_eq!(
        errno(std::fs::hard_link(m.m("f.txt"), m.m("g.txt"))),
        Some(libc::EPERM)
    );
    assert_eq!(
        errno(std::os::unix::fs::symlink("f.txt", m.m("l"))),
        Some(libc::EPERM)
    );
    let out = std::process::Command::new("setfattr")
        .args(["-n", "user.x", "-v", "1"])
        .arg(m.m("f.txt"))
        .output();
    if let Ok(out) = out {
        assert!(!out.status.success());
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(text.contains("not supported"), "{text}");
    }
    // Locks are the kernel's, local to this machine.
    let f = std::fs::File::open(m.m("f.txt")).unwrap();
    f.lock().unwrap();
    f.unlock().unwrap();
}

#[test]
fn a_file_closed_through_one_mount_is_read_by_another_on_its_next_open() {
    let v = Versity::start(&[BUCKET]);
    let c = client(&v);
    put(&c, "shared.txt", b"version one");
    let a = mount(&v, &[]);
    let b = mount(&v, &[]);
    assert_eq!(std::fs::read(b.m("shared.txt")).unwrap(), b"version one");
    std::fs::write(a.m("shared.txt"), b"version two, longer").unwrap();
    assert_eq!(
        std::fs::read(b.m("shared.txt")).unwrap(),
        b"version two, longer"
    );
    // The same size within the same second: the ETag tells them apart.
    std::fs::write(a.m("shared.txt"), b"version 3!!, longer").unwrap();
    assert_eq!(
        std::fs::read(b.m("shared.txt")).unwrap(),
        b"version 3!!, longer"
    );
    std::fs::write(a.m("fresh.txt"), b"new").unwrap();
    wait_until(
        Duration::from_secs(30),
        "the new name in the other mount",
        || std::fs::read(b.m("fresh.txt")).is_ok_and(|d| d == b"new"),
    );
}

#[test]
fn a_stopped_server_leaves_the_cache_readable_and_the_mount_comes_back() {
    let mut v = Versity::start(&[BUCKET]);
    let c = client(&v);
    put(&c, "dir/cached.txt", b"cached");
    put(&c, "dir/uncached.txt", b"never read");
    let m = mount(&v, &[]);
    // The server stops: the mount goes offline, and says so.
    m.expect_warnings();
    assert_eq!(std::fs::read(m.m("dir/cached.txt")).unwrap(), b"cached");
    drop(c);
    v.stop();
    wait_until(Duration::from_secs(30), "offline", || {
        // Any request that reaches the dead server takes the mount offline.
        let _ = std::fs::read(m.m("dir/uncached.txt"));
        !m.stats().health.online
    });
    assert_eq!(std::fs::read(m.m("dir/cached.txt")).unwrap(), b"cached");
    let e = std::fs::read(m.m("dir/uncached.txt")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO));
    let mut names: Vec<_> = std::fs::read_dir(m.m("dir"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["cached.txt", "uncached.txt"]);
    assert_eq!(
        std::fs::write(m.m("dir/x"), b"x")
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EROFS)
    );
    v.restart();
    wait_until(Duration::from_secs(30), "online again", || {
        m.stats().health.online
    });
    assert_eq!(
        std::fs::read(m.m("dir/uncached.txt")).unwrap(),
        b"never read"
    );
    let _ = SystemTime::now();
}

#[test]
fn a_bucket_prefix_is_a_tree_of_its_own() {
    let v = Versity::start(&[BUCKET]);
    let c = client(&v);
    put(&c, "team/a/x.txt", b"x");
    put(&c, "other/y.txt", b"y");
    let mut m = unmounted(&v, &format!("s3://{BUCKET}/team"), &[]);
    m.mount();
    assert_eq!(std::fs::read(m.m("a/x.txt")).unwrap(), b"x");
    assert!(!m.m("other").exists());
    std::fs::write(m.m("b.txt"), b"b").unwrap();
    assert_eq!(get(&c, "team/b.txt"), b"b");
}

#[test]
fn bad_object_store_options_get_clear_errors() {
    let v = Versity::start(&[BUCKET]);
    let profiles = tempfile::tempdir().unwrap();
    let config = profiles.path().join("config");
    std::fs::write(
        &config,
        "[profile corp]\nsso_session = corp\nsso_role_name = R\n",
    )
    .unwrap();
    let run_as = |url: &str, extra: &[&str], profile: Option<&str>| {
        let mut m = unmounted(&v, url, extra);
        if let Some(p) = profile {
            // No keys in the environment: the profile's way to credentials decides.
            m.env
                .retain(|(k, _)| !k.starts_with("AWS_") || k == "AWS_REGION");
            m.env.extend([
                ("AWS_PROFILE".to_string(), p.to_string()),
                ("AWS_CONFIG_FILE".to_string(), config.display().to_string()),
                (
                    "AWS_SHARED_CREDENTIALS_FILE".to_string(),
                    "/nonexistent".to_string(),
                ),
            ]);
        }
        let out = std::process::Command::new(common::BIN)
            .arg(&m.src)
            .arg(&m.mnt)
            .arg("--cache-dir")
            .arg(&m.cache)
            .arg("-f")
            .args(&m.extra_args)
            .envs(m.env.iter().map(|(k, v)| (k, v)))
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let run = |url: &str, extra: &[&str]| run_as(url, extra, None);
    let e = run("s3://", &[]);
    assert!(e.contains("no bucket name"), "{e}");
    let e = run("gs://bucket", &[]);
    assert!(e.contains("s3://BUCKET"), "{e}");
    let e = run(&format!("s3://{BUCKET}"), &["--offline-writes", "log"]);
    assert!(e.contains("not available for object-store sources"), "{e}");
    let e = run("s3://no-such-bucket", &[]);
    assert!(e.contains("cannot use the source"), "{e}");
    // A profile that gets its keys from IAM Identity Center: refused, naming the key.
    let e = run_as(&format!("s3://{BUCKET}"), &[], Some("corp"));
    assert!(
        e.contains("AWS profile \"corp\"") && e.contains("(sso_session)"),
        "{e}"
    );
}

/// By hand (`cargo test --release --test object_mount -- --ignored --nocapture`): a cold
/// read of a large object through the mount against the same client downloading it by
/// ranged GETs (8 MiB, 4 at a time), and the warm read after a remount. Prints; asserts
/// only correctness (times belong to the benchmarks).
#[test]
#[ignore]
fn measure_cold_read_against_ranged_gets() {
    let size: usize = std::env::var("HOARDFS_MEASURE_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024)
        << 20;
    let v = Versity::start(&[BUCKET]);
    let c = client(&v);
    {
        let mut f = tempfile::tempfile().unwrap();
        let piece = pattern(1 << 20, 3);
        for _ in 0..size >> 20 {
            std::io::Write::write_all(&mut f, &piece).unwrap();
        }
        c.put(Path::new("big.bin"), &f, &ObjMeta::default())
            .unwrap();
    }
    let t = Instant::now();
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let off = (i as u64) << 23;
                    if off >= size as u64 {
                        return;
                    }
                    let b = c
                        .read_range(Path::new("big.bin"), off, 8 << 20, None)
                        .unwrap();
                    assert!(!b.is_empty());
                }
            });
        }
    });
    let direct = t.elapsed();
    let mut m = mount(&v, &[]);
    let read_all = |p: &Path| {
        let mut f = std::fs::File::open(p).unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0;
        loop {
            let k = std::io::Read::read(&mut f, &mut buf).unwrap();
            if k == 0 {
                return n;
            }
            n += k;
        }
    };
    let t = Instant::now();
    assert_eq!(read_all(&m.m("big.bin")), size);
    let cold = t.elapsed();
    m.remount();
    let t = Instant::now();
    assert_eq!(read_all(&m.m("big.bin")), size);
    let warm = t.elapsed();
    let s = m.stats().cache;
    let mib = (size >> 20) as f64;
    println!(
        "{mib} MiB: ranged GETs {:.0} MiB/s, mount cold {:.0} MiB/s ({:.2} of direct), warm {:.0} MiB/s; warm bytes_from_source {}",
        mib / direct.as_secs_f64(),
        mib / cold.as_secs_f64(),
        direct.as_secs_f64() / cold.as_secs_f64(),
        mib / warm.as_secs_f64(),
        s.bytes_from_source
    );
    assert_eq!(s.bytes_from_source, 0);
}

/// `--open-lease` on an object store: within the lease an open sends no HEAD (the lease
/// answers it), so another mount's write is read once a lease's length has passed since
/// it, and no later; the mount's own write is read by its next open at once.
#[test]
fn open_leases_spare_the_head_per_open_and_lapse_in_time() {
    let v = Versity::start(&[BUCKET]);
    let c = client(&v);
    put(&c, "leased.txt", b"version 0");
    let a = mount(&v, &[]);
    let b = mount(&v, &["--open-lease", "1"]);
    let hits = |m: &TestMount| m.stats().coherence.open_lease_hits;
    for round in 1..=4u32 {
        let now = format!("version {}", round - 1);
        assert_eq!(std::fs::read(b.m("leased.txt")).unwrap(), now.as_bytes());
        let before = hits(&b);
        assert_eq!(std::fs::read(b.m("leased.txt")).unwrap(), now.as_bytes());
        assert!(
            hits(&b) > before,
            "round {round}: an open answered by the lease"
        );
        let next = format!("version {round}");
        if round % 2 == 0 {
            // Through this mount: its next open reads it.
            std::fs::write(b.m("leased.txt"), next.as_bytes()).unwrap();
            assert_eq!(std::fs::read(b.m("leased.txt")).unwrap(), next.as_bytes());
            continue;
        }
        std::fs::write(a.m("leased.txt"), next.as_bytes()).unwrap();
        let written = std::time::Instant::now();
        loop {
            let began = written.elapsed();
            let got = std::fs::read(b.m("leased.txt")).unwrap();
            if got == next.as_bytes() {
                break;
            }
            assert_eq!(got, now.as_bytes(), "round {round}: neither version");
            assert!(
                began < Duration::from_secs(1),
                "round {round}: the old version read {began:?} after the write"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

//! `object_source` against a real S3 server (versitygw on loopback), and against tiny fake
//! servers for the failures a real one will not produce on demand (503 SlowDown, a hang).

#[path = "common/s3.rs"]
mod s3;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hoardfs::object_source::ObjectError;
use hoardfs::object_source::{
    Credentials, ObjKind, ObjMeta, ObjectSource, ObjectUrl, S3Options, errno_of,
};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjPath;
use object_store::{
    Attribute, AttributeValue, Attributes, GetOptions, ObjectStore, ObjectStoreExt, PutOptions,
    PutPayload,
};
use s3::{ACCESS_KEY, SECRET_KEY, Versity};

const BUCKET: &str = "hoard";

fn opts(endpoint: &str) -> S3Options {
    s3::client_options(endpoint)
}

fn open_with(url: &str, o: S3Options) -> ObjectSource {
    ObjectSource::open_with_env(&ObjectUrl::parse(url).unwrap(), o, &|_| None, false).unwrap()
}

fn open(v: &Versity, url: &str) -> ObjectSource {
    open_with(url, opts(&v.endpoint))
}

/// A plain object_store client, to write objects the way other tools do.
fn raw(v: &Versity) -> (tokio::runtime::Runtime, AmazonS3) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // reqwest has no TLS provider of its own in this build (`install_tls_provider`).
    hoardfs::object_source::install_tls_provider();
    let s = AmazonS3Builder::new()
        .with_bucket_name(BUCKET)
        .with_region("us-east-1")
        .with_endpoint(&v.endpoint)
        .with_allow_http(true)
        .with_access_key_id(ACCESS_KEY)
        .with_secret_access_key(SECRET_KEY)
        .build()
        .unwrap();
    (rt, s)
}

fn raw_put(
    rt: &tokio::runtime::Runtime,
    s: &AmazonS3,
    key: &str,
    data: &[u8],
    meta: &[(&str, &str)],
) {
    let mut attributes = Attributes::new();
    for (k, v) in meta {
        attributes.insert(
            Attribute::Metadata(k.to_string().into()),
            AttributeValue::from(v.to_string()),
        );
    }
    let opts = PutOptions {
        attributes,
        ..Default::default()
    };
    rt.block_on(s.put_opts(
        &ObjPath::parse(key).unwrap(),
        PutPayload::from(data.to_vec()),
        opts,
    ))
    .unwrap();
}

fn file_with(data: &[u8]) -> std::fs::File {
    let mut f = tempfile::tempfile().unwrap();
    f.write_all(data).unwrap();
    f
}

fn errno<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.unwrap_err().raw_os_error().expect("an errno")
}

fn p(s: &str) -> &Path {
    Path::new(s)
}

/// Deterministic bytes that differ at every offset of a part.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

#[test]
fn put_stat_read_small() {
    let v = Versity::start(&[BUCKET]);
    let s = open(&v, &format!("s3://{BUCKET}"));
    let data = b"hello, object world\n".repeat(100);
    let mtime = UNIX_EPOCH + Duration::new(1_650_000_000, 250_000_000);
    let meta = ObjMeta {
        mode: Some(0o640),
        uid: Some(1234),
        gid: Some(5678),
        mtime: Some(mtime),
    };
    let put = s.put(p("dir/a b%c.txt"), &file_with(&data), &meta).unwrap();
    let st = s.stat(p("dir/a b%c.txt")).unwrap();
    assert_eq!(put, st);
    assert_eq!(st.kind, ObjKind::File);
    assert_eq!(st.size, data.len() as u64);
    assert_eq!(st.meta, meta);
    assert_eq!(st.mtime, mtime);
    assert!(st.meta_known);
    let etag = st.etag.clone().expect("an ETag");
    // The key is the name as is (no percent-encoding in the stored key).
    assert!(v.bucket_dir(BUCKET).join("dir/a b%c.txt").is_file());

    let r = |off, len| {
        s.read_range(p("dir/a b%c.txt"), off, len, Some(&etag))
            .unwrap()
    };
    assert_eq!(&r(0, 5)[..], b"hello");
    assert_eq!(&r(7, 6)[..], b"object");
    assert_eq!(&r(1990, 100)[..], &data[1990..]);
    assert_eq!(r(2000, 10).len(), 0, "a read at EOF is empty");
    assert_eq!(r(5000, 10).len(), 0, "a read past EOF is empty");
    assert_eq!(r(0, 0).len(), 0);
    assert_eq!(
        &s.read_range(p("dir/a b%c.txt"), 0, 5, None).unwrap()[..],
        b"hello"
    );
    assert_eq!(errno(s.read_range(p("dir/none"), 0, 5, None)), libc::ENOENT);
    assert_eq!(errno(s.stat(p("dir/none"))), libc::ENOENT);

    // An empty file.
    let st = s
        .put(p("empty"), &file_with(b""), &ObjMeta::default())
        .unwrap();
    assert_eq!((st.kind, st.size), (ObjKind::File, 0));
    assert_eq!(st.meta, ObjMeta::default());
    assert_eq!(st.mtime, st.last_modified);
    assert_eq!(
        s.read_range(p("empty"), 0, 10, st.etag.as_deref())
            .unwrap()
            .len(),
        0
    );
}

#[test]
fn multipart_64_mib_and_ranged_reads() {
    let v = Versity::start(&[BUCKET]);
    let s = open_with(
        &format!("s3://{BUCKET}/big"),
        S3Options {
            multipart_threshold: 16 << 20,
            part_size: 8 << 20,
            parts_in_flight: 4,
            call_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(30),
            ..opts(&v.endpoint)
        },
    );
    let data = pattern(64 << 20, 42);
    let t = Instant::now();
    let st = s
        .put(p("blob.bin"), &file_with(&data), &ObjMeta::default())
        .unwrap();
    eprintln!("64 MiB multipart put: {:?}", t.elapsed());
    assert_eq!(st.size, data.len() as u64);
    let etag = st.etag.clone().unwrap();
    // S3's multipart ETag: "<md5 of the part md5s>-<parts>".
    assert!(etag.trim_matches('"').ends_with("-8"), "{etag}");
    let on_disk = std::fs::read(v.bucket_dir(BUCKET).join("big/blob.bin")).unwrap();
    assert!(on_disk == data, "the stored object differs from the file");
    let mib = 1u64 << 20;
    for (off, len) in [
        (0, 4096),
        (8 * mib - 100, 200), // across a part boundary
        (13 * mib + 7, 3 * mib),
        (64 * mib - 10, 4096), // short at the end
        (32 * mib, 8 * mib),
    ] {
        let got = s.read_range(p("blob.bin"), off, len, Some(&etag)).unwrap();
        let end = (off + len).min(data.len() as u64) as usize;
        assert!(got[..] == data[off as usize..end], "range {off}+{len}");
    }
}

#[test]
fn listing_prefixes_and_markers() {
    let v = Versity::start(&[BUCKET]);
    let (rt, raw) = raw(&v);
    for k in [
        "top.txt",
        "pre/a.txt",
        "pre/d1/x",
        "pre/d1/y",
        "pre/d3/sub/z",
        "pre-other/q",
        "outside/w",
    ] {
        raw_put(&rt, &raw, k, k.as_bytes(), &[]);
    }
    let s = open(&v, &format!("s3://{BUCKET}/pre"));
    // A directory with only a marker object (what s3fs and rclone leave for mkdir).
    s.mkdir(p("d2"), &ObjMeta::default()).unwrap();

    let names = |rel: &str| -> Vec<(String, ObjKind)> {
        s.list_dir(p(rel))
            .unwrap()
            .into_iter()
            .map(|(n, st)| (n, st.kind))
            .collect()
    };
    use ObjKind::{Dir, File};
    assert_eq!(
        names(""),
        vec![
            ("a.txt".into(), File),
            ("d1".into(), Dir),
            ("d2".into(), Dir),
            ("d3".into(), Dir)
        ]
    );
    assert_eq!(names("d1"), vec![("x".into(), File), ("y".into(), File)]);
    assert_eq!(names("d2"), vec![], "the marker is not listed as a file");
    assert_eq!(names("d3"), vec![("sub".into(), Dir)]);
    let listed = s.list_dir(p("d1")).unwrap();
    assert_eq!(listed[0].1.size, 8);
    assert!(!listed[0].1.meta_known);
    assert_eq!(
        listed[0].1.identity(),
        s.stat(p("d1/x")).unwrap().identity()
    );

    assert_eq!(s.stat(p("")).unwrap().kind, Dir);
    assert_eq!(s.stat(p("d2")).unwrap().kind, Dir, "marker only");
    assert_eq!(s.stat(p("d3")).unwrap().kind, Dir, "implied by d3/sub/z");
    assert_eq!(s.stat(p("d3/sub")).unwrap().kind, Dir);
    assert_eq!(errno(s.stat(p("d4"))), libc::ENOENT);
    assert_eq!(errno(s.list_dir(p("a.txt"))), libc::ENOTDIR);
    assert_eq!(errno(s.list_dir(p("nothing"))), libc::ENOENT);
    // Outside the prefix is invisible, `pre-other` included.
    assert_eq!(errno(s.stat(p("../outside/w"))), libc::EINVAL);

    // The whole bucket.
    let all = open(&v, &format!("s3://{BUCKET}"));
    let root: Vec<String> = all
        .list_dir(p(""))
        .unwrap()
        .into_iter()
        .map(|e| e.0)
        .collect();
    assert_eq!(root, ["outside", "pre", "pre-other", "top.txt"]);
    // An empty prefix directory is an empty root.
    let fresh = open(&v, &format!("s3://{BUCKET}/not-there-yet"));
    assert_eq!(fresh.list_dir(p("")).unwrap(), vec![]);
}

#[test]
fn etag_change_is_estale() {
    let v = Versity::start(&[BUCKET]);
    let s = open(&v, &format!("s3://{BUCKET}"));
    let one = s
        .put(p("f"), &file_with(b"version one"), &ObjMeta::default())
        .unwrap();
    let e1 = one.etag.clone().unwrap();
    assert_eq!(
        &s.read_range(p("f"), 0, 7, Some(&e1)).unwrap()[..],
        b"version"
    );
    let two = s
        .put(p("f"), &file_with(b"version two"), &ObjMeta::default())
        .unwrap();
    let e2 = two.etag.clone().unwrap();
    assert_ne!(e1, e2);
    assert_ne!(one.identity(), two.identity());
    assert_eq!(errno(s.read_range(p("f"), 0, 7, Some(&e1))), libc::ESTALE);
    assert_eq!(&s.read_range(p("f"), 8, 3, Some(&e2)).unwrap()[..], b"two");
}

#[test]
fn metadata_in_s3fs_and_rclone_conventions() {
    let v = Versity::start(&[BUCKET]);
    let (rt, raw) = raw(&v);
    // s3fs: full st_mode in decimal, uid, gid, whole-second mtime.
    raw_put(
        &rt,
        &raw,
        "s3fs.txt",
        b"x",
        &[
            ("mode", "33261"),
            ("uid", "1001"),
            ("gid", "1002"),
            ("mtime", "1600000000"),
        ],
    );
    // rclone: mtime only, seconds with nanoseconds.
    raw_put(
        &rt,
        &raw,
        "rclone.txt",
        b"y",
        &[("mtime", "1600000000.123456789")],
    );
    // Junk is ignored, not an error.
    raw_put(
        &rt,
        &raw,
        "junk.txt",
        b"z",
        &[("mode", "rwx"), ("mtime", "yesterday")],
    );

    let s = open(&v, &format!("s3://{BUCKET}"));
    let st = s.stat(p("s3fs.txt")).unwrap();
    assert_eq!(
        st.meta,
        ObjMeta {
            mode: Some(0o755),
            uid: Some(1001),
            gid: Some(1002),
            mtime: Some(UNIX_EPOCH + Duration::from_secs(1_600_000_000)),
        }
    );
    let st = s.stat(p("rclone.txt")).unwrap();
    assert_eq!(
        st.mtime,
        UNIX_EPOCH + Duration::new(1_600_000_000, 123_456_789)
    );
    assert_eq!(st.meta.mode, None);
    let st = s.stat(p("junk.txt")).unwrap();
    assert_eq!(st.meta, ObjMeta::default());
    assert_eq!(st.mtime, st.last_modified);

    // What we write, the others read: s3fs's names and formats.
    let mtime = UNIX_EPOCH + Duration::new(1_700_000_000, 5);
    let meta = ObjMeta {
        mode: Some(0o600),
        uid: Some(7),
        gid: Some(8),
        mtime: Some(mtime),
    };
    s.put(p("ours.txt"), &file_with(b"ours"), &meta).unwrap();
    let head = rt
        .block_on(raw.get_opts(
            &ObjPath::parse("ours.txt").unwrap(),
            GetOptions {
                head: true,
                ..Default::default()
            },
        ))
        .unwrap();
    let get = |k: &str| {
        head.attributes
            .get(&Attribute::Metadata(k.to_string().into()))
            .map(|v| v.as_ref().to_string())
    };
    assert_eq!(get("mode").as_deref(), Some("33152")); // S_IFREG | 0600
    assert_eq!(get("uid").as_deref(), Some("7"));
    assert_eq!(get("gid").as_deref(), Some("8"));
    assert_eq!(get("mtime").as_deref(), Some("1700000000.000000005"));

    // chmod/chown/utimens: a self-copy with new metadata; data and other fields kept.
    let st = s
        .set_meta(
            p("ours.txt"),
            &ObjMeta {
                mode: Some(0o644),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(
        st.meta,
        ObjMeta {
            mode: Some(0o644),
            ..meta
        }
    );
    assert_eq!(
        &s.read_range(p("ours.txt"), 0, 10, st.etag.as_deref())
            .unwrap()[..],
        b"ours"
    );
    let later = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let st = s
        .set_meta(
            p("ours.txt"),
            &ObjMeta {
                mtime: Some(later),
                uid: Some(9),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(
        (st.mtime, st.meta.uid, st.meta.gid),
        (later, Some(9), Some(8))
    );
    assert_eq!(s.stat(p("ours.txt")).unwrap(), st);

    // Metadata of other tools and the content type survive a set_meta.
    let mut attributes = Attributes::new();
    attributes.insert(Attribute::ContentType, "text/x-hoard".into());
    attributes.insert(
        Attribute::Metadata("md5chksum".into()),
        "XrY7u+Ae7tCTyyK7j1rNww==".into(),
    );
    attributes.insert(Attribute::Metadata("atime".into()), "1600000001".into());
    attributes.insert(Attribute::Metadata("mode".into()), "33188".into());
    let path = ObjPath::parse("others.txt").unwrap();
    let put = PutOptions {
        attributes,
        ..Default::default()
    };
    rt.block_on(raw.put_opts(&path, PutPayload::from_static(b"o"), put))
        .unwrap();
    s.set_meta(
        p("others.txt"),
        &ObjMeta {
            mode: Some(0o600),
            ..Default::default()
        },
    )
    .unwrap();
    let head = rt
        .block_on(raw.get_opts(
            &path,
            GetOptions {
                head: true,
                ..Default::default()
            },
        ))
        .unwrap();
    let attr = |a: Attribute| head.attributes.get(&a).map(|v| v.as_ref().to_string());
    assert_eq!(
        attr(Attribute::ContentType).as_deref(),
        Some("text/x-hoard")
    );
    assert_eq!(
        attr(Attribute::Metadata("md5chksum".into())).as_deref(),
        Some("XrY7u+Ae7tCTyyK7j1rNww==")
    );
    assert_eq!(
        attr(Attribute::Metadata("atime".into())).as_deref(),
        Some("1600000001")
    );
    assert_eq!(
        attr(Attribute::Metadata("mode".into())).as_deref(),
        Some("33152")
    );

    // A directory's metadata lives on its marker.
    s.mkdir(
        p("d"),
        &ObjMeta {
            mode: Some(0o750),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(s.stat(p("d")).unwrap().meta.mode, Some(0o750));
    let st = s
        .set_meta(
            p("d"),
            &ObjMeta {
                uid: Some(42),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!((st.meta.mode, st.meta.uid), (Some(0o750), Some(42)));
    assert_eq!(s.stat(p("d")).unwrap().meta, st.meta);
    assert_eq!(
        errno(s.set_meta(p("none"), &ObjMeta::default())),
        libc::ENOENT
    );
}

#[test]
fn copy_delete_rename() {
    let v = Versity::start(&[BUCKET]);
    let s = open(&v, &format!("s3://{BUCKET}"));
    let meta = ObjMeta {
        mode: Some(0o604),
        uid: Some(3),
        ..Default::default()
    };
    s.put(p("a/one"), &file_with(b"payload"), &meta).unwrap();
    s.copy(p("a/one"), p("b/two")).unwrap();
    let st = s.stat(p("b/two")).unwrap();
    assert_eq!((st.size, st.meta), (7, meta), "copy keeps the metadata");
    s.rename_file(p("a/one"), p("a/three")).unwrap();
    assert_eq!(errno(s.stat(p("a/one"))), libc::ENOENT);
    assert_eq!(
        &s.read_range(p("a/three"), 0, 100, None).unwrap()[..],
        b"payload"
    );
    assert_eq!(s.stat(p("a/three")).unwrap().meta, meta);
    assert_eq!(errno(s.rename_file(p("a/none"), p("a/x"))), libc::ENOENT);
    assert_eq!(
        errno(s.rename_file(p("a"), p("c"))),
        libc::EXDEV,
        "directory rename"
    );
    assert_eq!(errno(s.copy(p("a/none"), p("a/x"))), libc::ENOENT);
    s.mkdir(p("dir"), &ObjMeta::default()).unwrap();
    assert_eq!(errno(s.rename_file(p("a/three"), p("dir"))), libc::EISDIR);
    assert_eq!(s.stat(p("dir")).unwrap().kind, ObjKind::Dir);
    s.put(p("a/four"), &file_with(b"4"), &ObjMeta::default())
        .unwrap();
    // Over an existing file: replaced, as rename(2) does.
    s.rename_file(p("a/four"), p("a/three")).unwrap();
    assert_eq!(&s.read_range(p("a/three"), 0, 10, None).unwrap()[..], b"4");
    s.delete(p("a/three")).unwrap();
    assert_eq!(errno(s.stat(p("a/three"))), libc::ENOENT);
    s.delete(p("a/three")).unwrap(); // S3 deletes are idempotent
}

#[test]
fn mkdir_rmdir() {
    let v = Versity::start(&[BUCKET]);
    let s = open(&v, &format!("s3://{BUCKET}/root"));
    let st = s
        .mkdir(
            p("d"),
            &ObjMeta {
                mode: Some(0o711),
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!((st.kind, st.meta.mode), (ObjKind::Dir, Some(0o711)));
    assert_eq!(errno(s.mkdir(p("d"), &ObjMeta::default())), libc::EEXIST);
    s.put(p("f"), &file_with(b"f"), &ObjMeta::default())
        .unwrap();
    assert_eq!(errno(s.mkdir(p("f"), &ObjMeta::default())), libc::EEXIST);
    assert_eq!(errno(s.mkdir(p(""), &ObjMeta::default())), libc::EEXIST);
    s.put(p("d/inner"), &file_with(b"i"), &ObjMeta::default())
        .unwrap();
    assert_eq!(errno(s.rmdir(p("d"))), libc::ENOTEMPTY);
    s.delete(p("d/inner")).unwrap();
    s.rmdir(p("d")).unwrap();
    assert_eq!(errno(s.stat(p("d"))), libc::ENOENT);
    assert_eq!(errno(s.rmdir(p("d"))), libc::ENOENT);
    assert_eq!(errno(s.rmdir(p("f"))), libc::ENOTDIR);
    // A directory implied by a key below it, without a marker.
    s.put(p("implied/x"), &file_with(b"x"), &ObjMeta::default())
        .unwrap();
    assert_eq!(errno(s.rmdir(p("implied"))), libc::ENOTEMPTY);
}

#[test]
fn credentials_from_a_profile_file() {
    let v = Versity::start(&[BUCKET]);
    let dir = tempfile::tempdir().unwrap();
    let creds = dir.path().join("credentials");
    let config = dir.path().join("config");
    std::fs::write(
        &creds,
        format!("[test]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"),
    )
    .unwrap();
    std::fs::write(
        &config,
        format!(
            "[profile test]\nregion = us-east-1\nendpoint_url = {}\n",
            v.endpoint
        ),
    )
    .unwrap();
    let env = |k: &str| -> Option<String> {
        match k {
            "AWS_SHARED_CREDENTIALS_FILE" => Some(creds.to_str().unwrap().into()),
            "AWS_CONFIG_FILE" => Some(config.to_str().unwrap().into()),
            "AWS_PROFILE" => Some("test".into()),
            _ => None,
        }
    };
    let o = S3Options {
        allow_http: true,
        call_timeout: Duration::from_secs(10),
        ..Default::default()
    };
    let url = ObjectUrl::parse(&format!("s3://{BUCKET}")).unwrap();
    let s = ObjectSource::open_with_env(&url, o.clone(), &env, false).unwrap();
    s.put(p("via-profile"), &file_with(b"ok"), &ObjMeta::default())
        .unwrap();
    assert_eq!(s.list_dir(p("")).unwrap()[0].0, "via-profile");

    // A wrong secret: EACCES (403), not a retry loop.
    let bad = S3Options {
        credentials: Some(Credentials {
            access_key_id: ACCESS_KEY.into(),
            secret_access_key: "wrong".into(),
            session_token: None,
        }),
        ..o
    };
    let s = ObjectSource::open_with_env(&url, bad, &env, false).unwrap();
    let t = Instant::now();
    assert_eq!(errno(s.stat(p("via-profile"))), libc::EACCES);
    assert_eq!(errno(s.list_dir(p(""))), libc::EACCES);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[test]
fn missing_bucket_is_enoent() {
    let v = Versity::start(&[BUCKET]);
    let s = open(&v, "s3://no-such-bucket");
    assert_eq!(errno(s.stat(p("x"))), libc::ENOENT);
    assert_eq!(errno(s.list_dir(p(""))), libc::ENOENT);
}

#[test]
fn stopped_server_is_enotconn_promptly() {
    let mut v = Versity::start(&[BUCKET]);
    let s = open_with(
        &format!("s3://{BUCKET}"),
        S3Options {
            call_timeout: Duration::from_secs(5),
            ..opts(&v.endpoint)
        },
    );
    s.put(p("f"), &file_with(b"data"), &ObjMeta::default())
        .unwrap();
    v.stop();
    type Call<'a> = (&'static str, Box<dyn Fn() -> std::io::Result<()> + 'a>);
    let calls: Vec<Call> = vec![
        ("stat", Box::new(|| s.stat(p("f")).map(|_| ()))),
        (
            "read",
            Box::new(|| s.read_range(p("f"), 0, 4, None).map(|_| ())),
        ),
        ("list", Box::new(|| s.list_dir(p("")).map(|_| ()))),
        ("probe", Box::new(|| s.probe())),
        (
            "mkdir",
            Box::new(|| s.mkdir(p("d"), &ObjMeta::default()).map(|_| ())),
        ),
        ("rmdir", Box::new(|| s.rmdir(p("d")))),
    ];
    for (what, call) in calls {
        let t = Instant::now();
        let e = errno(call());
        let took = t.elapsed();
        // Refused connections are retried (4 times, 0.1-0.8 s apart), then reported.
        assert!(
            e == libc::ENOTCONN || e == libc::ETIMEDOUT,
            "{what}: errno {e}"
        );
        assert!(took <= Duration::from_secs(6), "{what}: {took:?}");
        eprintln!("{what} against a stopped server: errno {e} in {took:?}");
    }
    let t = Instant::now();
    assert_eq!(errno(s.stat(p("f"))), libc::ENOTCONN);
    eprintln!("stat against a stopped server failed in {:?}", t.elapsed());
    // And back.
    v.restart();
    s.probe().unwrap();
    assert_eq!(s.stat(p("f")).unwrap().size, 4);
}

/// A server that answers every request with `status` and `body`, counting requests.
fn fake_server(status: &'static str, body: &'static str) -> (String, Arc<AtomicUsize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut conn) = conn else { return };
            c.fetch_add(1, Ordering::SeqCst);
            let mut buf = [0u8; 8192];
            let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
            let _ = conn.read(&mut buf);
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (format!("http://{addr}"), count)
}

#[test]
fn slow_down_is_retried_then_eagain() {
    let (endpoint, count) = fake_server(
        "503 Service Unavailable",
        "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
    );
    let s = open_with(
        &format!("s3://{BUCKET}"),
        S3Options {
            max_retries: 3,
            ..opts(&endpoint)
        },
    );
    let t = Instant::now();
    assert_eq!(errno(s.stat(p("f"))), libc::EAGAIN);
    assert_eq!(count.load(Ordering::SeqCst), 4, "one try and three retries");
    // Exponential backoff with jitter, each pause at least 100 ms; well below the limit.
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(300), "{took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    count.store(0, Ordering::SeqCst);
    assert_eq!(errno(s.read_range(p("f"), 0, 10, None)), libc::EAGAIN);
    assert_eq!(errno(s.mkdir(p("d"), &ObjMeta::default())), libc::EAGAIN);
    assert_eq!(errno(s.rmdir(p("d"))), libc::EAGAIN);
}

#[test]
fn forbidden_is_eacces_and_500_is_eio() {
    let (endpoint, count) = fake_server(
        "403 Forbidden",
        "<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>",
    );
    let s = open_with(&format!("s3://{BUCKET}"), opts(&endpoint));
    assert_eq!(errno(s.read_range(p("f"), 0, 10, None)), libc::EACCES);
    assert_eq!(errno(s.list_dir(p(""))), libc::EACCES);
    assert_eq!(count.load(Ordering::SeqCst), 2, "403 is not retried");
    let (endpoint, _) = fake_server(
        "500 Internal Server Error",
        "<Error><Code>InternalError</Code></Error>",
    );
    let s = open_with(
        &format!("s3://{BUCKET}"),
        S3Options {
            max_retries: 1,
            ..opts(&endpoint)
        },
    );
    assert_eq!(errno(s.read_range(p("f"), 0, 10, None)), libc::EIO);
}

#[test]
fn hung_server_times_out_within_the_call_timeout() {
    // Accepts connections and never answers.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", l.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in l.incoming() {
            held.push(c);
        }
    });
    let s = open_with(
        &format!("s3://{BUCKET}"),
        S3Options {
            call_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_millis(700),
            ..opts(&endpoint)
        },
    );
    type Call<'a> = (&'static str, Box<dyn Fn() -> std::io::Result<()> + 'a>);
    let calls: Vec<Call> = vec![
        ("stat", Box::new(|| s.stat(p("f")).map(|_| ()))),
        (
            "read",
            Box::new(|| s.read_range(p("f"), 0, 4, None).map(|_| ())),
        ),
        (
            "put",
            Box::new(|| {
                s.put(p("f"), &file_with(b"x"), &ObjMeta::default())
                    .map(|_| ())
            }),
        ),
        ("rmdir", Box::new(|| s.rmdir(p("d")))),
        (
            "set_meta",
            Box::new(|| s.set_meta(p("f"), &ObjMeta::default()).map(|_| ())),
        ),
    ];
    for (what, call) in calls {
        let t = Instant::now();
        assert_eq!(errno(call()), libc::ETIMEDOUT, "{what}");
        let took = t.elapsed();
        // The call timeout (2 s) bounds it, whatever the retries would have taken.
        assert!(took >= Duration::from_millis(600), "{what}: {took:?}");
        assert!(took < Duration::from_millis(3500), "{what}: {took:?}");
        eprintln!("{what} against a hung server: ETIMEDOUT in {took:?}");
    }
}

#[test]
fn errno_of_real_errors() {
    // The mapping on errors object_store itself produced (not hand-built ones).
    let v = Versity::start(&[BUCKET]);
    let (rt, raw) = raw(&v);
    let e = rt
        .block_on(raw.head(&ObjPath::parse("missing").unwrap()))
        .unwrap_err();
    assert_eq!(errno_of(&e), libc::ENOENT);
    raw_put(&rt, &raw, "k", b"v", &[]);
    let e = rt
        .block_on(raw.get_opts(
            &ObjPath::parse("k").unwrap(),
            GetOptions {
                if_match: Some("\"nope\"".into()),
                ..Default::default()
            },
        ))
        .unwrap_err();
    assert_eq!(errno_of(&e), libc::ESTALE);
    let _ = SystemTime::now();
}

#[test]
fn the_status_of_real_errors() {
    // object_store hides the status of its answers; it is read from the messages it makes,
    // which these hold to.
    let v = Versity::start(&[BUCKET]);
    let (rt, raw) = raw(&v);
    let e = rt
        .block_on(raw.head(&ObjPath::parse("missing").unwrap()))
        .unwrap_err();
    let e = ObjectError::store("head", "missing", e);
    assert_eq!((e.status, e.errno()), (Some(404), libc::ENOENT), "{e}");
    raw_put(&rt, &raw, "k", b"v", &[]);
    let past_end = GetOptions {
        range: Some((10..20).into()),
        ..Default::default()
    };
    let e = rt
        .block_on(raw.get_opts(&ObjPath::parse("k").unwrap(), past_end))
        .unwrap_err();
    let e = ObjectError::store("get", "k", e);
    assert_eq!(e.status, Some(416), "{e}");
}

/// A server answering each request by `respond(request line)` -> (status, extra headers,
/// body), reading whole requests; the request lines are logged.
fn scripted_server(
    respond: impl Fn(&str) -> (&'static str, String, String) + Send + 'static,
) -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log2 = log.clone();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                head.push(byte[0]);
            }
            let head = String::from_utf8_lossy(&head).into_owned();
            let line = head.lines().next().unwrap_or("").to_string();
            let len: u64 = head
                .lines()
                .find_map(|h| {
                    let (k, v) = h.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            let _ = std::io::copy(&mut (&mut conn).take(len), &mut std::io::sink());
            log2.lock().unwrap().push(line.clone());
            let (status, headers, body) = respond(&line);
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    (format!("http://{addr}"), log)
}

#[test]
fn failed_multipart_upload_is_aborted() {
    let (endpoint, log) = scripted_server(|line| {
        let ok = |h: &str| ("200 OK", h.to_string(), String::new());
        if line.starts_with("POST") && line.contains("?uploads") {
            (
                "200 OK",
                String::new(),
                "<InitiateMultipartUploadResult><Bucket>hoard</Bucket><Key>big</Key>\
                 <UploadId>U1</UploadId></InitiateMultipartUploadResult>"
                    .into(),
            )
        } else if line.starts_with("PUT") && line.contains("partNumber=2") {
            (
                "500 Internal Server Error",
                String::new(),
                "<Error><Code>InternalError</Code></Error>".into(),
            )
        } else if line.starts_with("PUT") && line.contains("partNumber=") {
            ok("ETag: \"part\"\r\n")
        } else if line.starts_with("DELETE") && line.contains("uploadId=U1") {
            ("204 No Content", String::new(), String::new())
        } else {
            (
                "400 Bad Request",
                String::new(),
                "<Error><Code>Unexpected</Code></Error>".into(),
            )
        }
    });
    let s = open_with(
        &format!("s3://{BUCKET}"),
        S3Options {
            multipart_threshold: 1 << 20,
            part_size: 5 << 20,
            parts_in_flight: 2,
            max_retries: 1,
            ..opts(&endpoint)
        },
    );
    let data = pattern(12 << 20, 7);
    assert_eq!(
        errno(s.put(p("big"), &file_with(&data), &ObjMeta::default())),
        libc::EIO
    );
    let log = log.lock().unwrap();
    assert!(
        log.iter()
            .any(|l| l.starts_with("DELETE") && l.contains("uploadId=U1")),
        "no abort among {log:?}"
    );
    assert!(
        !log.iter()
            .any(|l| l.starts_with("POST") && l.contains("uploadId=U1")),
        "completed: {log:?}"
    );
}

#[test]
fn concurrent_calls_from_many_threads() {
    // The daemon calls from its request threads and 16 source workers at once.
    let v = Versity::start(&[BUCKET]);
    let s = Arc::new(open(&v, &format!("s3://{BUCKET}")));
    let data = pattern(1 << 20, 3);
    let etag = s
        .put(p("shared"), &file_with(&data), &ObjMeta::default())
        .unwrap()
        .etag
        .unwrap();
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (s, etag, data) = (s.clone(), etag.clone(), data.clone());
            std::thread::spawn(move || {
                for i in 0..20u64 {
                    let off = (t * 131_071 + i * 4099) % (1 << 20);
                    let got = s.read_range(p("shared"), off, 10_000, Some(&etag)).unwrap();
                    let end = (off as usize + 10_000).min(data.len());
                    assert!(got[..] == data[off as usize..end]);
                    let name = format!("t{t}/f{i}");
                    s.put(p(&name), &file_with(name.as_bytes()), &ObjMeta::default())
                        .unwrap();
                    assert_eq!(s.stat(p(&name)).unwrap().size, name.len() as u64);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(s.list_dir(p("")).unwrap().len(), 9);
    assert_eq!(s.list_dir(p("t3")).unwrap().len(), 20);
}

#[test]
fn marker_requests_are_retried_too() {
    // mkdir's own request (a PUT of `d/`, outside object_store's retry loop) meets SlowDown.
    let (endpoint, log) = scripted_server(|line| {
        if line.starts_with("HEAD /hoard/d ") {
            ("404 Not Found", String::new(), String::new())
        } else if line.starts_with("GET /hoard?") && line.contains("list-type=2") {
            (
                "200 OK",
                String::new(),
                "<ListBucketResult><Name>hoard</Name><Prefix>d/</Prefix><KeyCount>0</KeyCount>\
                 <MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated></ListBucketResult>"
                    .into(),
            )
        } else {
            (
                "503 Service Unavailable",
                String::new(),
                "<Error><Code>SlowDown</Code></Error>".into(),
            )
        }
    });
    let s = open_with(
        &format!("s3://{BUCKET}"),
        S3Options {
            max_retries: 3,
            ..opts(&endpoint)
        },
    );
    let t = Instant::now();
    assert_eq!(errno(s.mkdir(p("d"), &ObjMeta::default())), libc::EAGAIN);
    let took = t.elapsed();
    let log = log.lock().unwrap();
    let puts = log
        .iter()
        .filter(|l| l.starts_with("PUT /hoard/d/ "))
        .count();
    assert_eq!(puts, 4, "one try and three retries: {log:?}");
    assert!(
        took >= Duration::from_millis(700),
        "backoff 100+200+400 ms: {took:?}"
    );
}

/// TLS as hoardfs's HTTP client does it (reqwest over rustls with ring,
/// `install_tls_provider`), against `openssl s_server` with a certificate for 127.0.0.1
/// from a test CA: the handshake completes and a request is answered when the CA is
/// trusted, and fails when it is not (the certificate is checked).
#[test]
fn tls_handshakes_with_the_ring_provider() {
    let dir = tempfile::tempdir().unwrap();
    let openssl = |args: &[&str]| {
        let out = std::process::Command::new("openssl")
            .args(args)
            .current_dir(dir.path())
            .output()
            .expect("openssl (.ci/run installs it)");
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    let key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let ca = ["-x509", "-days", "1", "-subj", "/CN=hoardfs test CA"];
    openssl(
        &[
            &["req"][..],
            &ca,
            &key,
            &["-keyout", "ca.key", "-out", "ca.pem"],
        ]
        .concat(),
    );
    let csr = [
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "key.pem",
        "-out",
        "server.csr",
    ];
    openssl(&[&["req"][..], &key, &csr].concat());
    std::fs::write(
        dir.path().join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n\
         extendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "server.ext",
        "-out",
        "cert.pem",
    ]);
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let server = std::process::Command::new("openssl")
        .args([
            "s_server", "-quiet", "-www", "-cert", "cert.pem", "-key", "key.pem",
        ])
        .arg("-accept")
        .arg(format!("127.0.0.1:{port}"))
        .current_dir(dir.path())
        .stdout(std::process::Stdio::null())
        .spawn()
        .map(Kill)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "openssl s_server did not listen");
        std::thread::sleep(Duration::from_millis(20));
    }
    hoardfs::object_source::install_tls_provider();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = format!("https://127.0.0.1:{port}/");
    let get = |client: reqwest::Client| {
        rt.block_on(async {
            let r = client.get(&url).send().await?;
            let status = r.status();
            Ok::<_, reqwest::Error>((status, r.text().await?))
        })
    };
    let untrusted = get(reqwest::Client::new()).unwrap_err();
    assert!(
        format!("{untrusted:?}").contains("UnknownIssuer"),
        "{untrusted:?}"
    );
    let root = std::fs::read(dir.path().join("ca.pem")).unwrap();
    let trusted = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&root).unwrap())
        .build()
        .unwrap();
    let (status, body) = get(trusted).unwrap();
    assert_eq!(status, 200, "{body}");
    // s_server -www describes the session it negotiated.
    assert!(body.contains("TLSv1"), "{body}");
    drop(server);
}

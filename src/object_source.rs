//! An S3-compatible object store as a source: a synchronous facade over `object_store`'s
//! `AmazonS3` for the thread-based daemon (not yet wired into the mount; see
//! docs/ARCHITECTURE.md, "Object-store sources").
//!
//! - The facade owns a small tokio runtime; every call runs `block_on` under a timeout, so a
//!   daemon thread never waits longer than `S3Options::call_timeout` for one call (a
//!   multipart upload waits that long at most per part). Never call it from inside a tokio
//!   runtime.
//! - Keys mirror relative paths under the URL's prefix: `s3://b/pre` + `a/b.txt` is the key
//!   `pre/a/b.txt`. Directories are key prefixes (`a/`), and optionally `a/` marker objects
//!   (s3fs and rclone write them; `mkdir` writes one). `object_store`'s `Path` cannot express a
//!   key ending in `/`, nor can it rewrite metadata in place, so those requests are signed
//!   by `object_store`'s own `AwsAuthorizer` and sent through its HTTP client
//!   (`raw_request`).
//! - Names that cannot be paths: a key with an empty segment (`a//b`), a `.` or `..` segment
//!   or an ASCII control character (NUL included) is refused by `object_store`'s path parser.
//!   Such a key makes the listing of the one directory where its bad segment appears fail
//!   (`EIO`, the key logged), and cannot be read; the rest of the tree is unaffected. Names
//!   we are asked to create under those rules get `EINVAL`; non-UTF-8 names too (keys are
//!   UTF-8), and keys over 1024 bytes `ENAMETOOLONG` (S3's limit).
//! - Metadata follows s3fs (`x-amz-meta-mode` as a decimal `st_mode`, `-uid`, `-gid`,
//!   `-mtime` in seconds) and rclone (`x-amz-meta-mtime`, seconds with a fraction). A file's
//!   change identity is `(size, Last-Modified, hash of the ETag)`: those come with listings
//!   and HEADs alike, while user metadata comes only with a HEAD.
//! - A name that is both an object and a prefix (`a` and `a/x`): the object wins, in `stat`
//!   and in `list_dir` alike (the prefix is logged and hidden), so both agree.

use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::client::{HttpClient, HttpConnector, ReqwestConnector};
use object_store::path::Path as ObjPath;
use object_store::{BackoffConfig, ClientOptions, ObjectMeta, RetryConfig};

mod error;
mod marker;
mod meta;
mod profile;
mod read;
mod write;

pub use error::{ObjectError, errno_of};
pub use meta::{format_meta_time, parse_meta_time};
pub use profile::{ResolvedConfig, parse_ini, resolve_config};

use error::errno;

/// S3's longest key, in bytes.
const MAX_KEY: usize = 1024;

/// `s3://BUCKET[/PREFIX]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectUrl {
    pub bucket: String,
    /// Without leading or trailing `/`; empty for the whole bucket.
    pub prefix: String,
}

impl ObjectUrl {
    pub fn parse(url: &str) -> Result<ObjectUrl, String> {
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| format!("{url:?}: an object store source is s3://BUCKET[/PREFIX]"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(format!("{url:?}: no bucket name after s3://"));
        }
        // Lenient on case and `_` (legacy buckets, MinIO); strict on what would change the
        // URL we build (`:`, `@`, `?`, `#`, spaces).
        if bucket.len() > 255
            || !bucket
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b))
        {
            return Err(format!(
                "{url:?}: bucket name {bucket:?} may hold only letters, digits, '-', '.' and '_'"
            ));
        }
        let prefix = prefix.trim_end_matches('/');
        if !prefix.is_empty()
            && let Some(bad) = prefix.split('/').find(|s| !segment_ok(s))
        {
            return Err(format!(
                "{url:?}: prefix segment {bad:?} cannot be part of a path \
                 (empty, '.', '..' or a control character)"
            ));
        }
        Ok(ObjectUrl {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
        })
    }
}

/// A path segment `object_store` accepts and a file system could hold.
fn segment_ok(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.chars().any(|c| c.is_ascii_control())
}

/// Explicit credentials (tests, or a later `-o` option); otherwise the environment and the
/// profile files decide (`resolve_credentials`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

#[derive(Clone, Debug)]
pub struct S3Options {
    /// `http[s]://host[:port]`; None: AWS (or `AWS_ENDPOINT_URL[_S3]`, or the profile's
    /// `endpoint_url`).
    pub endpoint: Option<String>,
    /// None: `AWS_REGION`, `AWS_DEFAULT_REGION`, the profile's `region`, else us-east-1.
    pub region: Option<String>,
    /// `BUCKET.host` URLs instead of `host/BUCKET` (AWS's default; most self-hosted
    /// servers want path style).
    pub virtual_hosted: bool,
    /// Plain HTTP, for loopback and test servers.
    pub allow_http: bool,
    /// Profile name; None: `AWS_PROFILE`, else `default`.
    pub profile: Option<String>,
    pub credentials: Option<Credentials>,
    /// Bound on one facade call, retries included.
    pub call_timeout: Duration,
    /// Bound on one HTTP request.
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    /// Retries of 5xx/503 SlowDown, 429, connection errors and timeouts of idempotent
    /// requests, with exponential backoff from 100 ms (at most 2 s apart).
    pub max_retries: usize,
    /// Files above this are uploaded in parts.
    pub multipart_threshold: u64,
    /// S3 wants parts of at least 5 MiB (the last excepted) and at most 10,000 of them.
    pub part_size: usize,
    pub parts_in_flight: usize,
}

impl Default for S3Options {
    fn default() -> Self {
        S3Options {
            endpoint: None,
            region: None,
            virtual_hosted: false,
            allow_http: false,
            profile: None,
            credentials: None,
            call_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(20),
            connect_timeout: Duration::from_secs(5),
            max_retries: 4,
            multipart_threshold: 16 << 20,
            part_size: 8 << 20,
            parts_in_flight: 4,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjKind {
    File,
    Dir,
}

/// Owner, mode and mtime as kept in user metadata. `mode` is the permission bits
/// (`0o7777`); s3fs's full `st_mode` is written and read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ObjMeta {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mtime: Option<SystemTime>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjStat {
    pub kind: ObjKind,
    pub size: u64,
    /// The metadata mtime, else Last-Modified.
    pub mtime: SystemTime,
    pub last_modified: SystemTime,
    pub etag: Option<String>,
    pub meta: ObjMeta,
    /// False for entries from a listing: S3 lists no user metadata, so `meta` is empty
    /// there and `mtime` is Last-Modified; a `stat` gives the full picture.
    pub meta_known: bool,
}

/// What detects a changed object, like `SourceIdentity` for files: the fields come with
/// listings and HEADs alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ObjIdentity {
    pub size: u64,
    pub last_modified: (i64, u32),
    pub etag_hash: u64,
}

impl ObjStat {
    pub fn identity(&self) -> ObjIdentity {
        ObjIdentity {
            size: self.size,
            last_modified: split_time(self.last_modified),
            etag_hash: fnv1a(self.etag.as_deref().unwrap_or("").as_bytes()),
        }
    }

    fn dir(meta: ObjMeta, last_modified: SystemTime, meta_known: bool) -> ObjStat {
        ObjStat {
            kind: ObjKind::Dir,
            size: 0,
            mtime: meta.mtime.unwrap_or(last_modified),
            last_modified,
            etag: None,
            meta,
            meta_known,
        }
    }

    fn file(m: &ObjectMeta, meta: ObjMeta, meta_known: bool) -> ObjStat {
        let last_modified = chrono_time(
            m.last_modified.timestamp(),
            m.last_modified.timestamp_subsec_nanos(),
        );
        ObjStat {
            kind: ObjKind::File,
            size: m.size,
            mtime: meta.mtime.unwrap_or(last_modified),
            last_modified,
            etag: m.e_tag.clone(),
            meta,
            meta_known,
        }
    }
}

/// The device number of every object-store stat: there is no device, and the inode table
/// keys entries by `(dev, ino)`.
pub const OBJECT_DEV: u64 = 0x5333_0001;

/// A stable inode number for a key: FNV-1a of it (a directory's with its trailing `/`, so
/// that a file and a directory of one name never share a number). Renames give a new
/// number, as copy + delete makes a new object.
pub fn ino_of(key: &str, kind: ObjKind) -> u64 {
    let h = match kind {
        ObjKind::File => fnv1a(key.as_bytes()),
        ObjKind::Dir => fnv1a(format!("{key}/").as_bytes()),
    };
    h.max(2)
}

impl ObjStat {
    /// How the mount shows this entry (docs/SEMANTICS.md): mode, owner and mtime from the
    /// s3fs/rclone metadata where present, else 0644/0755, `owner` and Last-Modified. ctime
    /// is Last-Modified's second with a digest of the ETag as its nanoseconds, so that the
    /// cache's identity check (size, mtime, ctime) sees a new object written within the
    /// same second.
    pub fn posix(&self, key: &str, owner: (u32, u32)) -> crate::source::Stat {
        let (ty, perm, nlink) = match self.kind {
            ObjKind::File => (libc::S_IFREG, self.meta.mode.unwrap_or(0o644), 1),
            ObjKind::Dir => (libc::S_IFDIR, self.meta.mode.unwrap_or(0o755), 2),
        };
        let mtime = split_time(self.mtime);
        let ctime = match self.kind {
            ObjKind::File => {
                let (secs, _) = split_time(self.last_modified);
                (secs, (self.identity().etag_hash % 1_000_000_000) as u32)
            }
            ObjKind::Dir => mtime,
        };
        crate::source::Stat {
            dev: OBJECT_DEV,
            ino: ino_of(key, self.kind),
            mode: ty | (perm & 0o7777),
            nlink,
            uid: self.meta.uid.unwrap_or(owner.0),
            gid: self.meta.gid.unwrap_or(owner.1),
            rdev: 0,
            size: self.size,
            blocks: self.size.div_ceil(512),
            blksize: 1 << 20,
            atime: mtime,
            mtime,
            ctime,
            btime: (0, 0),
        }
    }
}

fn chrono_time(secs: i64, nanos: u32) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::new(secs as u64, nanos)
    } else {
        UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs()) + Duration::from_nanos(nanos.into())
    }
}

fn split_time(t: SystemTime) -> (i64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_nanos()),
        Err(e) => {
            let d = e.duration();
            if d.subsec_nanos() == 0 {
                (-(d.as_secs() as i64), 0)
            } else {
                (-(d.as_secs() as i64) - 1, 1_000_000_000 - d.subsec_nanos())
            }
        }
    }
}

/// FNV-1a: stable across builds and releases (std's hasher promises neither), and an ETag
/// is short.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Installs ring as the process's rustls crypto provider, once; a provider installed
/// earlier (by another library in the process) stays. reqwest is built without a provider
/// of its own (`rustls-no-provider`, so that aws-lc is not compiled in) and panics when it
/// builds a client with none installed, for `http://` endpoints too.
pub fn install_tls_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

// ---- the source ----------------------------------------------------------------------

pub struct ObjectSource {
    rt: tokio::runtime::Runtime,
    store: Arc<AmazonS3>,
    /// For marker objects and metadata rewrites, which `object_store` cannot express.
    http: HttpClient,
    /// `object_store`'s own base URL for the bucket (path or virtual-hosted style).
    bucket_endpoint: String,
    bucket: String,
    region: String,
    prefix: String,
    opts: S3Options,
}

impl std::fmt::Debug for ObjectSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ObjectSource({}/{})", self.bucket_endpoint, self.prefix)
    }
}

impl ObjectSource {
    /// With the process environment and profile files.
    pub fn open(url: &ObjectUrl, opts: S3Options) -> io::Result<ObjectSource> {
        ObjectSource::open_with_env(url, opts, &|k| std::env::var(k).ok(), true)
    }

    /// `env` stands for the environment; `process_env` also lets object_store read the
    /// process's `AWS_*` variables (web identity, container credentials and the like).
    pub fn open_with_env(
        url: &ObjectUrl,
        mut opts: S3Options,
        env: &dyn Fn(&str) -> Option<String>,
        process_env: bool,
    ) -> io::Result<ObjectSource> {
        install_tls_provider();
        let invalid = |m: String| io::Error::new(io::ErrorKind::InvalidInput, m);
        let resolved = resolve_config(opts.profile.as_deref(), env).map_err(invalid)?;
        let region = opts
            .region
            .clone()
            .or(resolved.region)
            .unwrap_or_else(|| "us-east-1".to_string());
        let endpoint = opts
            .endpoint
            .clone()
            .or(resolved.endpoint)
            .map(|e| e.trim_end_matches('/').to_string());
        if let Some(e) = &endpoint {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(invalid(format!("endpoint {e:?} is not an http(s):// URL")));
            }
            if e.starts_with("http://") && !opts.allow_http {
                return Err(invalid(format!(
                    "endpoint {e:?} is plain HTTP; allow it explicitly (allow_http)"
                )));
            }
        }
        // object_store takes a virtual-hosted endpoint with the bucket already in the host.
        let (os_endpoint, bucket_endpoint) = match (&endpoint, opts.virtual_hosted) {
            (Some(e), true) => {
                let (scheme, host) = e.split_once("://").unwrap_or(("https", e));
                let ve = format!("{scheme}://{}.{host}", url.bucket);
                (Some(ve.clone()), ve)
            }
            (Some(e), false) => (Some(e.clone()), format!("{e}/{}", url.bucket)),
            (None, true) => (
                None,
                format!("https://{}.s3.{region}.amazonaws.com", url.bucket),
            ),
            (None, false) => (
                None,
                format!("https://s3.{region}.amazonaws.com/{}", url.bucket),
            ),
        };
        let credentials = opts.credentials.clone().or(resolved.credentials);
        opts.part_size = opts.part_size.max(5 << 20);
        opts.parts_in_flight = opts.parts_in_flight.max(1);

        let client = ClientOptions::new()
            .with_allow_http(opts.allow_http)
            .with_timeout(opts.request_timeout)
            .with_connect_timeout(opts.connect_timeout);
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(2),
                base: 2.0,
            },
            max_retries: opts.max_retries,
            retry_timeout: opts.call_timeout,
        };
        let mut b = if process_env {
            AmazonS3Builder::from_env()
        } else {
            AmazonS3Builder::new()
        };
        b = b
            .with_bucket_name(&url.bucket)
            .with_region(&region)
            .with_virtual_hosted_style_request(opts.virtual_hosted)
            .with_client_options(client.clone())
            .with_retry(retry);
        if let Some(e) = &os_endpoint {
            b = b.with_endpoint(e);
        }
        if let Some(c) = &credentials {
            b = b
                .with_access_key_id(&c.access_key_id)
                .with_secret_access_key(&c.secret_access_key);
            if let Some(t) = &c.session_token {
                b = b.with_token(t);
            }
        }
        let store = b
            .build()
            .map_err(|e| invalid(format!("object store configuration: {e}")))?;
        let http = ReqwestConnector::default()
            .connect(&client)
            .map_err(|e| invalid(format!("HTTP client: {e}")))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("s3-io")
            .enable_all()
            .build()?;
        Ok(ObjectSource {
            rt,
            store: Arc::new(store),
            http,
            bucket_endpoint,
            bucket: url.bucket.clone(),
            region,
            prefix: url.prefix.clone(),
            opts,
        })
    }

    pub fn options(&self) -> &S3Options {
        &self.opts
    }

    /// Runs `fut` on the runtime, at most `call_timeout`.
    fn block<T>(&self, fut: impl Future<Output = io::Result<T>>) -> io::Result<T> {
        let limit = self.opts.call_timeout;
        self.rt.block_on(async move {
            tokio::time::timeout(limit, fut)
                .await
                .unwrap_or_else(|_| Err(errno(libc::ETIMEDOUT)))
        })
    }

    // ---- keys and paths ----

    /// The key of `rel` ("" for the root: the prefix itself).
    pub fn key_of(&self, rel: &FsPath) -> io::Result<String> {
        let mut key = self.prefix.clone();
        for c in rel.components() {
            let Component::Normal(name) = c else {
                if c == Component::CurDir {
                    continue;
                }
                return Err(errno(libc::EINVAL));
            };
            let name = std::str::from_utf8(name.as_bytes()).map_err(|_| errno(libc::EINVAL))?;
            if !segment_ok(name) || name.contains('/') {
                return Err(errno(libc::EINVAL));
            }
            if !key.is_empty() {
                key.push('/');
            }
            key.push_str(name);
        }
        // +1: the marker's trailing '/'.
        if key.len() + 1 > MAX_KEY {
            return Err(errno(libc::ENAMETOOLONG));
        }
        Ok(key)
    }

    /// The relative path of `key`, None if it lies outside the prefix or cannot be a path.
    /// A trailing `/` (a marker) names the directory.
    pub fn rel_of(&self, key: &str) -> Option<PathBuf> {
        let rest = if self.prefix.is_empty() {
            key
        } else {
            match key.strip_prefix(self.prefix.as_str())? {
                "" | "/" => "",
                r => r.strip_prefix('/')?,
            }
        };
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if rest.is_empty() {
            return Some(PathBuf::new());
        }
        rest.split('/').all(segment_ok).then(|| PathBuf::from(rest))
    }

    fn obj_path(key: &str) -> io::Result<ObjPath> {
        ObjPath::parse(key).map_err(|_| errno(libc::EINVAL))
    }
}

fn is_root(rel: &FsPath) -> bool {
    rel.components().all(|c| c == Component::CurDir)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use object_store::client::{HttpError, HttpErrorKind};

    use super::marker::parse_http_date;
    use super::meta::meta_from;
    use super::*;

    fn file_stat(etag: &str, meta: ObjMeta) -> ObjStat {
        let lm = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        ObjStat {
            kind: ObjKind::File,
            size: 10,
            mtime: meta.mtime.unwrap_or(lm),
            last_modified: lm,
            etag: Some(etag.into()),
            meta,
            meta_known: true,
        }
    }

    #[test]
    fn posix_view_of_objects() {
        let plain = file_stat("\"a\"", ObjMeta::default()).posix("k/f", (7, 8));
        assert_eq!(plain.mode, libc::S_IFREG | 0o644);
        assert_eq!((plain.uid, plain.gid), (7, 8));
        assert_eq!(plain.mtime, (1_700_000_000, 0));
        // Same size and second, another ETag: another identity.
        let other = file_stat("\"b\"", ObjMeta::default()).posix("k/f", (7, 8));
        assert_eq!(plain.ctime.0, other.ctime.0);
        assert_ne!(plain.ctime, other.ctime);
        assert_eq!(plain.ino, other.ino, "the key, not the content, numbers it");
        let meta = ObjMeta {
            mode: Some(0o600),
            uid: Some(1),
            gid: Some(2),
            mtime: Some(UNIX_EPOCH + Duration::new(5, 6)),
        };
        let with = file_stat("\"a\"", meta).posix("k/f", (7, 8));
        assert_eq!(with.mode, libc::S_IFREG | 0o600);
        assert_eq!((with.uid, with.gid, with.mtime), (1, 2, (5, 6)));
        let dir = ObjStat::dir(ObjMeta::default(), UNIX_EPOCH, false).posix("k/f", (0, 0));
        assert_eq!(dir.mode, libc::S_IFDIR | 0o755);
        assert_ne!(
            dir.ino, plain.ino,
            "a file and a directory of one name differ"
        );
    }

    fn err(kind: HttpErrorKind) -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: Box::new(HttpError::new(kind, io::Error::other("x"))),
        }
    }

    fn msg(text: &str) -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: text.to_string().into(),
        }
    }

    #[test]
    fn errno_mapping() {
        use object_store::Error as E;
        let src = || -> Box<dyn std::error::Error + Send + Sync> { "x".into() };
        let p = || "k".to_string();
        assert_eq!(
            errno_of(&E::NotFound {
                path: p(),
                source: src()
            }),
            libc::ENOENT
        );
        assert_eq!(
            errno_of(&E::PermissionDenied {
                path: p(),
                source: src()
            }),
            libc::EACCES
        );
        assert_eq!(
            errno_of(&E::Unauthenticated {
                path: p(),
                source: src()
            }),
            libc::EACCES
        );
        assert_eq!(
            errno_of(&E::Precondition {
                path: p(),
                source: src()
            }),
            libc::ESTALE
        );
        assert_eq!(
            errno_of(&E::AlreadyExists {
                path: p(),
                source: src()
            }),
            libc::EEXIST
        );
        assert_eq!(
            errno_of(&E::NotSupported { source: src() }),
            libc::EOPNOTSUPP
        );
        let not_impl = E::NotImplemented {
            operation: "x".into(),
            implementer: "y".into(),
        };
        assert_eq!(errno_of(&not_impl), libc::EOPNOTSUPP);
        let bad_path = E::InvalidPath {
            source: ObjPath::parse("a//b").unwrap_err(),
        };
        assert_eq!(errno_of(&bad_path), libc::EINVAL);
        assert_eq!(errno_of(&err(HttpErrorKind::Connect)), libc::ENOTCONN);
        assert_eq!(errno_of(&err(HttpErrorKind::Timeout)), libc::ETIMEDOUT);
        assert_eq!(errno_of(&err(HttpErrorKind::Request)), libc::ECONNRESET);
        assert_eq!(errno_of(&err(HttpErrorKind::Decode)), libc::EIO);
        // The messages object_store's retry error formats.
        let status = |s: &str| {
            msg(&format!(
                "Error performing GET http://x/b/k in 1s, after 4 retries - Server returned \
                 non-2xx status code: {s}"
            ))
        };
        assert_eq!(
            errno_of(&status("503 Service Unavailable: <Code>SlowDown</Code>")),
            libc::EAGAIN
        );
        assert_eq!(errno_of(&status("429 Too Many Requests: ")), libc::EAGAIN);
        assert_eq!(errno_of(&status("500 Internal Server Error: ")), libc::EIO);
        assert_eq!(errno_of(&status("504 Gateway Timeout: ")), libc::ETIMEDOUT);
        assert_eq!(
            errno_of(&status("405 Method Not Allowed: ")),
            libc::EOPNOTSUPP
        );
        assert_eq!(
            errno_of(&msg(
                "Server returned error response: <Code>SlowDown</Code>"
            )),
            libc::EAGAIN
        );
        assert_eq!(errno_of(&msg("something else")), libc::EIO);
    }

    #[test]
    fn urls() {
        let u = ObjectUrl::parse("s3://bucket").unwrap();
        assert_eq!((u.bucket.as_str(), u.prefix.as_str()), ("bucket", ""));
        let u = ObjectUrl::parse("s3://my.bucket-1/a/b/").unwrap();
        assert_eq!(
            (u.bucket.as_str(), u.prefix.as_str()),
            ("my.bucket-1", "a/b")
        );
        for bad in [
            "bucket/x",
            "http://bucket",
            "s3://",
            "s3:///x",
            "s3://b:80/x",
            "s3://user@b",
            "s3://b/a//c",
            "s3://b/a/../c",
            "s3://b/./c",
            "s3://b/a\u{0}c",
        ] {
            let e = ObjectUrl::parse(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
    }

    fn source(prefix: &str) -> ObjectSource {
        let url = ObjectUrl {
            bucket: "b".into(),
            prefix: prefix.into(),
        };
        let opts = S3Options {
            endpoint: Some("http://127.0.0.1:1".into()),
            allow_http: true,
            credentials: Some(Credentials {
                access_key_id: "k".into(),
                secret_access_key: "s".into(),
                session_token: None,
            }),
            ..Default::default()
        };
        ObjectSource::open_with_env(&url, opts, &|_| None, false).unwrap()
    }

    #[test]
    fn bucket_endpoints() {
        let url = ObjectUrl::parse("s3://bkt/p").unwrap();
        let open = |endpoint: Option<&str>, virtual_hosted, allow_http| {
            let opts = S3Options {
                endpoint: endpoint.map(Into::into),
                region: Some("eu-west-1".into()),
                virtual_hosted,
                allow_http,
                ..Default::default()
            };
            ObjectSource::open_with_env(&url, opts, &|_| None, false)
                .map(|s| s.bucket_endpoint.clone())
        };
        let ep = |e, v, h| open(e, v, h).unwrap();
        assert_eq!(
            ep(Some("http://127.0.0.1:9000/"), false, true),
            "http://127.0.0.1:9000/bkt"
        );
        assert_eq!(
            ep(Some("https://s3.example.com"), true, false),
            "https://bkt.s3.example.com"
        );
        assert_eq!(
            ep(None, false, false),
            "https://s3.eu-west-1.amazonaws.com/bkt"
        );
        assert_eq!(
            ep(None, true, false),
            "https://bkt.s3.eu-west-1.amazonaws.com"
        );
        let err = open(Some("http://127.0.0.1:9000"), false, false).unwrap_err();
        assert!(err.to_string().contains("allow_http"), "{err}");
        let err = open(Some("127.0.0.1:9000"), false, true).unwrap_err();
        assert!(err.to_string().contains("http(s)://"), "{err}");
    }

    #[test]
    fn keys_and_paths() {
        let s = source("pre/fix");
        assert_eq!(s.key_of(FsPath::new("")).unwrap(), "pre/fix");
        assert_eq!(
            s.key_of(FsPath::new("a/b c%.txt")).unwrap(),
            "pre/fix/a/b c%.txt"
        );
        assert_eq!(s.key_of(FsPath::new("./a/")).unwrap(), "pre/fix/a");
        for bad in ["../x", "/abs", "a/../b", "a\nb"] {
            assert_eq!(
                s.key_of(FsPath::new(bad)).unwrap_err().raw_os_error(),
                Some(libc::EINVAL),
                "{bad}"
            );
        }
        let non_utf8 = std::ffi::OsStr::from_bytes(b"a\xffb");
        assert_eq!(
            s.key_of(FsPath::new(non_utf8)).unwrap_err().raw_os_error(),
            Some(libc::EINVAL)
        );
        let long = "x".repeat(1100);
        assert_eq!(
            s.key_of(FsPath::new(&long)).unwrap_err().raw_os_error(),
            Some(libc::ENAMETOOLONG)
        );
        assert_eq!(s.rel_of("pre/fix/a/b"), Some(PathBuf::from("a/b")));
        assert_eq!(s.rel_of("pre/fix/a/"), Some(PathBuf::from("a")));
        assert_eq!(s.rel_of("pre/fix"), Some(PathBuf::new()));
        assert_eq!(s.rel_of("pre/fixed/a"), None);
        assert_eq!(s.rel_of("other/a"), None);
        for bad in [
            "pre/fix/a//b",
            "pre/fix/./b",
            "pre/fix/a/..",
            "pre/fix/a\0b",
        ] {
            assert_eq!(s.rel_of(bad), None, "{bad:?}");
        }
        let s = source("");
        assert_eq!(s.key_of(FsPath::new("a")).unwrap(), "a");
        assert_eq!(s.rel_of("a/b/"), Some(PathBuf::from("a/b")));
    }

    #[test]
    fn meta_times() {
        let t = |s, n| UNIX_EPOCH + Duration::new(s, n);
        assert_eq!(parse_meta_time("1700000000"), Some(t(1_700_000_000, 0)));
        assert_eq!(
            parse_meta_time("1700000000.5"),
            Some(t(1_700_000_000, 500_000_000))
        );
        assert_eq!(
            parse_meta_time("1700000000.123456789"),
            Some(t(1_700_000_000, 123_456_789))
        );
        assert_eq!(
            parse_meta_time("1700000000.1234567891"),
            Some(t(1_700_000_000, 123_456_789))
        );
        assert_eq!(
            parse_meta_time("-1.5"),
            UNIX_EPOCH.checked_sub(Duration::new(1, 500_000_000))
        );
        for bad in ["", "x", "1e9", "12.3.4", "1.-2", "."] {
            assert_eq!(parse_meta_time(bad), None, "{bad}");
        }
        for tm in [
            t(1_700_000_000, 0),
            t(1_700_000_000, 1),
            t(0, 999_999_999),
            UNIX_EPOCH - Duration::new(5, 250_000_000),
            UNIX_EPOCH - Duration::new(5, 0),
        ] {
            assert_eq!(parse_meta_time(&format_meta_time(tm)), Some(tm), "{tm:?}");
        }
        assert_eq!(format_meta_time(t(1_700_000_000, 0)), "1700000000");
        assert_eq!(
            format_meta_time(t(1_700_000_000, 5)),
            "1700000000.000000005"
        );
        let m = meta_from(|k| match k {
            "mode" => Some("33188".into()), // s3fs: S_IFREG | 0644
            "uid" => Some("1000".into()),
            "gid" => Some("junk".into()),
            _ => None,
        });
        assert_eq!(
            m,
            ObjMeta {
                mode: Some(0o644),
                uid: Some(1000),
                gid: None,
                mtime: None
            }
        );
        assert_eq!(
            parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(UNIX_EPOCH + Duration::from_secs(784_111_777))
        );
        assert_eq!(parse_http_date("yesterday"), None);
        assert_eq!(parse_http_date("Sun, 06 Nov 1994 08:49:37 +0200"), None);
        assert_eq!(parse_http_date("Sun, 06 Nov 1994 25:49:37 GMT"), None);
        assert_eq!(
            parse_http_date("Thu, 01 Jan 1970 00:00:00 GMT"),
            Some(UNIX_EPOCH)
        );
    }

    #[test]
    fn identity_follows_size_time_and_etag() {
        let st = ObjStat::dir(ObjMeta::default(), UNIX_EPOCH, false);
        let mut f = st.clone();
        f.kind = ObjKind::File;
        f.etag = Some("\"abc\"".into());
        let mut g = f.clone();
        assert_eq!(f.identity(), g.identity());
        g.etag = Some("\"abd\"".into());
        assert_ne!(f.identity(), g.identity());
        // The user-visible mtime does not enter: listings cannot see it.
        let mut h = f.clone();
        h.mtime = UNIX_EPOCH + Duration::from_secs(9);
        assert_eq!(f.identity(), h.identity());
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn ini_files() {
        let text = "\
# comment
[default]
aws_access_key_id = AKIDDEFAULT
aws_secret_access_key=secretdefault
[profile  work]
region = eu-west-3
s3 =
  endpoint_url = http://127.0.0.1:9000
  addressing_style = path
aws_access_key_id = AKIDWORK
; another comment
[broken
key without section = 1
";
        let ini = parse_ini(text);
        assert_eq!(ini["default"]["aws_access_key_id"], "AKIDDEFAULT");
        assert_eq!(ini["default"]["aws_secret_access_key"], "secretdefault");
        assert_eq!(ini["profile work"]["region"], "eu-west-3");
        assert_eq!(
            ini["profile work"]["s3.endpoint_url"],
            "http://127.0.0.1:9000"
        );
        assert_eq!(ini["profile work"]["s3.addressing_style"], "path");
        assert_eq!(ini["profile work"]["aws_access_key_id"], "AKIDWORK");
    }

    #[test]
    fn credentials_resolution() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home");
        std::fs::create_dir_all(home.join(".aws")).unwrap();
        std::fs::write(
            home.join(".aws/credentials"),
            "[default]\naws_access_key_id = D\naws_secret_access_key = DS\n\
             [work]\naws_access_key_id = W\naws_secret_access_key = WS\naws_session_token = WT\n",
        )
        .unwrap();
        std::fs::write(
            home.join(".aws/config"),
            "[default]\nregion = eu-north-1\n[profile work]\nregion = ap-south-1\n\
             endpoint_url = http://127.0.0.1:1234\n\
             [profile cfgonly]\naws_access_key_id = C\naws_secret_access_key = CS\n",
        )
        .unwrap();
        let h = home.to_str().unwrap().to_string();
        let env_of = |pairs: Vec<(&'static str, String)>| {
            let map: HashMap<&str, String> = pairs.into_iter().collect();
            move |k: &str| map.get(k).cloned()
        };
        let creds = |id: &str, secret: &str, token: Option<&str>| Credentials {
            access_key_id: id.into(),
            secret_access_key: secret.into(),
            session_token: token.map(Into::into),
        };

        let env = env_of(vec![("HOME", h.clone())]);
        let r = resolve_config(None, &env).unwrap();
        assert_eq!(r.credentials, Some(creds("D", "DS", None)));
        assert_eq!(r.region.as_deref(), Some("eu-north-1"));
        assert_eq!(r.endpoint, None);

        let env = env_of(vec![("HOME", h.clone()), ("AWS_PROFILE", "work".into())]);
        let r = resolve_config(None, &env).unwrap();
        assert_eq!(r.credentials, Some(creds("W", "WS", Some("WT"))));
        assert_eq!(r.region.as_deref(), Some("ap-south-1"));
        assert_eq!(r.endpoint.as_deref(), Some("http://127.0.0.1:1234"));

        // The option beats AWS_PROFILE; keys in the config file alone count too.
        let r = resolve_config(Some("cfgonly"), &env).unwrap();
        assert_eq!(r.credentials, Some(creds("C", "CS", None)));

        // Environment keys beat the profile's; region variables beat its region.
        let env = env_of(vec![
            ("HOME", h.clone()),
            ("AWS_PROFILE", "work".into()),
            ("AWS_ACCESS_KEY_ID", "E".into()),
            ("AWS_SECRET_ACCESS_KEY", "ES".into()),
            ("AWS_DEFAULT_REGION", "us-west-2".into()),
            ("AWS_ENDPOINT_URL", "http://e".into()),
        ]);
        let r = resolve_config(None, &env).unwrap();
        assert_eq!(r.credentials, Some(creds("E", "ES", None)));
        assert_eq!(r.region.as_deref(), Some("us-west-2"));
        assert_eq!(r.endpoint.as_deref(), Some("http://e"));

        // Other file locations.
        let alt = dir.path().join("alt-creds");
        std::fs::write(
            &alt,
            "[default]\naws_access_key_id = A\naws_secret_access_key = AS\n",
        )
        .unwrap();
        let env = env_of(vec![
            ("HOME", h.clone()),
            ("AWS_SHARED_CREDENTIALS_FILE", alt.to_str().unwrap().into()),
        ]);
        let r = resolve_config(None, &env).unwrap();
        assert_eq!(r.credentials, Some(creds("A", "AS", None)));

        // A named profile nobody has is an error; a missing default is not.
        let env = env_of(vec![("HOME", h.clone())]);
        assert!(
            resolve_config(Some("nope"), &env)
                .unwrap_err()
                .contains("\"nope\"")
        );
        let env = env_of(vec![(
            "HOME",
            dir.path().join("empty").to_str().unwrap().into(),
        )]);
        assert_eq!(
            resolve_config(None, &env).unwrap(),
            ResolvedConfig::default()
        );
    }

    /// Profiles whose credentials come from a source hoardfs does not implement are
    /// refused, naming the key, instead of being skipped for other keys or none.
    #[test]
    fn profiles_hoardfs_cannot_use_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (config, creds) = (dir.path().join("config"), dir.path().join("credentials"));
        std::fs::write(
            &config,
            "[default]\nregion = eu-north-1\n\
             [profile sso]\nsso_session = corp\nsso_account_id = 1\nsso_role_name = R\n\
             [sso-session corp]\nsso_start_url = https://corp.awsapps.com/start\n\
             [profile role]\nrole_arn = arn:aws:iam::1:role/R\nsource_profile = default\n\
             [profile rolekeys]\nrole_arn = arn:aws:iam::1:role/R\n\
             aws_access_key_id = RK\naws_secret_access_key = RKS\n\
             [profile proc]\ncredential_process = /usr/bin/get-creds\n\
             aws_access_key_id = PC\naws_secret_access_key = PCS\n\
             [profile prockeys]\ncredential_process = /usr/bin/get-creds\n\
             [profile web]\nweb_identity_token_file = /var/run/token\n\
             role_arn = arn:aws:iam::1:role/W\n",
        )
        .unwrap();
        std::fs::write(
            &creds,
            "[default]\naws_access_key_id = D\naws_secret_access_key = DS\n\
             [prockeys]\naws_access_key_id = K\naws_secret_access_key = KS\n",
        )
        .unwrap();
        let files = [
            ("AWS_CONFIG_FILE", config.to_str().unwrap().to_string()),
            (
                "AWS_SHARED_CREDENTIALS_FILE",
                creds.to_str().unwrap().to_string(),
            ),
        ];
        let env_of = |extra: Vec<(&'static str, &str)>| {
            let mut map: HashMap<&str, String> = files.iter().cloned().collect();
            map.extend(extra.into_iter().map(|(k, v)| (k, v.to_string())));
            move |k: &str| map.get(k).cloned()
        };
        let refused = |profile: &str, key: &str| {
            let why = resolve_config(Some(profile), &env_of(vec![])).unwrap_err();
            assert!(
                why.contains(&format!("{profile:?}")) && why.contains(&format!("({key})")),
                "{profile}: {why}"
            );
            why
        };
        assert!(refused("sso", "sso_session").contains("export-credentials --profile sso"));
        refused("role", "role_arn");
        // The AWS CLI would assume the role, not use the profile's own keys.
        refused("rolekeys", "role_arn");
        // credential_process comes before the config file's keys...
        refused("proc", "credential_process");
        // ...and after the credentials file's.
        let r = resolve_config(Some("prockeys"), &env_of(vec![])).unwrap();
        assert_eq!(r.credentials.unwrap().access_key_id, "K");
        assert!(
            refused("web", "web_identity_token_file")
                .contains("AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN")
        );
        // The same through AWS_PROFILE, and at mount time (`ObjectSource::open`).
        let env = env_of(vec![("AWS_PROFILE", "sso")]);
        let url = ObjectUrl::parse("s3://bucket").unwrap();
        let e = ObjectSource::open_with_env(&url, S3Options::default(), &env, false).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("(sso_session)"), "{e}");
        // Keys in the environment come first, as for the AWS CLI.
        let env = env_of(vec![
            ("AWS_PROFILE", "role"),
            ("AWS_ACCESS_KEY_ID", "E"),
            ("AWS_SECRET_ACCESS_KEY", "ES"),
        ]);
        let r = resolve_config(None, &env).unwrap();
        assert_eq!(r.credentials.unwrap().access_key_id, "E");
        // A plain profile beside them still works.
        let r = resolve_config(None, &env_of(vec![])).unwrap();
        assert_eq!(r.credentials.unwrap().access_key_id, "D");
        assert_eq!(r.region.as_deref(), Some("eu-north-1"));
    }

    /// The client for an `https://` endpoint builds (reqwest has no TLS provider of its
    /// own in this build: `install_tls_provider`) and opens connections with a TLS
    /// handshake: a listener on loopback sees a TLS ClientHello.
    #[test]
    fn https_endpoints_get_a_tls_client() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            use std::io::Read;
            let (mut conn, _) = listener.accept().unwrap();
            let mut head = [0u8; 6];
            conn.read_exact(&mut head).unwrap();
            head
        });
        let url = ObjectUrl::parse("s3://bucket").unwrap();
        let opts = S3Options {
            endpoint: Some(format!("https://127.0.0.1:{port}")),
            credentials: Some(Credentials {
                access_key_id: "AKID".into(),
                secret_access_key: "secret".into(),
                session_token: None,
            }),
            max_retries: 0,
            call_timeout: Duration::from_secs(10),
            ..S3Options::default()
        };
        let src = ObjectSource::open_with_env(&url, opts, &|_| None, false).unwrap();
        assert!(src.probe().is_err(), "the listener answers no TLS");
        let head = server.join().unwrap();
        // A TLS record (22: handshake) of version 3.x whose message is a ClientHello (1).
        assert_eq!((head[0], head[1], head[5]), (22, 3, 1), "{head:?}");
    }
}

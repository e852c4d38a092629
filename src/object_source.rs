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

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderName, HeaderValue, Method, StatusCode};
use object_store::aws::{AmazonS3, AmazonS3Builder, AwsAuthorizer};
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequestBody, ReqwestConnector,
};
use object_store::path::Path as ObjPath;
use object_store::{
    Attribute, AttributeValue, Attributes, BackoffConfig, ClientOptions, CopyMode, CopyOptions,
    GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt, PutMultipartOptions, PutOptions,
    PutPayload, RetryConfig,
};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

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

// ---- metadata conventions -------------------------------------------------------------

const META_MODE: &str = "mode";
const META_UID: &str = "uid";
const META_GID: &str = "gid";
const META_MTIME: &str = "mtime";

/// `x-amz-meta-mtime`: s3fs writes whole seconds, rclone seconds with up to nine decimals;
/// parsed exactly, without floating point.
pub fn parse_meta_time(s: &str) -> Option<SystemTime> {
    let s = s.trim();
    let (neg, s) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s),
    };
    let (secs, frac) = s.split_once('.').unwrap_or((s, ""));
    if secs.is_empty() || !secs.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let secs: u64 = secs.parse().ok()?;
    let mut nanos: u32 = 0;
    for (i, b) in frac.bytes().take(9).enumerate() {
        nanos += u32::from(b - b'0') * 10u32.pow(8 - i as u32);
    }
    let d = Duration::new(secs, nanos);
    if neg {
        UNIX_EPOCH.checked_sub(d)
    } else {
        UNIX_EPOCH.checked_add(d)
    }
}

/// Whole seconds when there is no fraction (what s3fs's older parsers expect), else
/// `secs.nnnnnnnnn` (rclone, current s3fs).
pub fn format_meta_time(t: SystemTime) -> String {
    let (s, n) = split_time(t);
    if n == 0 {
        s.to_string()
    } else if s >= 0 {
        format!("{s}.{n:09}")
    } else {
        // Negative with a fraction: -(|s| - 1).(1e9 - n), written as decimal seconds.
        let total = -(s as i128 * 1_000_000_000 + i128::from(n));
        format!("-{}.{:09}", total / 1_000_000_000, total % 1_000_000_000)
    }
}

fn meta_from(get: impl Fn(&str) -> Option<String>) -> ObjMeta {
    let num = |k: &str| get(k).and_then(|v| v.trim().parse::<u32>().ok());
    ObjMeta {
        mode: num(META_MODE).map(|m| m & 0o7777),
        uid: num(META_UID),
        gid: num(META_GID),
        mtime: get(META_MTIME).and_then(|v| parse_meta_time(&v)),
    }
}

fn meta_from_attributes(a: &Attributes) -> ObjMeta {
    meta_from(|k| {
        a.get(&Attribute::Metadata(k.to_string().into()))
            .map(|v| v.as_ref().to_string())
    })
}

fn meta_pairs(meta: &ObjMeta, kind: ObjKind) -> Vec<(&'static str, String)> {
    let mut v = Vec::new();
    if let Some(m) = meta.mode {
        let ty = match kind {
            ObjKind::File => libc::S_IFREG,
            ObjKind::Dir => libc::S_IFDIR,
        };
        v.push((META_MODE, (ty | (m & 0o7777)).to_string()));
    }
    if let Some(u) = meta.uid {
        v.push((META_UID, u.to_string()));
    }
    if let Some(g) = meta.gid {
        v.push((META_GID, g.to_string()));
    }
    if let Some(t) = meta.mtime {
        v.push((META_MTIME, format_meta_time(t)));
    }
    v
}

fn attributes_of(meta: &ObjMeta) -> Attributes {
    let mut a = Attributes::new();
    for (k, v) in meta_pairs(meta, ObjKind::File) {
        a.insert(Attribute::Metadata(k.into()), AttributeValue::from(v));
    }
    a
}

// ---- errno mapping ---------------------------------------------------------------------

/// The HTTP status an `object_store` error carries. Its retry error type is not public, so
/// the status is read from the message it always formats ("status code: 503 ...").
fn http_status(e: &(dyn std::error::Error + 'static)) -> Option<u16> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        let text = err.to_string();
        if let Some(i) = text.find("status code: ") {
            let digits = text.get(i + 13..i + 16)?;
            return digits.parse().ok();
        }
        cur = err.source();
    }
    None
}

fn http_kind(e: &(dyn std::error::Error + 'static)) -> Option<HttpErrorKind> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<HttpError>() {
            return Some(h.kind());
        }
        cur = err.source();
    }
    None
}

fn errno_of_kind(k: HttpErrorKind) -> i32 {
    match k {
        // Refused, no route, DNS, TLS handshake: the store is unreachable.
        HttpErrorKind::Connect => libc::ENOTCONN,
        HttpErrorKind::Timeout => libc::ETIMEDOUT,
        HttpErrorKind::Request | HttpErrorKind::Interrupted => libc::ECONNRESET,
        _ => libc::EIO,
    }
}

fn errno_of_status(status: u16, body: &str) -> i32 {
    match status {
        400 if body.contains("InvalidArgument") || body.contains("KeyTooLong") => libc::EINVAL,
        401 | 403 => libc::EACCES,
        404 => libc::ENOENT,
        405 | 501 => libc::EOPNOTSUPP,
        409 => libc::EEXIST,
        // The object changed under an If-Match.
        412 => libc::ESTALE,
        // SlowDown is a 503; 429 from others. Already retried with backoff by then.
        429 | 503 => libc::EAGAIN,
        504 => libc::ETIMEDOUT,
        _ if body.contains("SlowDown") => libc::EAGAIN,
        _ => libc::EIO,
    }
}

/// The errno for an `object_store` error, after its own bounded retries.
pub fn errno_of(e: &object_store::Error) -> i32 {
    use object_store::Error as E;
    match e {
        E::NotFound { .. } => libc::ENOENT,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => libc::EACCES,
        E::Precondition { .. } | E::NotModified { .. } => libc::ESTALE,
        E::AlreadyExists { .. } => libc::EEXIST,
        E::InvalidPath { .. } | E::UnknownConfigurationKey { .. } => libc::EINVAL,
        E::NotSupported { .. } | E::NotImplemented { .. } => libc::EOPNOTSUPP,
        E::Generic { source, .. } => {
            if let Some(k) = http_kind(source.as_ref()) {
                return errno_of_kind(k);
            }
            match http_status(source.as_ref()) {
                Some(s) => errno_of_status(s, &source.to_string()),
                None if source.to_string().contains("SlowDown") => libc::EAGAIN,
                None => libc::EIO,
            }
        }
        _ => libc::EIO,
    }
}

fn store_err(e: object_store::Error, op: &str, key: &str) -> io::Error {
    let errno = errno_of(&e);
    tracing::debug!(op, key, errno, "object store: {e}");
    io::Error::from_raw_os_error(errno)
}

fn errno(n: i32) -> io::Error {
    io::Error::from_raw_os_error(n)
}

// ---- credentials and profile files ----------------------------------------------------

/// Sections of an AWS INI file (`[default]`, `[profile NAME]`, `[NAME]`) to lower-case keys
/// and values. Nested blocks (`s3 =` followed by indented lines) become `s3.key`.
pub fn parse_ini(text: &str) -> HashMap<String, HashMap<String, String>> {
    let mut out: HashMap<String, HashMap<String, String>> = HashMap::new();
    let mut section: Option<String> = None;
    let mut nested: Option<String> = None;
    for raw in text.lines() {
        let indented = raw.starts_with([' ', '\t']);
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.split_whitespace().collect::<Vec<_>>().join(" ");
            out.entry(name.clone()).or_default();
            section = Some(name);
            nested = None;
            continue;
        }
        let (Some(sec), Some((k, v))) = (&section, line.split_once('=')) else {
            continue;
        };
        let (k, v) = (k.trim().to_ascii_lowercase(), v.trim().to_string());
        let map = out.entry(sec.clone()).or_default();
        match (&nested, indented) {
            (Some(parent), true) => {
                map.insert(format!("{parent}.{k}"), v);
            }
            _ if v.is_empty() => nested = Some(k),
            _ => {
                nested = None;
                map.insert(k, v);
            }
        }
    }
    out
}

/// What the environment and profile files say, resolved the way the AWS CLI does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResolvedConfig {
    pub credentials: Option<Credentials>,
    pub region: Option<String>,
    pub endpoint: Option<String>,
}

/// `env` is the process environment in production (a map in tests). Credentials: the
/// `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` pair, else the profile (`profile`, else
/// `AWS_PROFILE`, else `default`) from `AWS_SHARED_CREDENTIALS_FILE` (~/.aws/credentials,
/// `[NAME]`) then `AWS_CONFIG_FILE` (~/.aws/config, `[profile NAME]`, `[default]`). A profile
/// named explicitly that neither file has is an error; no `default` means None (object_store's
/// chain then tries web identity, ECS and instance metadata). Without keys in the environment,
/// a profile that gets its credentials another way (`UNSUPPORTED_PROFILE_KEYS`) is an error.
pub fn resolve_config(
    profile: Option<&str>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ResolvedConfig, String> {
    let nonempty = |k: &str| env(k).filter(|v| !v.is_empty());
    let home = nonempty("HOME").map(PathBuf::from);
    let file = |var: &str, default: &str| -> Option<PathBuf> {
        nonempty(var)
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(default)))
    };
    let read = |p: Option<PathBuf>| -> Result<HashMap<String, HashMap<String, String>>, String> {
        match p {
            None => Ok(HashMap::new()),
            Some(p) => match std::fs::read_to_string(&p) {
                Ok(t) => Ok(parse_ini(&t)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(HashMap::new()),
                Err(e) => Err(format!("{}: {e}", p.display())),
            },
        }
    };
    let creds_file = read(file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials"))?;
    let config_file = read(file("AWS_CONFIG_FILE", ".aws/config"))?;

    let explicit = profile
        .map(str::to_string)
        .or_else(|| nonempty("AWS_PROFILE"));
    let name = explicit.clone().unwrap_or_else(|| "default".to_string());
    let from_creds = creds_file.get(&name);
    let from_config = config_file.get(&format!("profile {name}")).or_else(|| {
        (name == "default")
            .then(|| config_file.get("default"))
            .flatten()
    });
    if explicit.is_some() && from_creds.is_none() && from_config.is_none() {
        return Err(format!(
            "AWS profile {name:?} is in neither the credentials nor the config file"
        ));
    }
    let get = |k: &str| -> Option<String> {
        from_creds
            .and_then(|m| m.get(k))
            .or_else(|| from_config.and_then(|m| m.get(k)))
            .filter(|v| !v.is_empty())
            .cloned()
    };

    let credentials = match (
        nonempty("AWS_ACCESS_KEY_ID"),
        nonempty("AWS_SECRET_ACCESS_KEY"),
    ) {
        (Some(id), Some(secret)) => Some(Credentials {
            access_key_id: id,
            secret_access_key: secret,
            session_token: nonempty("AWS_SESSION_TOKEN"),
        }),
        _ if let Some(why) = unusable_profile(&name, from_creds, from_config) => {
            return Err(why);
        }
        _ => match (get("aws_access_key_id"), get("aws_secret_access_key")) {
            (Some(id), Some(secret)) => Some(Credentials {
                access_key_id: id,
                secret_access_key: secret,
                session_token: get("aws_session_token"),
            }),
            _ => None,
        },
    };
    Ok(ResolvedConfig {
        credentials,
        region: nonempty("AWS_REGION")
            .or_else(|| nonempty("AWS_DEFAULT_REGION"))
            .or_else(|| get("region")),
        // AWS_ENDPOINT is object_store's own name for it.
        endpoint: nonempty("AWS_ENDPOINT_URL_S3")
            .or_else(|| nonempty("AWS_ENDPOINT_URL"))
            .or_else(|| nonempty("AWS_ENDPOINT"))
            .or_else(|| get("s3.endpoint_url"))
            .or_else(|| get("endpoint_url")),
    })
}

/// Profile keys that name a credential source hoardfs does not implement: it reads only
/// static keys from the profile files. The AWS CLI prefers each of these to the profile's
/// static keys, except `credential_process`, which comes after the keys of the credentials
/// file (botocore's chain: environment, assume role, web identity, SSO, credentials file,
/// process, config file).
const UNSUPPORTED_PROFILE_KEYS: [(&str, &str); 9] = [
    // First: its profile names a `role_arn` too.
    ("web_identity_token_file", "web identity"),
    ("role_arn", "an assumed role"),
    ("source_profile", "an assumed role"),
    ("credential_source", "an assumed role"),
    ("sso_session", "IAM Identity Center (SSO)"),
    ("sso_start_url", "IAM Identity Center (SSO)"),
    ("sso_account_id", "IAM Identity Center (SSO)"),
    ("sso_role_name", "IAM Identity Center (SSO)"),
    ("credential_process", "an external process"),
];

/// Why the profile `name` cannot give hoardfs its credentials, when the AWS CLI would take
/// them from a source hoardfs does not implement (`UNSUPPORTED_PROFILE_KEYS`): a mount
/// that silently used other keys, or none, would fail later and obscurely.
fn unusable_profile(
    name: &str,
    from_creds: Option<&HashMap<String, String>>,
    from_config: Option<&HashMap<String, String>>,
) -> Option<String> {
    let has = |m: Option<&HashMap<String, String>>, k: &str| {
        m.and_then(|m| m.get(k)).is_some_and(|v| !v.is_empty())
    };
    let static_in_creds =
        has(from_creds, "aws_access_key_id") && has(from_creds, "aws_secret_access_key");
    let (key, what) = UNSUPPORTED_PROFILE_KEYS.into_iter().find(|(k, _)| {
        (has(from_creds, k) || has(from_config, k))
            && !(*k == "credential_process" && static_in_creds)
    })?;
    let instead = if key == "web_identity_token_file" {
        "set AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN in hoardfs's environment instead \
         (read and refreshed by the S3 client)"
            .to_string()
    } else {
        format!(
            "give hoardfs static keys instead: a profile with aws_access_key_id and \
             aws_secret_access_key (chosen with AWS_PROFILE), or AWS_ACCESS_KEY_ID, \
             AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN in its environment, e.g. from \
             `aws configure export-credentials --profile {name} --format env` (temporary \
             keys expire, and the mount's requests fail then)"
        )
    };
    Some(format!(
        "AWS profile {name:?} gets its credentials from {what} ({key}), which hoardfs \
         cannot use; {instead}"
    ))
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

/// Everything but unreserved characters and `/`, as `object_store` encodes paths (the
/// signature covers the encoded path, so both must agree).
const PATH_ENCODE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'/');

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

    // ---- reads ----

    /// That the bucket exists and may be listed (at start): the first key under the
    /// prefix, if any. A missing bucket is `ENOENT`, a refused one `EACCES`.
    pub fn check_root(&self) -> io::Result<()> {
        let prefix = (!self.prefix.is_empty())
            .then(|| Self::obj_path(&self.prefix))
            .transpose()?;
        self.block(async {
            let mut s = self.store.list(prefix.as_ref());
            match s.next().await {
                Some(Err(e)) => Err(store_err(e, "list", &self.prefix)),
                _ => Ok(()),
            }
        })
    }

    /// A reachability check for the health probe: a HEAD of a key that need not exist.
    pub fn probe(&self) -> io::Result<()> {
        let key = self.key_of(FsPath::new(".hoardfs-probe"))?;
        match self.head(&key) {
            Ok(_) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn head(&self, key: &str) -> io::Result<ObjStat> {
        self.head_attributes(key).map(|(st, _)| st)
    }

    /// A HEAD with every attribute (user metadata, content type, ...) the store sent.
    fn head_attributes(&self, key: &str) -> io::Result<(ObjStat, Attributes)> {
        let path = Self::obj_path(key)?;
        self.block(async {
            let opts = GetOptions {
                head: true,
                ..Default::default()
            };
            let r = self
                .store
                .get_opts(&path, opts)
                .await
                .map_err(|e| store_err(e, "head", key))?;
            let meta = meta_from_attributes(&r.attributes);
            Ok((ObjStat::file(&r.meta, meta, true), r.attributes))
        })
    }

    /// HEAD first (a file, or an object at a name that is also a prefix: the object wins),
    /// then a listing of `rel/`: any key there (the marker `rel/` included) makes a
    /// directory. The root is always a directory.
    pub fn stat(&self, rel: &FsPath) -> io::Result<ObjStat> {
        let key = self.key_of(rel)?;
        if is_root(rel) {
            return Ok(ObjStat::dir(ObjMeta::default(), UNIX_EPOCH, false));
        }
        match self.head(&key) {
            Ok(st) => return Ok(st),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
        let path = Self::obj_path(&key)?;
        let first = self.block(async {
            let mut s = self.store.list(Some(&path));
            match s.next().await {
                None => Ok(None),
                Some(Ok(m)) => Ok(Some(m)),
                Some(Err(e)) => Err(store_err(e, "list", &key)),
            }
        })?;
        match first {
            None => Err(errno(libc::ENOENT)),
            // Keys list in order, so a marker `rel/` comes first; it has the metadata.
            Some(m) if m.location == path => match self.marker_head(&key) {
                Ok(st) => Ok(st),
                // Gone since the listing: still a directory if anything else is below.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                    Ok(ObjStat::dir(ObjMeta::default(), UNIX_EPOCH, false))
                }
                Err(e) => Err(e),
            },
            Some(_) => Ok(ObjStat::dir(ObjMeta::default(), UNIX_EPOCH, false)),
        }
    }

    /// The entries of directory `rel`, sorted by name: common prefixes are directories,
    /// objects files; `rel`'s own marker is not listed. `ENOTDIR` if `rel` is a file,
    /// `ENOENT` if nothing is there (the root is an empty directory then).
    pub fn list_dir(&self, rel: &FsPath) -> io::Result<Vec<(String, ObjStat)>> {
        let key = self.key_of(rel)?;
        let path = Self::obj_path(&key)?;
        let listing = self.block(async {
            self.store
                .list_with_delimiter(Some(&path))
                .await
                .map_err(|e| store_err(e, "list", &key))
        })?;
        let root = is_root(rel);
        let mut files: Vec<(String, ObjStat)> = Vec::new();
        let mut any = false;
        for m in &listing.objects {
            any = true;
            if m.location == path {
                continue; // our own marker
            }
            let Some(name) = m.location.filename() else {
                continue;
            };
            files.push((
                name.to_string(),
                ObjStat::file(m, ObjMeta::default(), false),
            ));
        }
        let names: std::collections::HashSet<String> =
            files.iter().map(|(n, _)| n.clone()).collect();
        let mut out = files;
        for p in &listing.common_prefixes {
            any = true;
            let Some(name) = p.filename() else { continue };
            if names.contains(name) {
                tracing::warn!(
                    "object store: {p}/ is hidden by the object {p} (a name cannot be both)"
                );
                continue;
            }
            out.push((
                name.to_string(),
                ObjStat::dir(ObjMeta::default(), UNIX_EPOCH, false),
            ));
        }
        if !any && !root {
            return match self.head(&key) {
                Ok(_) => Err(errno(libc::ENOTDIR)),
                Err(e) => Err(e),
            };
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// `len` bytes at `offset` (fewer at the end of the object, none past it). With
    /// `expected_etag`, a changed object answers `ESTALE` (If-Match, and the answer's ETag
    /// checked too, for servers that ignore the condition).
    pub fn read_range(
        &self,
        rel: &FsPath,
        offset: u64,
        len: u64,
        expected_etag: Option<&str>,
    ) -> io::Result<Bytes> {
        let key = self.key_of(rel)?;
        self.block(async {
            match self.get_range(&key, offset, len, expected_etag).await? {
                None => Ok(Bytes::new()),
                Some(r) => r.bytes().await.map_err(|e| store_err(e, "get body", &key)),
            }
        })
    }

    /// Like `read_range`, but the body goes to `sink(offset, bytes)` piece by piece as it
    /// arrives: no buffer of the whole range and no copy into one. Returns the bytes
    /// delivered; a sink's error ends the read with that error.
    pub fn read_range_into(
        &self,
        rel: &FsPath,
        offset: u64,
        len: u64,
        expected_etag: Option<&str>,
        sink: &mut dyn FnMut(u64, &[u8]) -> io::Result<()>,
    ) -> io::Result<u64> {
        let key = self.key_of(rel)?;
        self.block(async {
            let Some(r) = self.get_range(&key, offset, len, expected_etag).await? else {
                return Ok(0);
            };
            let mut body = r.into_stream();
            let mut at = offset;
            while let Some(piece) = body.next().await {
                let piece = piece.map_err(|e| store_err(e, "get body", &key))?;
                sink(at, &piece)?;
                at += piece.len() as u64;
            }
            Ok(at - offset)
        })
    }

    /// The GET of a range: `None` when it starts at or past the end of the object.
    async fn get_range(
        &self,
        key: &str,
        offset: u64,
        len: u64,
        expected_etag: Option<&str>,
    ) -> io::Result<Option<object_store::GetResult>> {
        if len == 0 {
            return Ok(None);
        }
        let path = Self::obj_path(key)?;
        let opts = GetOptions {
            if_match: expected_etag.map(str::to_string),
            range: Some(GetRange::Bounded(offset..offset.saturating_add(len))),
            ..Default::default()
        };
        let r = match self.store.get_opts(&path, opts).await {
            Ok(r) => r,
            Err(e) => {
                // 416: the range starts at or past the end (object_store may also say so
                // itself): a read at EOF.
                let text = e.to_string();
                if matches!(&e, object_store::Error::Generic { .. })
                    && (text.contains("status code: 416") || text.contains("InvalidRange"))
                {
                    return Ok(None);
                }
                return Err(store_err(e, "get", key));
            }
        };
        if let (Some(want), Some(got)) = (expected_etag, r.meta.e_tag.as_deref())
            && want != got
        {
            return Err(errno(libc::ESTALE));
        }
        Ok(Some(r))
    }

    // ---- writes ----

    /// Uploads `file` (from offset 0, its current length) as `rel` with `meta`: one PUT up
    /// to `multipart_threshold`, else a multipart upload with `parts_in_flight` parts in
    /// flight (aborted on failure). Returns the new object's stat.
    pub fn put(&self, rel: &FsPath, file: &File, meta: &ObjMeta) -> io::Result<ObjStat> {
        let key = self.key_of(rel)?;
        let path = Self::obj_path(&key)?;
        let size = file.metadata()?.len();
        let attributes = attributes_of(meta);
        if size <= self.opts.multipart_threshold {
            let mut buf = vec![0u8; size as usize];
            file.read_exact_at(&mut buf, 0)?;
            self.block(async {
                let opts = PutOptions {
                    attributes,
                    ..Default::default()
                };
                self.store
                    .put_opts(&path, PutPayload::from(buf), opts)
                    .await
                    .map_err(|e| store_err(e, "put", &key))
            })?;
        } else {
            self.put_multipart(&key, &path, file, size, attributes)?;
        }
        self.head(&key)
    }

    fn put_multipart(
        &self,
        key: &str,
        path: &ObjPath,
        file: &File,
        size: u64,
        attributes: Attributes,
    ) -> io::Result<()> {
        let opts = PutMultipartOptions {
            attributes,
            ..Default::default()
        };
        let mut upload = self.block(async {
            self.store
                .put_multipart_opts(path, opts)
                .await
                .map_err(|e| store_err(e, "create multipart", key))
        })?;
        // Parts are numbered in call order, so they are started in order; up to
        // `parts_in_flight` run at once on the runtime while this thread reads the next.
        // S3 takes at most 10,000 parts: bigger files get bigger parts.
        let part = (self.opts.part_size as u64).max(size.div_ceil(10_000));
        let mut in_flight: VecDeque<tokio::task::JoinHandle<object_store::Result<()>>> =
            VecDeque::new();
        let mut result: io::Result<()> = Ok(());
        let mut offset = 0;
        while offset < size && result.is_ok() {
            let n = part.min(size - offset) as usize;
            let mut buf = vec![0u8; n];
            if let Err(e) = file.read_exact_at(&mut buf, offset) {
                result = Err(e);
                break;
            }
            offset += n as u64;
            let fut = upload.put_part(PutPayload::from(buf));
            in_flight.push_back(self.rt.spawn(fut));
            if in_flight.len() >= self.opts.parts_in_flight
                && let Some(h) = in_flight.pop_front()
            {
                result = self.join_part(h, key);
            }
        }
        while let Some(h) = in_flight.pop_front() {
            if result.is_err() {
                h.abort(); // no use waiting for parts of an upload about to be aborted
                continue;
            }
            result = self.join_part(h, key);
        }
        match result {
            Ok(()) => self.block(async {
                upload
                    .complete()
                    .await
                    .map(|_| ())
                    .map_err(|e| store_err(e, "complete multipart", key))
            }),
            Err(e) => {
                // Best effort: an unaborted upload only costs storage until the bucket's
                // lifecycle rule (if any) cleans it.
                if let Err(a) = self.block(async {
                    upload
                        .abort()
                        .await
                        .map_err(|e| store_err(e, "abort multipart", key))
                }) {
                    tracing::warn!(key, "object store: aborting a failed upload: {a}");
                }
                Err(e)
            }
        }
    }

    fn join_part(
        &self,
        h: tokio::task::JoinHandle<object_store::Result<()>>,
        key: &str,
    ) -> io::Result<()> {
        let abort = h.abort_handle();
        let r = self.block(async {
            match h.await {
                Ok(r) => r.map_err(|e| store_err(e, "put part", key)),
                Err(_) => Err(errno(libc::EIO)),
            }
        });
        if r.is_err() {
            abort.abort();
        }
        r
    }

    /// Server-side copy of a file, metadata included (the first half of a rename; objects
    /// up to 5 GiB, S3's single-copy limit).
    pub fn copy(&self, from: &FsPath, to: &FsPath) -> io::Result<()> {
        let (fk, tk) = (self.key_of(from)?, self.key_of(to)?);
        let (fp, tp) = (Self::obj_path(&fk)?, Self::obj_path(&tk)?);
        self.block(async {
            let opts = CopyOptions {
                mode: CopyMode::Overwrite,
                ..Default::default()
            };
            self.store
                .copy_opts(&fp, &tp, opts)
                .await
                .map_err(|e| store_err(e, "copy", &fk))
        })
    }

    /// Deletes a file's object. S3 answers success for a missing key, so callers that need
    /// `ENOENT` stat first.
    pub fn delete(&self, rel: &FsPath) -> io::Result<()> {
        let key = self.key_of(rel)?;
        let path = Self::obj_path(&key)?;
        self.block(async {
            self.store
                .delete(&path)
                .await
                .map_err(|e| store_err(e, "delete", &key))
        })
    }

    /// Rename of a file: copy, then delete the old key. Not atomic: a crash in between
    /// leaves both.
    pub fn rename_file(&self, from: &FsPath, to: &FsPath) -> io::Result<()> {
        if self.stat(from)?.kind == ObjKind::Dir {
            // Renaming a directory would be a copy of every key below it; EXDEV makes
            // `mv` fall back to copying the tree itself.
            return Err(errno(libc::EXDEV));
        }
        match self.stat(to) {
            // An object `to` would hide the directory `to/` (the object wins).
            Ok(st) if st.kind == ObjKind::Dir => return Err(errno(libc::EISDIR)),
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
        self.copy(from, to)?;
        self.delete(from)
    }

    /// A `rel/` marker object carrying `meta`. `EEXIST` if `rel` is a file or a directory.
    pub fn mkdir(&self, rel: &FsPath, meta: &ObjMeta) -> io::Result<ObjStat> {
        let key = self.key_of(rel)?;
        if is_root(rel) {
            return Err(errno(libc::EEXIST));
        }
        match self.stat(rel) {
            Ok(_) => return Err(errno(libc::EEXIST)),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            Err(e) => return Err(e),
        }
        self.put_marker(&key, meta)?;
        self.marker_head(&key)
    }

    /// Removes an empty directory's marker. `ENOTEMPTY` if any key lies below `rel/`,
    /// `ENOENT` if nothing does, `ENOTDIR` for a file.
    pub fn rmdir(&self, rel: &FsPath) -> io::Result<()> {
        let key = self.key_of(rel)?;
        let path = Self::obj_path(&key)?;
        if is_root(rel) {
            return Err(errno(libc::EBUSY));
        }
        let first_two = self.block(async {
            let mut s = self.store.list(Some(&path)).take(2);
            let mut v = Vec::new();
            while let Some(m) = s.next().await {
                v.push(m.map_err(|e| store_err(e, "list", &key))?);
            }
            Ok(v)
        })?;
        if first_two.iter().any(|m| m.location != path) {
            return Err(errno(libc::ENOTEMPTY));
        }
        if first_two.is_empty() {
            return match self.head(&key) {
                Ok(_) => Err(errno(libc::ENOTDIR)),
                Err(e) => Err(e),
            };
        }
        self.raw_request(Method::DELETE, &format!("{key}/"), Vec::new())
            .map(|_| ())
    }

    /// Changes some of mode, uid, gid, mtime (the `Some` fields), keeping the others. A
    /// file's object is copied onto itself with the new metadata (its ETag and
    /// Last-Modified may change: use the returned stat as the new identity); a directory's
    /// marker is rewritten (created if it had none).
    pub fn set_meta(&self, rel: &FsPath, update: &ObjMeta) -> io::Result<ObjStat> {
        let key = self.key_of(rel)?;
        let st = self.stat(rel)?;
        let merged = ObjMeta {
            mode: update.mode.or(st.meta.mode),
            uid: update.uid.or(st.meta.uid),
            gid: update.gid.or(st.meta.gid),
            mtime: update.mtime.or(st.meta.mtime),
        };
        match st.kind {
            ObjKind::Dir => {
                if key.is_empty() {
                    // The root of a whole bucket has no key to hang a marker on.
                    return Err(errno(libc::EPERM));
                }
                self.put_marker(&key, &merged)?;
                self.marker_head(&key)
            }
            ObjKind::File => {
                // REPLACE drops what it is not given: carry over the other tools' metadata
                // (s3fs's atime/ctime, rclone's md5chksum, ...) and the content headers.
                let (st, attributes) = self.head_attributes(&key)?;
                let mut headers: Vec<(String, String)> = vec![
                    (
                        "x-amz-copy-source".into(),
                        format!(
                            "/{}/{}",
                            self.bucket,
                            utf8_percent_encode(&key, PATH_ENCODE)
                        ),
                    ),
                    ("x-amz-metadata-directive".into(), "REPLACE".into()),
                ];
                if let Some(etag) = &st.etag {
                    // Do not clobber a version written since the HEAD: ESTALE instead.
                    headers.push(("x-amz-copy-source-if-match".into(), etag.clone()));
                }
                let ours = meta_pairs(&merged, ObjKind::File);
                for (attr, value) in attributes.iter() {
                    let name = match attr {
                        Attribute::Metadata(k) if ours.iter().any(|(o, _)| o == k) => continue,
                        Attribute::Metadata(k) => format!("x-amz-meta-{k}"),
                        Attribute::ContentType => "content-type".into(),
                        Attribute::ContentEncoding => "content-encoding".into(),
                        Attribute::ContentDisposition => "content-disposition".into(),
                        Attribute::ContentLanguage => "content-language".into(),
                        Attribute::CacheControl => "cache-control".into(),
                        Attribute::StorageClass => "x-amz-storage-class".into(),
                        _ => continue,
                    };
                    headers.push((name, value.as_ref().to_string()));
                }
                headers.extend(
                    ours.into_iter()
                        .map(|(k, v)| (format!("x-amz-meta-{k}"), v)),
                );
                let refs = headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.clone()))
                    .collect();
                self.raw_request(Method::PUT, &key, refs)?;
                self.head(&key)
            }
        }
    }

    // ---- markers: keys ending in '/' ----

    fn put_marker(&self, key: &str, meta: &ObjMeta) -> io::Result<()> {
        let pairs = meta_pairs(meta, ObjKind::Dir);
        let owned: Vec<(String, String)> = pairs
            .into_iter()
            .map(|(k, v)| (format!("x-amz-meta-{k}"), v))
            .collect();
        let headers = owned.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        self.raw_request(Method::PUT, &format!("{key}/"), headers)
            .map(|_| ())
    }

    fn marker_head(&self, key: &str) -> io::Result<ObjStat> {
        let h = self.raw_request(Method::HEAD, &format!("{key}/"), Vec::new())?;
        let get = |k: &str| {
            h.get(format!("x-amz-meta-{k}").as_str())
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let meta = meta_from(get);
        let last_modified = h
            .get(http::header::LAST_MODIFIED)
            .and_then(|v| v.to_str().ok())
            .and_then(parse_http_date)
            .unwrap_or(UNIX_EPOCH);
        Ok(ObjStat::dir(meta, last_modified, true))
    }

    /// One signed request for `key` (which may end in '/'), with object_store's signer and
    /// HTTP client, retried like object_store's own on 5xx, 429 and connection errors.
    /// Returns the response headers.
    fn raw_request(
        &self,
        method: Method,
        key: &str,
        headers: Vec<(&str, String)>,
    ) -> io::Result<http::HeaderMap> {
        let url = format!(
            "{}/{}",
            self.bucket_endpoint,
            utf8_percent_encode(key, PATH_ENCODE)
        );
        let mut hv = Vec::new();
        for (k, v) in headers {
            let name = HeaderName::from_bytes(k.as_bytes()).map_err(|_| errno(libc::EINVAL))?;
            let value = HeaderValue::from_str(&v).map_err(|_| errno(libc::EINVAL))?;
            hv.push((name, value));
        }
        self.block(async {
            let mut attempt = 0;
            let mut backoff = Duration::from_millis(100);
            loop {
                let cred = self
                    .store
                    .credentials()
                    .get_credential()
                    .await
                    .map_err(|e| store_err(e, "credentials", key))?;
                let mut req = http::Request::builder()
                    .method(method.clone())
                    .uri(&url)
                    .body(HttpRequestBody::from(Vec::new()))
                    .map_err(|_| errno(libc::EINVAL))?;
                for (k, v) in &hv {
                    req.headers_mut().insert(k.clone(), v.clone());
                }
                req.headers_mut()
                    .insert(http::header::CONTENT_LENGTH, HeaderValue::from_static("0"));
                AwsAuthorizer::new(&cred, "s3", &self.region)
                    .try_authorize(&mut req, None)
                    .map_err(|e| store_err(e, "sign", key))?;
                let errno_now = match self.http.execute(req).await {
                    Ok(resp) => {
                        let status = resp.status();
                        if status.is_success() {
                            return Ok(resp.headers().clone());
                        }
                        let body = match method {
                            Method::HEAD => String::new(),
                            _ => resp
                                .into_body()
                                .bytes()
                                .await
                                .map(|b| String::from_utf8_lossy(&b).into_owned())
                                .unwrap_or_default(),
                        };
                        // A copy whose answer is 200 with an error body is not seen here
                        // (copies of markers never happen; a self-copy's errors are 4xx).
                        tracing::debug!(key, %status, body, "object store: marker request");
                        let retry =
                            status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS;
                        if !retry || attempt >= self.opts.max_retries {
                            return Err(errno(errno_of_status(status.as_u16(), &body)));
                        }
                        errno_of_status(status.as_u16(), &body)
                    }
                    Err(e) => {
                        let n = errno_of_kind(e.kind());
                        let retry =
                            matches!(e.kind(), HttpErrorKind::Connect | HttpErrorKind::Request)
                                || (method == Method::HEAD && e.kind() == HttpErrorKind::Timeout);
                        if !retry || attempt >= self.opts.max_retries {
                            tracing::debug!(key, "object store: marker request: {e}");
                            return Err(errno(n));
                        }
                        n
                    }
                };
                tracing::debug!(key, errno_now, attempt, "object store: retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                attempt += 1;
            }
        })
    }
}

fn is_root(rel: &FsPath) -> bool {
    rel.components().all(|c| c == Component::CurDir)
}

/// RFC 7231 IMF-fixdate, as S3 sends Last-Modified ("Sun, 06 Nov 1994 08:49:37 GMT"): the
/// RFC 2822 form with the zone written `GMT`.
fn parse_http_date(s: &str) -> Option<SystemTime> {
    if !s.trim_end().ends_with(" GMT") {
        return None;
    }
    chrono::DateTime::parse_from_rfc2822(s)
        .ok()
        .map(SystemTime::from)
}

#[cfg(test)]
mod tests {
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

//! The s3fs and rclone metadata conventions: user metadata (`x-amz-meta-*`) to and from
//! `ObjMeta`, and the exact decimal form of `x-amz-meta-mtime`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use object_store::{Attribute, AttributeValue, Attributes};

use super::{ObjKind, ObjMeta, split_time};

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

pub(super) fn meta_from(get: impl Fn(&str) -> Option<String>) -> ObjMeta {
    let num = |k: &str| get(k).and_then(|v| v.trim().parse::<u32>().ok());
    ObjMeta {
        mode: num(META_MODE).map(|m| m & 0o7777),
        uid: num(META_UID),
        gid: num(META_GID),
        mtime: get(META_MTIME).and_then(|v| parse_meta_time(&v)),
    }
}

pub(super) fn meta_from_attributes(a: &Attributes) -> ObjMeta {
    meta_from(|k| {
        a.get(&Attribute::Metadata(k.to_string().into()))
            .map(|v| v.as_ref().to_string())
    })
}

pub(super) fn meta_pairs(meta: &ObjMeta, kind: ObjKind) -> Vec<(&'static str, String)> {
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

pub(super) fn attributes_of(meta: &ObjMeta) -> Attributes {
    let mut a = Attributes::new();
    for (k, v) in meta_pairs(meta, ObjKind::File) {
        a.insert(Attribute::Metadata(k.into()), AttributeValue::from(v));
    }
    a
}

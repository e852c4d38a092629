//! The reading calls of `ObjectSource`: the root check and probe, HEADs, `stat`, directory
//! listings and ranged GETs.

use std::io;
use std::path::Path as FsPath;
use std::time::UNIX_EPOCH;

use bytes::Bytes;
use futures_util::StreamExt;
use object_store::{Attributes, GetOptions, GetRange, ObjectStore};

use super::error::{ObjectError, errno};
use super::meta::meta_from_attributes;
use super::{ObjMeta, ObjStat, ObjectSource, is_root};

impl ObjectSource {
    /// That the bucket exists and may be listed (at start): the first key under the
    /// prefix, if any. A missing bucket is `ENOENT`, a refused one `EACCES`.
    pub fn check_root(&self) -> io::Result<()> {
        let prefix = (!self.prefix.is_empty())
            .then(|| Self::obj_path(&self.prefix))
            .transpose()?;
        self.block(async {
            let mut s = self.store.list(prefix.as_ref());
            match s.next().await {
                Some(Err(e)) => Err(ObjectError::store("list", &self.prefix, e).into()),
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

    pub(super) fn head(&self, key: &str) -> io::Result<ObjStat> {
        self.head_attributes(key).map(|(st, _)| st)
    }

    /// A HEAD with every attribute (user metadata, content type, ...) the store sent.
    pub(super) fn head_attributes(&self, key: &str) -> io::Result<(ObjStat, Attributes)> {
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
                .map_err(|e| ObjectError::store("head", key, e))?;
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
                Some(Err(e)) => Err(ObjectError::store("list", &key, e).into()),
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
                .map_err(|e| ObjectError::store("list", &key, e).into())
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
                Some(r) => r
                    .bytes()
                    .await
                    .map_err(|e| ObjectError::store("get body", &key, e).into()),
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
                let piece = piece.map_err(|e| ObjectError::store("get body", &key, e))?;
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
                // The range starts at or past the end: a read at EOF.
                let e = ObjectError::store("get", key, e);
                if e.range_not_satisfiable() {
                    return Ok(None);
                }
                return Err(e.into());
            }
        };
        if let (Some(want), Some(got)) = (expected_etag, r.meta.e_tag.as_deref())
            && want != got
        {
            return Err(errno(libc::ESTALE));
        }
        Ok(Some(r))
    }
}

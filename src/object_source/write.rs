//! The writing calls of `ObjectSource`: uploads (single PUT or multipart, parts in flight),
//! server-side copy, delete, rename, `mkdir`/`rmdir` and metadata rewrites.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path as FsPath;

use futures_util::StreamExt;
use http::Method;
use object_store::path::Path as ObjPath;
use object_store::{
    Attribute, Attributes, CopyMode, CopyOptions, ObjectStore, ObjectStoreExt, PutMultipartOptions,
    PutOptions, PutPayload,
};
use percent_encoding::utf8_percent_encode;

use super::error::{ObjectError, errno};
use super::marker::PATH_ENCODE;
use super::meta::{attributes_of, meta_pairs};
use super::{ObjKind, ObjMeta, ObjStat, ObjectSource, is_root};

impl ObjectSource {
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
                    .map_err(|e| ObjectError::store("put", &key, e).into())
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
                .map_err(|e| ObjectError::store("create multipart", key, e).into())
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
                    .map_err(|e| ObjectError::store("complete multipart", key, e).into())
            }),
            Err(e) => {
                // Best effort: an unaborted upload only costs storage until the bucket's
                // lifecycle rule (if any) cleans it.
                if let Err(a) = self.block(async {
                    upload
                        .abort()
                        .await
                        .map_err(|e| ObjectError::store("abort multipart", key, e).into())
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
                Ok(r) => r.map_err(|e| ObjectError::store("put part", key, e).into()),
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
                .map_err(|e| ObjectError::store("copy", &fk, e).into())
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
                .map_err(|e| ObjectError::store("delete", &key, e).into())
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
                v.push(m.map_err(|e| ObjectError::store("list", &key, e))?);
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
        self.raw_request(
            "delete marker",
            Method::DELETE,
            &format!("{key}/"),
            Vec::new(),
        )
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
                self.raw_request("copy onto itself", Method::PUT, &key, refs)?;
                self.head(&key)
            }
        }
    }
}

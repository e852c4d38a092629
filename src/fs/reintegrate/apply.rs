//! The replay of one logged change to the source, per kind of change, with uploads through
//! a temporary file, content comparison and the cache settled after.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{conflict_path, os_errno};
use crate::fs::CachingFs;
use crate::fs::entry::closed;
use crate::oplog::{Entry, Op, OpLog, Produced};
use crate::source::{SetAttr, Stat, TimeSpec};

/// Bytes per source call when replay copies a file (each call is under the timeout).
const COPY_PIECE: usize = 1 << 20;

impl CachingFs {
    pub(super) fn replay_one(
        &self,
        e: &Entry,
        log: &mut OpLog,
        produced: &mut HashMap<PathBuf, Produced>,
    ) -> io::Result<()> {
        match &e.op {
            Op::Store {
                path,
                base,
                mode,
                owner,
            } => {
                let p = crate::oplog::path(path);
                let container = log.open_container(e.seq)?;
                let cur = self.current(&p)?;
                if self.base_holds(*base, cur.as_ref(), &p, produced) {
                    let owner = cur.as_ref().map(|s| (s.uid, s.gid)).or(*owner);
                    match self.upload(&p, e.seq, &container, *mode, owner, cur.is_some()) {
                        Ok(()) => {
                            let after = self.current(&p)?;
                            produced.insert(p.clone(), Produced::Left(self.ident(after.as_ref())));
                            self.settle_cache(&p, &container, after.as_ref());
                            return Ok(());
                        }
                        Err(err) if os_errno(&err) != Some(libc::EEXIST) => return Err(err),
                        Err(_) => {} // made on the source meanwhile: a conflict
                    }
                } else if cur.as_ref().is_some_and(|s| s.is_file())
                    && self.same_content(&p, &container)?
                {
                    // Done before a crash (or the source has this very content).
                    produced.insert(p.clone(), Produced::Left(self.ident(cur.as_ref())));
                    return Ok(());
                }
                let aside = conflict_path(&p, e);
                let done =
                    self.current(&aside)?.is_some() && self.same_content(&aside, &container)?;
                if !done {
                    self.upload(&aside, e.seq, &container, *mode, *owner, false)?;
                }
                self.report(
                    e,
                    &format!(
                        "conflict: the source's {} is not the version changed offline; the \
                         source's is kept, this mount's is at {}",
                        p.display(),
                        aside.display()
                    ),
                );
                produced.insert(p.clone(), Produced::Conflicted);
                let _ = self.uncache(&p);
                Ok(())
            }
            Op::Unlink { path, base } => {
                let p = crate::oplog::path(path);
                let cur = self.current(&p)?;
                if cur.is_none() {
                    produced.insert(p, Produced::Left(None));
                } else if self.base_holds(*base, cur.as_ref(), &p, produced) {
                    let q = p.clone();
                    self.source.call_anyway(move |r| r.unlink(&q))?;
                    produced.insert(p, Produced::Left(None));
                } else {
                    self.report(
                        e,
                        "conflict: deleted offline, but changed on the source meanwhile; \
                         the source's version is kept",
                    );
                    produced.insert(p, Produced::Conflicted);
                }
                Ok(())
            }
            Op::Mkdir { path, mode, owner } => {
                let p = crate::oplog::path(path);
                match self.current(&p)? {
                    Some(st) if st.is_dir() => {}
                    Some(_) => {
                        self.report(
                            e,
                            "conflict: a non-directory of that name exists on the source",
                        );
                        produced.insert(p, Produced::Conflicted);
                        return Ok(());
                    }
                    None => {
                        let (q, mode, owner) = (p.clone(), *mode, *owner);
                        let root = rustix::process::geteuid().is_root();
                        self.source.call_anyway(move |r| {
                            r.mkdir(&q, mode)?;
                            match owner {
                                Some((uid, gid)) if root => r.chown_new(&q, uid, Some(gid)),
                                _ => Ok(()),
                            }
                        })?;
                    }
                }
                let after = self.current(&p)?;
                produced.insert(p, Produced::Left(self.ident(after.as_ref())));
                Ok(())
            }
            Op::Rmdir { path } => {
                let p = crate::oplog::path(path);
                let q = p.clone();
                match self.source.call_anyway(move |r| r.rmdir(&q)) {
                    Ok(()) => {}
                    Err(err) if os_errno(&err) == Some(libc::ENOENT) => {}
                    Err(err) if matches!(os_errno(&err), Some(libc::ENOTEMPTY | libc::EEXIST)) => {
                        self.report(
                            e,
                            "conflict: removed offline, but the source has new entries in it; kept",
                        );
                        produced.insert(p, Produced::Conflicted);
                        return Ok(());
                    }
                    Err(err) => return Err(err),
                }
                produced.insert(p, Produced::Left(None));
                Ok(())
            }
            Op::Rename {
                from,
                to,
                base_from,
                base_to,
            } => {
                let (f, t) = (crate::oplog::path(from), crate::oplog::path(to));
                let cur_from = self.current(&f)?;
                let cur_to = self.current(&t)?;
                if cur_from.is_none() {
                    if log.progress().in_flight == Some(e.seq) && cur_to.is_some() {
                        // Renamed before a crash.
                        produced.insert(f, Produced::Left(None));
                        produced.insert(t, Produced::Left(self.ident(cur_to.as_ref())));
                    } else {
                        self.report(e, "conflict: renamed offline, but gone from the source");
                        produced.insert(f, Produced::Conflicted);
                        produced.insert(t, Produced::Conflicted);
                    }
                    return Ok(());
                }
                if !self.base_holds(*base_from, cur_from.as_ref(), &f, produced) {
                    self.report(
                        e,
                        "conflict: renamed offline, but changed on the source meanwhile; not \
                         renamed, and later offline changes to the new name go to conflict copies",
                    );
                    produced.insert(f, Produced::Conflicted);
                    produced.insert(t, Produced::Conflicted);
                    return Ok(());
                }
                let to_holds = self.base_holds(*base_to, cur_to.as_ref(), &t, produced);
                let dest = if to_holds {
                    t.clone()
                } else {
                    conflict_path(&t, e)
                };
                log.begin(e.seq)?;
                let flags = if to_holds && cur_to.is_some() {
                    0
                } else {
                    libc::RENAME_NOREPLACE
                };
                let (q, d) = (f.clone(), dest.clone());
                self.source.call_anyway(move |r| rename(r, &q, &d, flags))?;
                produced.insert(f, Produced::Left(None));
                if to_holds {
                    let after = self.current(&t)?;
                    produced.insert(t, Produced::Left(self.ident(after.as_ref())));
                } else {
                    self.report(
                        e,
                        &format!(
                            "conflict: the rename's target changed on the source meanwhile; \
                             the source's is kept, the renamed file is at {}",
                            dest.display()
                        ),
                    );
                    produced.insert(t, Produced::Conflicted);
                }
                Ok(())
            }
            Op::SetAttr {
                path,
                base,
                mode,
                atime,
                mtime,
            } => {
                let p = crate::oplog::path(path);
                let cur = self.current(&p)?;
                let holds = match base {
                    None => cur.is_some(),
                    Some(b) => self.base_holds(*b, cur.as_ref(), &p, produced),
                };
                let already = log.progress().in_flight == Some(e.seq)
                    && cur.as_ref().is_some_and(|s| {
                        mode.is_none_or(|m| s.mode & 0o7777 == m)
                            && mtime.is_none_or(|t| s.mtime == t)
                    });
                if already {
                    // Applied before a crash.
                    if base.is_some() {
                        produced.insert(p, Produced::Left(self.ident(cur.as_ref())));
                    }
                    return Ok(());
                }
                if !holds {
                    self.report(
                        e,
                        "conflict: the mode or times set offline were not applied: the source's \
                         object changed or is gone",
                    );
                    if base.is_some() {
                        produced.insert(p, Produced::Conflicted);
                    }
                    return Ok(());
                }
                let set = SetAttr {
                    mode: *mode,
                    atime: atime.map(|(s, n)| TimeSpec::At(s, n)),
                    mtime: mtime.map(|(s, n)| TimeSpec::At(s, n)),
                    ..Default::default()
                };
                let q = p.clone();
                log.begin(e.seq)?;
                self.source
                    .call_anyway(move |r| r.set_attr(Some(&q), None, &set))?;
                if base.is_some() {
                    let after = self.current(&p)?;
                    produced.insert(p, Produced::Left(self.ident(after.as_ref())));
                }
                Ok(())
            }
        }
    }

    /// Writes `container` to the source as `p`: into a temporary file beside it, synced,
    /// given `mode` and `owner`, then renamed over `p` (`replace`) or to the free name `p`.
    fn upload(
        &self,
        p: &Path,
        seq: u64,
        container: &File,
        mode: u32,
        owner: Option<(u32, u32)>,
        replace: bool,
    ) -> io::Result<()> {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        let tmp = p.with_file_name(format!(".{name}.hoardfs-replay-{seq}"));
        let q = tmp.clone();
        let out = self.source.call_anyway(move |r| {
            match r.unlink(&q) {
                Err(e) if os_errno(&e) != Some(libc::ENOENT) => return Err(e),
                _ => {}
            }
            r.create_file(&q, libc::O_WRONLY | libc::O_EXCL, 0o600)
        })?;
        // Closed through the guard by whoever lets go of it last.
        let out = Arc::new(crate::health::SourceFile::new(self.source.clone(), out));
        let src = container;
        let mut off = 0u64;
        loop {
            let mut buf = vec![0u8; COPY_PIECE];
            let n = crate::source::read_full(src, &mut buf, off)?;
            if n == 0 {
                break;
            }
            buf.truncate(n);
            let o = out.clone();
            self.source
                .call_anyway(move |_| o.write_all_at(&buf, off))?;
            off += n as u64;
        }
        let root = rustix::process::geteuid().is_root();
        let o = out.clone();
        self.source.call_anyway(move |_| {
            o.sync_all()?;
            if let Some((uid, gid)) = owner.filter(|_| root) {
                rustix::fs::fchown(
                    &**o,
                    Some(rustix::fs::Uid::from_raw(uid)),
                    Some(rustix::fs::Gid::from_raw(gid)),
                )?;
            }
            // After chown, which clears set-id bits.
            if unsafe { libc::fchmod(o.as_raw_fd(), mode & 0o7777) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        })?;
        let (q, d) = (tmp.clone(), p.to_path_buf());
        let flags = if replace { 0 } else { libc::RENAME_NOREPLACE };
        let r = self.source.call_anyway(move |r| rename(r, &q, &d, flags));
        if r.is_err() {
            let q = tmp.clone();
            let _ = self.source.call_anyway(move |r| r.unlink(&q));
        }
        r
    }

    /// Whether the source file `p` holds exactly the bytes of `container`.
    fn same_content(&self, p: &Path, container: &File) -> io::Result<bool> {
        let mine = container;
        let q = p.to_path_buf();
        let theirs = match self
            .source
            .call_anyway(move |r| r.open_file(&q, libc::O_RDONLY))
        {
            Ok(f) => Arc::new(f),
            Err(e) if matches!(os_errno(&e), Some(libc::ENOENT | libc::ENOTDIR)) => {
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        if theirs.metadata()?.len() != mine.metadata()?.len() {
            return Ok(false);
        }
        let mut off = 0u64;
        loop {
            let mut a = vec![0u8; COPY_PIECE];
            let n = crate::source::read_full(mine, &mut a, off)?;
            if n == 0 {
                return Ok(true);
            }
            a.truncate(n);
            let t = theirs.clone();
            let b = self.source.call_anyway(move |_| {
                let mut b = vec![0u8; n];
                let got = crate::source::read_full(&t, &mut b, off)?;
                b.truncate(got);
                Ok(b)
            })?;
            if a != b {
                return Ok(false);
            }
            off += n as u64;
        }
    }

    /// After a Store reached the source: the cache keeps the file if it holds exactly
    /// what was sent (its record then vouches for the source's new version), else drops
    /// it. Files open through the mount are revalidated when the mount goes online.
    fn settle_cache(&self, p: &Path, container: &File, after: Option<&Stat>) {
        let Some(after) = after else { return };
        let open = self
            .loaded
            .lock()
            .unwrap()
            .values()
            .any(|i| i.path().as_deref() == Some(p));
        if open {
            return;
        }
        let Some(files) = self.cache.open_existing(p) else {
            return;
        };
        let same = (|| -> io::Result<bool> {
            let sent = container;
            let len = sent.metadata()?.len();
            if len != after.size || files.data.metadata()?.len() != len {
                return Ok(false);
            }
            // Piece by piece: a file can be larger than memory.
            let (mut a, mut b) = (vec![0u8; COPY_PIECE], vec![0u8; COPY_PIECE]);
            let mut off = 0;
            while off < len {
                let n = crate::source::read_full(sent, &mut a, off)?;
                if n == 0
                    || crate::source::read_full(&files.data, &mut b[..n], off)? != n
                    || a[..n] != b[..n]
                {
                    return Ok(false);
                }
                off += n as u64;
            }
            Ok(true)
        })();
        let kept = matches!(same, Ok(true))
            && closed::restamp(&files, true, |rec| {
                if !rec.dirty {
                    rec.identity = self.recorded_identity(after);
                }
                !rec.dirty
            })
            .unwrap_or(false);
        if !kept {
            let _ = self.uncache(p);
        }
    }
}

/// `rename`, where `RENAME_NOREPLACE` also works on sources without `renameat2` flags
/// (FUSE sources such as sshfs and bindfs answer `EINVAL`): there a hard link stands in
/// (it never replaces), or, where links are not supported either, a check just before.
fn rename(r: &dyn crate::source::SourceTree, from: &Path, to: &Path, flags: u32) -> io::Result<()> {
    match r.rename(from, to, flags) {
        Err(e) if flags == libc::RENAME_NOREPLACE && os_errno(&e) == Some(libc::EINVAL) => {
            match r.link(from, to) {
                Ok(()) => r.unlink(from),
                Err(e) if os_errno(&e) == Some(libc::EEXIST) => Err(e),
                Err(_) => match r.stat(to) {
                    Ok(_) => Err(io::Error::from_raw_os_error(libc::EEXIST)),
                    Err(_) => r.rename(from, to, 0),
                },
            }
        }
        r => r,
    }
}

//! Reintegration: on reconnection, the log replayed in order with its progress recorded,
//! conflicts and failed changes reported, and the checks of a change's base version.

use std::collections::{BTreeSet, HashMap};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;

use super::{now_secs, os_errno, parent_of, stamp};
use crate::fs::CachingFs;
use crate::health::ReconnectError;
use crate::oplog::{Base, Entry, Ident, Op, OpLog, Produced};
use crate::source::Stat;

impl CachingFs {
    /// The source answers: replays the offline log (if any) and goes online. Refused while
    /// files written offline are still open.
    pub fn reconnect(&self, manual: bool) -> std::result::Result<(), ReconnectError> {
        let mut log = self.oplog.lock().unwrap();
        if log.is_empty() {
            drop(log);
            self.source.health.go_online(manual);
            return Ok(());
        }
        let writers = self.offline_writers.load(Relaxed);
        if writers > 0 {
            return Err(ReconnectError::WritersOpen(writers));
        }
        let dirs = self.replay(&mut log)?;
        drop(log);
        self.source.health.go_online(manual);
        // The listings edited offline are replaced by the source's own.
        for dir in dirs {
            self.listing_changed(&dir);
            if let Ok(entries) = self.source.read_dir(&dir) {
                self.save_listing(&dir, &entries);
            }
        }
        Ok(())
    }

    /// Replays every pending entry in order; returns the directories it changed.
    fn replay(&self, log: &mut OpLog) -> std::result::Result<BTreeSet<PathBuf>, ReconnectError> {
        let mut produced = log.produced_map();
        let mut dirs = BTreeSet::new();
        tracing::info!(
            "replaying {} offline change(s) to the source",
            log.pending().len()
        );
        while let Some(e) = log.pending().first().cloned() {
            if let Some(p) = superseded(log.pending()) {
                // Coda's log optimisation: only the last of a run of stores is sent; the
                // first one's base is checked then.
                if let Op::Store { base, .. } = &e.op
                    && *base != Base::Chained
                {
                    produced.insert(p, Produced::Carried(*base));
                }
                self.record_replayed(log, e.seq, &produced)?;
                continue;
            }
            match self.replay_one(&e, log, &mut produced) {
                Ok(()) => failpoint_after_replay(),
                Err(err) if crate::source::may_mean_unreachable(&err) => {
                    return Err(ReconnectError::ReplayStopped {
                        seq: e.seq,
                        source: err,
                    });
                }
                Err(err) => {
                    if let Op::Store { path, .. } = &e.op {
                        let kept = self.keep_aside(&e, log);
                        self.report(
                            &e,
                            &format!(
                                "could not be written to {:?} ({err}); the content is kept at {}",
                                crate::oplog::path(path),
                                kept
                            ),
                        );
                    } else {
                        self.report(&e, &format!("could not be applied: {err}"));
                    }
                    for p in e.op.paths() {
                        produced.insert(p, Produced::Conflicted);
                    }
                }
            }
            for p in e.op.paths() {
                if matches!(e.op, Op::Mkdir { .. }) {
                    dirs.insert(p.clone());
                }
                dirs.insert(parent_of(&p));
            }
            self.record_replayed(log, e.seq, &produced)?;
        }
        Ok(dirs)
    }

    /// Entry `seq` is done: its progress is durable and counted.
    fn record_replayed(
        &self,
        log: &mut OpLog,
        seq: u64,
        produced: &HashMap<PathBuf, Produced>,
    ) -> std::result::Result<(), ReconnectError> {
        log.applied(seq, produced)
            .map_err(ReconnectError::Progress)?;
        self.source.health.log_replayed.fetch_add(1, Relaxed);
        self.note_pending(log);
        Ok(())
    }

    /// Publishes how many logged changes wait (`hoardfs stats`, metrics).
    pub(super) fn note_pending(&self, log: &OpLog) {
        self.source
            .health
            .log_pending
            .store(log.pending().len() as u64, Relaxed);
    }

    /// Copies a Store's content that fits nowhere in the source into the cache's
    /// `lost+found/`; returns where.
    fn keep_aside(&self, e: &Entry, log: &OpLog) -> String {
        let name = e.op.paths()[0]
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        let name = format!("{}-{name}", e.seq);
        let r = (|| -> io::Result<()> {
            let dir = self.cache.private_dir("lost+found")?;
            let mut from = log.open_container(e.seq)?;
            let mut to = crate::cache::store::private_file(
                &dir,
                Path::new(&name),
                rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::TRUNC,
                true,
            )?;
            io::copy(&mut from, &mut to)?;
            to.sync_all()
        })();
        match r {
            Ok(()) => self
                .cache
                .root()
                .join("lost+found")
                .join(name)
                .display()
                .to_string(),
            Err(err) => format!("(nowhere: {err})"),
        }
    }

    /// Reports a conflict or failed change: the log, `<cache>/conflicts.log`, the counter.
    pub(super) fn report(&self, e: &Entry, what: &str) {
        let paths: Vec<String> =
            e.op.paths()
                .iter()
                .map(|p| p.display().to_string())
                .collect();
        let line = format!(
            "{} offline change {} made {} to {}: {what}\n",
            stamp(now_secs()),
            e.seq,
            stamp(e.at),
            paths.join(" -> ")
        );
        tracing::warn!("{}", line.trim_end());
        self.source.health.conflicts.fetch_add(1, Relaxed);
        let r = crate::cache::store::private_file(
            self.cache.top(),
            Path::new("conflicts.log"),
            rustix::fs::OFlags::WRONLY | rustix::fs::OFlags::APPEND,
            true,
        )
        .and_then(|mut f| f.write_all(line.as_bytes()).and_then(|_| f.sync_data()));
        if let Err(err) = r {
            tracing::warn!("cannot write conflicts.log: {err}");
        }
    }

    pub(super) fn current(&self, p: &Path) -> io::Result<Option<Stat>> {
        let p = p.to_path_buf();
        self.source.call_anyway(move |r| match r.stat(&p) {
            Ok(st) => Ok(Some(st)),
            Err(e) if matches!(os_errno(&e), Some(libc::ENOENT | libc::ENOTDIR)) => Ok(None),
            Err(e) => Err(e),
        })
    }

    pub(super) fn ident(&self, st: Option<&Stat>) -> Option<Ident> {
        st.map(|s| Ident::from(self.identity(s)))
    }

    /// Whether the source's `cur` at `p` is the version a change with `base` was made to.
    pub(super) fn base_holds(
        &self,
        base: Base,
        cur: Option<&Stat>,
        p: &Path,
        produced: &HashMap<PathBuf, Produced>,
    ) -> bool {
        let now = self.ident(cur);
        match base {
            Base::Source(id) => now == Some(id),
            Base::Absent => now.is_none(),
            Base::Chained => match produced.get(p) {
                Some(Produced::Left(x)) => *x == now,
                Some(Produced::Carried(b)) if *b != Base::Chained => {
                    self.base_holds(*b, cur, p, produced)
                }
                _ => false,
            },
        }
    }
}

/// The path of `pending[0]` if it is a Store that a later Store of the same path replaces
/// with nothing else touching that path in between.
fn superseded(pending: &[Entry]) -> Option<PathBuf> {
    let Op::Store { path, .. } = &pending.first()?.op else {
        return None;
    };
    let p = crate::oplog::path(path);
    let next = pending[1..].iter().find(|e| e.op.paths().contains(&p))?;
    matches!(&next.op, Op::Store { path: q, base: Base::Chained, .. } if *q == *path).then_some(p)
}

/// Test failpoint: with `HOARDFS_FAILPOINT_REPLAY_ABORT=N`, the daemon aborts right after
/// the N-th change it replays has reached the source and before that is recorded: the
/// worst instant for a crash (tests/offline.rs).
fn failpoint_after_replay() {
    use std::sync::atomic::AtomicU64;
    static DONE: AtomicU64 = AtomicU64::new(0);
    let Some(n) = std::env::var("HOARDFS_FAILPOINT_REPLAY_ABORT")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    else {
        return;
    };
    if DONE.fetch_add(1, Relaxed) + 1 == n {
        tracing::error!("failpoint: aborting after replayed change {n}");
        std::process::abort();
    }
}

//! What the control socket (`crate::control`) asks of a running mount: the statistics
//! snapshot, live settings (`hoardfs set`), pins and a clean now.

use std::path::Path;
use std::sync::atomic::Ordering;

use super::CachingFs;
use crate::cleaner::Limits;
use crate::control::ControlError;
use crate::inode::InodeLimits;
use crate::stats::Snapshot;

impl CachingFs {
    /// Changes a setting of the running mount (`hoardfs set`, parsed by the option table).
    /// `None` (`auto`) restores the default as the mount computes it at start.
    pub fn set(&self, setting: crate::options::Live) -> std::result::Result<(), ControlError> {
        use crate::options::Live;
        use std::sync::atomic::Ordering::Relaxed;
        let (ttls, tun) = (&self.coherence.tunables, &self.fetcher.tun);
        // The cache's limits as the mount computes them without `--cache-size` and
        // `--min-free` (their `auto`).
        let computed = || {
            let mut cfg = self.cfg.clone();
            (cfg.cache_size, cfg.min_free) = (None, None);
            Self::initial_limits(&cfg).map_err(ControlError::NoDefault)
        };
        let cache_limits = |change: &dyn Fn(&mut Limits)| {
            let mut l = self.usage.limits().ok_or(ControlError::NoCacheLimits)?;
            change(&mut l);
            if l.low_pct >= l.high_pct {
                return Err(ControlError::Invalid(
                    "low_watermark must be below high_watermark".into(),
                ));
            }
            self.usage.set_limits(Some(l));
            Ok(())
        };
        let mut inodes = self.inodes.limits();
        let inode_defaults = InodeLimits::new(inodes.max_inodes);
        match setting {
            Live::EntryTtl(t) => ttls.set_entry(t),
            Live::AttrTtl(t) => ttls.set_attr(t),
            Live::NegativeTtl(t) => ttls.set_negative(t),
            Live::StaleCheck(on) => ttls.stale_check.store(on, Relaxed),
            Live::CloseToOpen(on) => ttls.close_to_open.store(on, Relaxed),
            Live::OpenLease(t) => ttls.set_open_lease(t),
            Live::Watch(on) => ttls.watch.store(on, Relaxed),
            Live::SourceTimeout(t) => {
                let t = crate::health::timeout_for(t, self.caps(), self.source.is_remote());
                self.source.health.set_timeout(t)
            }
            Live::Online(true) => return Ok(self.reconnect(true)?),
            Live::Online(false) => self.source.health.go_offline("switched off by hand", true),
            Live::FetchWindow(v) => tun.window.store(v, Relaxed),
            Live::FetchInflight(v) => tun.inflight.store(v, Relaxed),
            Live::FetchFds(v) => tun.fds.store(v, Relaxed),
            Live::FetchDirPrefetch(v) => tun.dir_prefetch.store(v, Relaxed),
            Live::CacheSize(v) => {
                let v = v.map_or_else(|| computed().map(|d| d.max_bytes), Ok)?;
                cache_limits(&|l| l.max_bytes = v)?
            }
            Live::MinFree(v) => {
                let v = v.map_or_else(|| computed().map(|d| d.min_free_bytes), Ok)?;
                cache_limits(&|l| l.min_free_bytes = v)?
            }
            Live::HighWatermark(p) => cache_limits(&|l| l.high_pct = p)?,
            Live::LowWatermark(p) => cache_limits(&|l| l.low_pct = p)?,
            Live::MaxInodes(n) => inodes.max_inodes = n.max(1),
            Live::InodeFreeMin(n) => inodes.free_min = n.unwrap_or(inode_defaults.free_min),
            Live::InodeMinAge(t) => inodes.min_age = t.unwrap_or(inode_defaults.min_age),
            Live::InodeMaxAge(t) => inodes.max_age = t.unwrap_or(inode_defaults.max_age),
            Live::InodeFreeing(on) => inodes.freeing = on,
            Live::Log(_) => {
                return Err(ControlError::Invalid(
                    "log: the control socket sets the log filter".into(),
                ));
            }
        }
        if inodes != self.inodes.limits() {
            self.inodes.set_limits(inodes);
        }
        Ok(())
    }

    /// Pins or unpins a path (relative to the mount) so the cleaner never evicts it.
    pub fn pin(&self, rel: &Path, on: bool) -> std::result::Result<(), ControlError> {
        crate::source::check_relative(rel)
            .map_err(|_| ControlError::NotInMount(rel.to_path_buf()))?;
        if on {
            self.source.stat(rel).map_err(|source| ControlError::Stat {
                path: rel.to_path_buf(),
                source,
            })?;
        }
        self.pins.set(rel, on).map_err(ControlError::SavePins)
    }

    /// Runs a clean now, down to `to` bytes or the low watermark.
    pub fn clean(&self, to: Option<u64>) -> u64 {
        // Asked for by a person: down to the low watermark even if below the high one.
        let to = to.or(self.usage.limits().map(|l| l.low()));
        crate::cleaner::clean_once(&self.cache.trees(), &self.pins, &self.usage, to, self)
    }

    pub fn snapshot(&self) -> Snapshot {
        let (cache_bytes, cache_files) = (
            self.usage.bytes.load(Ordering::Relaxed),
            self.usage.files.load(Ordering::Relaxed),
        );
        Snapshot {
            mountpoint: self.cfg.mountpoint.display().to_string(),
            source: self.cfg.source.display().to_string(),
            cache_dir: self.cfg.cache_dir.display().to_string(),
            requests: self.stats.requests(),
            errors: self.stats.error_table(),
            cache: self.stats.cache_snapshot(),
            inodes: self.inodes.len() as u64,
            inode_table: self.inodes.snapshot(),
            open_handles: self.handles.lock().unwrap().len() as u64,
            cache_bytes,
            cache_files,
            cleaner: self.usage.snapshot(),
            coherence: self.coherence.snapshot(),
            health: self.source.health.snapshot(),
        }
    }
}

impl crate::control::Handler for CachingFs {
    fn stats(&self) -> Snapshot {
        self.snapshot()
    }

    fn set(&self, setting: crate::options::Live) -> std::result::Result<(), ControlError> {
        CachingFs::set(self, setting)
    }

    fn clean(&self, to: Option<u64>) -> u64 {
        CachingFs::clean(self, to)
    }

    fn pin(&self, rel: &Path, on: bool) -> std::result::Result<(), ControlError> {
        CachingFs::pin(self, rel, on)
    }
}

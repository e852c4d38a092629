//! The table's free list and recency list: releasing entries, freeing the excess in batches
//! and by age, the lazy queues' and the name index's compaction, and the periodic `maintain`.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::{BATCH, Inner, InodeTable, MAX_PER_CALL};

/// After this many frees the periodic pass hands freed heap memory back to the system.
const MALLOC_TRIM_FREES: u64 = 64 * 1024;
/// Freed keys remembered to count lookups that would have reused a freed entry (the paper's
/// "hits rejected by age").
const GHOSTS: usize = 16 * 1024;

impl<F> Inner<F> {
    fn stamp(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    pub(super) fn referenced(&self) -> usize {
        self.by_id.len() - self.free_len
    }

    /// Puts `id` (count above zero) at the recent end of the recency queue.
    pub(super) fn touch(&mut self, id: u64) {
        let stamp = self.stamp();
        if let Some(e) = self.by_id.get_mut(&id) {
            e.stamp = stamp;
        }
        self.recent.push_back((id, stamp));
        if self.recent.len() > 2 * self.referenced() + 1024 {
            let by_id = &self.by_id;
            self.recent
                .retain(|(id, s)| by_id.get(id).is_some_and(|e| e.count > 0 && e.stamp == *s));
        }
    }

    /// The count of `id` dropped to zero: onto the tail of the free list.
    pub(super) fn release(&mut self, id: u64, now: u64) {
        let stamp = self.stamp();
        let Some(e) = self.by_id.get_mut(&id) else {
            return;
        };
        e.stamp = stamp;
        e.freed_at = now;
        self.free_q.push_back((id, stamp));
        self.free_len += 1;
        if self.free_q.len() > 2 * self.free_len + 1024 {
            let by_id = &self.by_id;
            self.free_q
                .retain(|(id, s)| by_id.get(id).is_some_and(|e| e.count == 0 && e.stamp == *s));
        }
    }

    /// Rebuilds the name index from the entries' names once it holds more than twice as
    /// many names as they do (stale names of renamed, unlinked and freed entries).
    fn compact_index(&mut self) {
        let names: usize = self
            .by_id
            .values()
            .map(|e| e.inode.names.lock().unwrap().len())
            .sum();
        if self.index.lock().unwrap().len() > 2 * names + 1024 {
            self.rebuild_index(names);
        }
    }

    /// Makes the name index hold exactly the entries' `names` names.
    pub(super) fn rebuild_index(&mut self, names: usize) {
        let mut index = self.index.lock().unwrap();
        let mut fresh: HashMap<PathBuf, Vec<u64>> = HashMap::with_capacity(names);
        for e in self.by_id.values() {
            for n in e.inode.names.lock().unwrap().iter() {
                fresh.entry(n.clone()).or_default().push(e.inode.id);
            }
        }
        *index = fresh;
    }

    pub(super) fn remove(&mut self, id: u64) {
        let Some(e) = self.by_id.remove(&id) else {
            return;
        };
        if e.count == 0 {
            self.free_len -= 1;
        }
        let key = e.inode.key;
        if self.by_key.get(&key) == Some(&id) {
            self.by_key.remove(&key);
            let stamp = self.stamp();
            self.ghost_q.push_back((key, stamp));
            self.ghosts.insert(key, stamp);
            if self.ghost_q.len() > GHOSTS
                && let Some((k, s)) = self.ghost_q.pop_front()
                && self.ghosts.get(&k) == Some(&s)
            {
                self.ghosts.remove(&k);
            }
        }
        self.n.frees += 1;
        if self.by_id.len() * 4 < self.by_id.capacity() && self.by_id.capacity() > 4096 {
            self.by_id.shrink_to_fit();
            self.by_key.shrink_to_fit();
            self.free_q.shrink_to_fit();
            self.recent.shrink_to_fit();
        }
    }

    /// Frees entries from the head of the free list while they are in excess, at most
    /// `budget` of them. Returns how many were freed.
    pub(super) fn trim(&mut self, now: u64, budget: usize) -> usize {
        if !self.limits.freeing {
            return 0;
        }
        let (min_age, max_age) = (
            self.limits.min_age.as_millis() as u64,
            self.limits.max_age.as_millis() as u64,
        );
        let mut freed = 0;
        let mut skipped = 0;
        while freed < budget
            && let Some(&(id, stamp)) = self.free_q.front()
        {
            let Some(e) = self
                .by_id
                .get(&id)
                .filter(|e| e.count == 0 && e.stamp == stamp)
            else {
                self.free_q.pop_front();
                continue;
            };
            let age = now.saturating_sub(e.freed_at);
            let excess = age >= max_age
                || self.by_id.len() > self.limits.max_inodes
                || (self.free_len > self.limits.free_min && age >= min_age);
            if !excess {
                break;
            }
            // A cache state still loaded (fetches in flight after the last close, or a
            // prefetch of a file the kernel never looked up) keeps its entry: freed, a new
            // entry for the same file would load a second state over the same cache files.
            // Back to the tail, and the loop ends once every free entry was looked at
            // (or the budget is spent): going round again would only meet them again.
            let loaded = match e.inode.file.try_lock() {
                Ok(g) => g.is_some(),
                Err(_) => true,
            };
            self.free_q.pop_front();
            if loaded {
                skipped += 1;
                let stamp = self.stamp();
                if let Some(e) = self.by_id.get_mut(&id) {
                    e.stamp = stamp;
                    e.freed_at = now;
                }
                self.free_q.push_back((id, stamp));
                if skipped >= self.free_len.min(budget) {
                    break;
                }
                continue;
            }
            self.remove(id);
            freed += 1;
        }
        freed
    }

    /// Whether enough has accumulated for a batch of frees.
    pub(super) fn trim_due(&self) -> bool {
        self.limits.freeing
            && (self.free_len >= self.limits.free_min + BATCH
                || self.by_id.len() >= self.limits.max_inodes + BATCH)
    }
}

impl<F> InodeTable<F> {
    /// Periodic work, run off the request threads: frees free entries past their age, and
    /// when the kernel references more than `max_inodes` entries, returns `(parent, name)`
    /// of the least recently looked-up ones for the kernel to drop (down to 15/16 of the
    /// maximum, at most `MAX_PER_CALL` per call). Entries of open files are skipped.
    pub fn maintain(&self) -> Vec<(u64, OsString)> {
        let now = self.now();
        let mut guard = self.inner.lock().unwrap();
        let inner = &mut *guard;
        inner.trim(now, MAX_PER_CALL);
        inner.compact_index();
        // Every 64Ki frees during a mass free, and once it is over (no free since the
        // previous call): what the last ones freed would stay with the allocator else.
        let frees = inner.n.frees;
        let quiet = frees == inner.n.frees_at_maintain;
        inner.n.frees_at_maintain = frees;
        if frees >= inner.n.frees_at_trim + MALLOC_TRIM_FREES
            || (quiet && frees > inner.n.frees_at_trim)
        {
            inner.n.frees_at_trim = frees;
            drop(guard);
            // Entries are small allocations that the allocator keeps after a mass free
            // (drop_caches after a walk): give them back, off the table lock.
            #[cfg(target_env = "gnu")]
            unsafe {
                libc::malloc_trim(0);
            }
            guard = self.inner.lock().unwrap();
        }
        let inner = &mut *guard;
        let max = inner.limits.max_inodes;
        if !inner.limits.freeing || inner.referenced() <= max {
            return Vec::new();
        }
        let want = (inner.referenced() - (max - max / 16)).min(MAX_PER_CALL);
        let mut out = Vec::with_capacity(want);
        let mut seen = 0;
        // Each referenced entry has one valid item; stop after one pass over them.
        let limit = inner.referenced();
        while out.len() < want
            && seen < limit
            && let Some((id, stamp)) = inner.recent.pop_front()
        {
            let Some(e) = inner
                .by_id
                .get(&id)
                .filter(|e| e.count > 0 && e.stamp == stamp)
            else {
                continue;
            };
            seen += 1;
            let inode = e.inode.clone();
            // Back of the queue: if the kernel keeps it (in use), it is not asked again soon.
            inner.touch(id);
            let open = match inode.file.try_lock() {
                Ok(f) => f.is_some(),
                Err(_) => true,
            };
            if open {
                continue;
            }
            if let Some(name) = inode.path().as_deref().and_then(Path::file_name) {
                out.push((inode.parent(), name.to_os_string()));
            }
        }
        inner.n.invalidations += out.len() as u64;
        out
    }
}

//! Cache files changed behind hoardfs's back while a file is loaded (edited or replaced
//! in the cache directory): found before a record vouches for them, and discarded.

use std::os::fd::AsFd;

use super::{CacheRecord, Env, FileState, Stats, write_record};
use crate::cache::record::DataIdentity;
use crate::source::fstat;

impl FileState {
    /// Whether the data file is as hoardfs itself last left it (`FileFetch::own`); true
    /// where that is not known. A record may only vouch for data hoardfs wrote: call this
    /// before stamping a record that claims chunks.
    pub(in crate::fs) fn data_is_ours(&self) -> bool {
        let Some(files) = &self.files else {
            return true;
        };
        let ff = &self.fetch;
        let now = ff.quiet(|| fstat(files.data.as_fd()));
        match (ff.own(), now) {
            // A data file no name leads to any more (unlinked or replaced, by us or not) is
            // never loaded again, whatever its record says.
            // A ctime earlier than the one noted is not someone else's later change: this
            // kernel's ctimes of one file need not be in order (a coarse-grained update can
            // stamp an earlier time than a fine-grained one our note read), which concurrent
            // piece writes showed.
            (Some(own), Ok(st)) => {
                let now = DataIdentity::of(&st);
                st.nlink == 0 || (own.ino == now.ino && now.ctime <= own.ctime)
            }
            _ => true,
        }
    }

    /// Whether the data file or the record has no name any more: removed from the cache
    /// directory, or replaced there (by a new version's entry, or behind hoardfs's back).
    pub(in crate::fs) fn files_unlinked(&self) -> bool {
        self.files.as_ref().is_some_and(|files| {
            let data = self.fetch.quiet(|| fstat(files.data.as_fd()));
            data.is_ok_and(|st| st.nlink == 0)
                || fstat(files.meta.as_fd()).is_ok_and(|st| st.nlink == 0)
        })
    }

    /// The data file was changed behind hoardfs's back while the file was loaded (edited
    /// in the cache directory): nothing of it is vouched for any more. The record is
    /// emptied (durably), so every chunk is fetched again; nothing is stamped as valid.
    pub(in crate::fs) fn discard_foreign_data(&mut self, env: &Env) {
        let now = self
            .files
            .as_ref()
            .and_then(|f| fstat(f.data.as_fd()).ok())
            .map(|st| DataIdentity::of(&st));
        tracing::warn!(
            own = ?self.fetch.own(),
            ?now,
            "a cache data file was changed behind hoardfs's back; refetching it"
        );
        Stats::add(&env.stats.corrupt_records, 1);
        self.fetch.invalidate();
        self.record = CacheRecord::empty(self.record.identity, self.record.chunk_size);
        self.nothing_to_commit();
        if let Some(files) = &self.files {
            // A data file of another length than the file's (extended or cut behind our
            // back) would serve the difference through passthrough once refetched, and
            // is never resized in place (crash rule 3: others may read it): this state
            // stops using it, and the next load replaces it (its length is checked).
            // Nor is one refetched into while the kernel reads it for passthrough
            // handles: a chunk fetched anew, of another version on a source whose
            // timestamps cannot tell, would change bytes under readers that hold theirs.
            let size = self.record.identity.size;
            let r = write_record(files, &self.record, true);
            let wrong_length = files.data.metadata().map_or(true, |m| m.len() != size);
            match r {
                Ok(_) if wrong_length || self.passthrough_opens > 0 => self.files = None,
                // The empty record vouches for nothing; from here the file is hoardfs's.
                Ok(_) => self.fetch.set_own(
                    fstat(files.data.as_fd())
                        .ok()
                        .map(|st| DataIdentity::of(&st)),
                ),
                Err(_) => self.files = None,
            }
        }
    }
}

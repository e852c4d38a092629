//! The fill behind a source read (`fs/source_reads.rs`): a fetch worker goes through the
//! chunks a closed source read left absent, in order, copying each that the source holds
//! wholly in memory.

use super::{Ctx, Got};
use crate::fetch::End;
use crate::fetch_pool::BehindJob;
use crate::fs::{CachingFs, Inode};
use crate::stats::Stats;

impl CachingFs {
    pub(in crate::fs) fn run_behind_job(&self, job: &BehindJob<Inode>) {
        let ctx = Ctx {
            inode: &job.inode,
            ff: &job.ff,
            src: &job.src,
        };
        let mut waited = false;
        for (k, f) in job.flights.iter().enumerate() {
            // A chunk not in memory ends its flight (aborted) and the next is tried; a
            // change of the content or a failing source ends the job.
            let got = if job.ff.epoch() == f.epoch && self.online() {
                self.work(&ctx, f, 0..f.npieces(), false, &mut waited)
            } else {
                Got::Failed
            };
            if matches!(got, Got::Failed) {
                let left = (job.flights.len() - k) as u64;
                Stats::add(&self.stats.cache.chunks_left_behind, left);
                let mut guard = job.inode.file();
                for f in &job.flights[k..] {
                    job.ff.remove(f);
                    f.finish(End::Aborted);
                }
                self.unload_if_idle(&job.inode, &mut guard);
                return;
            }
            let c = &self.stats.cache;
            match f.end() {
                End::Complete => Stats::add(&c.chunks_filled_behind, 1),
                End::Running => {} // a reader works on it
                _ => Stats::add(&c.chunks_left_behind, 1),
            }
        }
    }
}

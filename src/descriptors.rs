//! The daemon's budget of open descriptors. Between requests hoardfs keeps descriptors for
//! what it holds: each callback's `O_PATH` descriptor of a file (`coherence::Callback`),
//! each held listing's of a directory (`coherence::ListingCallback`), and the cache files
//! of the states that wait for their group commit (`fs/commit.rs`). A walk over a large
//! tree would otherwise hold one or more per file and directory until the process ran out
//! (`EMFILE`), and then the opens of the walk itself fail. So each kind is held within its
//! share of the process's open-files limit (raised to the hard limit at start,
//! `run::raise_open_files_limit`); beyond it that kind is not held (a file gets no
//! callback and its opens ask the source, a listing is read again at the next opendir, a
//! close checkpoints its file at once) and nothing fails.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

/// The process's open-files limit now (its soft limit); `usize::MAX` if unlimited.
pub fn open_files_limit() -> usize {
    rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX))
}

/// `1/divisor` of the open-files limit.
pub fn share_of_limit(divisor: usize) -> usize {
    open_files_limit() / divisor
}

/// Descriptors of one kind held at once, at most `max`.
#[derive(Debug)]
pub struct HeldDescriptors {
    count: AtomicUsize,
    max: usize,
}

impl HeldDescriptors {
    pub fn new(max: usize) -> Arc<HeldDescriptors> {
        Arc::new(HeldDescriptors {
            count: AtomicUsize::new(0),
            max,
        })
    }

    /// A slot for one more, if the budget has one: given back when dropped.
    pub fn take(self: &Arc<Self>) -> Option<DescriptorSlot> {
        self.count
            .fetch_update(Relaxed, Relaxed, |n| (n < self.max).then_some(n + 1))
            .ok()?;
        Some(DescriptorSlot(self.clone()))
    }

    /// How many are held now.
    pub fn held(&self) -> usize {
        self.count.load(Relaxed)
    }
}

/// One descriptor's place in a `HeldDescriptors` budget, for as long as it is held.
#[derive(Debug)]
pub struct DescriptorSlot(Arc<HeldDescriptors>);

impl Drop for DescriptorSlot {
    fn drop(&mut self) {
        self.0.count.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_given_up_to_the_budget_and_back_when_dropped() {
        let budget = HeldDescriptors::new(2);
        let a = budget.take().unwrap();
        let b = budget.take().unwrap();
        assert!(budget.take().is_none(), "a third slot past a budget of two");
        assert_eq!(budget.held(), 2);
        drop(a);
        assert_eq!(budget.held(), 1);
        let _c = budget.take().expect("a slot given back is taken again");
        drop(b);
        assert_eq!(budget.held(), 1);
    }
}

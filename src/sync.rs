//! The locks and condition variables of the modules whose interleavings are model-checked
//! (`inode`, `fetch`): std's own in every build but the unit tests', so the daemon pays
//! nothing for the checking.
//!
//! In the unit tests each primitive is made either as shuttle's, when it is made inside a
//! shuttle execution (the model checker then decides at every lock, wait and wake-up which
//! thread runs next, `src/inode/model_check.rs`, `src/fetch/model_check.rs`), or as std's
//! anywhere else, so that every other unit test runs on real threads as before. A guard
//! or a wait is of the kind of its lock. Atomics stay std's: shuttle then schedules around
//! them (no switch at an atomic access), which only explores fewer interleavings.

#[cfg(not(test))]
pub use std::sync::{Condvar, Mutex, MutexGuard, RwLock};

#[cfg(test)]
pub use checked::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

#[cfg(test)]
mod checked {
    use std::ops::{Deref, DerefMut};
    use std::sync::{LockResult, PoisonError, TryLockError, TryLockResult};

    /// Whether the caller runs inside a shuttle execution.
    fn in_model() -> bool {
        shuttle::current::try_get_current_task().is_some()
    }

    /// `r` with its guard (or the poisoned one) wrapped by `f`.
    fn wrap<G, W>(r: LockResult<G>, f: fn(G) -> W) -> LockResult<W> {
        match r {
            Ok(g) => Ok(f(g)),
            Err(p) => Err(PoisonError::new(f(p.into_inner()))),
        }
    }

    fn wrap_try<G, W>(r: TryLockResult<G>, f: fn(G) -> W) -> TryLockResult<W> {
        match r {
            Ok(g) => Ok(f(g)),
            Err(TryLockError::Poisoned(p)) => {
                Err(TryLockError::Poisoned(PoisonError::new(f(p.into_inner()))))
            }
            Err(TryLockError::WouldBlock) => Err(TryLockError::WouldBlock),
        }
    }

    #[derive(Debug)]
    pub enum Mutex<T> {
        Std(std::sync::Mutex<T>),
        Model(shuttle::sync::Mutex<T>),
    }

    #[derive(Debug)]
    pub enum MutexGuard<'a, T> {
        Std(std::sync::MutexGuard<'a, T>),
        Model(shuttle::sync::MutexGuard<'a, T>),
    }

    impl<T> Mutex<T> {
        pub fn new(value: T) -> Mutex<T> {
            if in_model() {
                Mutex::Model(shuttle::sync::Mutex::new(value))
            } else {
                Mutex::Std(std::sync::Mutex::new(value))
            }
        }

        pub fn lock(&self) -> LockResult<MutexGuard<'_, T>> {
            match self {
                Mutex::Std(m) => wrap(m.lock(), MutexGuard::Std),
                Mutex::Model(m) => wrap(m.lock(), MutexGuard::Model),
            }
        }

        pub fn try_lock(&self) -> TryLockResult<MutexGuard<'_, T>> {
            match self {
                Mutex::Std(m) => wrap_try(m.try_lock(), MutexGuard::Std),
                Mutex::Model(m) => wrap_try(m.try_lock(), MutexGuard::Model),
            }
        }

        pub fn get_mut(&mut self) -> LockResult<&mut T> {
            match self {
                Mutex::Std(m) => m.get_mut(),
                Mutex::Model(m) => m.get_mut(),
            }
        }

        pub fn into_inner(self) -> LockResult<T> {
            match self {
                Mutex::Std(m) => m.into_inner(),
                Mutex::Model(m) => m.into_inner(),
            }
        }
    }

    impl<T: Default> Default for Mutex<T> {
        fn default() -> Mutex<T> {
            Mutex::new(T::default())
        }
    }

    impl<T> Deref for MutexGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            match self {
                MutexGuard::Std(g) => g,
                MutexGuard::Model(g) => g,
            }
        }
    }

    impl<T> DerefMut for MutexGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            match self {
                MutexGuard::Std(g) => &mut *g,
                MutexGuard::Model(g) => &mut *g,
            }
        }
    }

    #[derive(Debug)]
    pub enum Condvar {
        Std(std::sync::Condvar),
        Model(shuttle::sync::Condvar),
    }

    impl Condvar {
        pub fn new() -> Condvar {
            if in_model() {
                Condvar::Model(shuttle::sync::Condvar::new())
            } else {
                Condvar::Std(std::sync::Condvar::new())
            }
        }

        pub fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> LockResult<MutexGuard<'a, T>> {
            match (self, guard) {
                (Condvar::Std(c), MutexGuard::Std(g)) => wrap(c.wait(g), MutexGuard::Std),
                (Condvar::Model(c), MutexGuard::Model(g)) => wrap(c.wait(g), MutexGuard::Model),
                _ => panic!(
                    "a condition variable and a mutex made on different sides of a model run"
                ),
            }
        }

        pub fn notify_one(&self) {
            match self {
                Condvar::Std(c) => c.notify_one(),
                Condvar::Model(c) => c.notify_one(),
            }
        }

        pub fn notify_all(&self) {
            match self {
                Condvar::Std(c) => c.notify_all(),
                Condvar::Model(c) => c.notify_all(),
            }
        }
    }

    impl Default for Condvar {
        fn default() -> Condvar {
            Condvar::new()
        }
    }

    #[derive(Debug)]
    pub enum RwLock<T> {
        Std(std::sync::RwLock<T>),
        Model(shuttle::sync::RwLock<T>),
    }

    #[derive(Debug)]
    pub enum RwLockReadGuard<'a, T> {
        Std(std::sync::RwLockReadGuard<'a, T>),
        Model(shuttle::sync::RwLockReadGuard<'a, T>),
    }

    #[derive(Debug)]
    pub enum RwLockWriteGuard<'a, T> {
        Std(std::sync::RwLockWriteGuard<'a, T>),
        Model(shuttle::sync::RwLockWriteGuard<'a, T>),
    }

    impl<T> RwLock<T> {
        pub fn new(value: T) -> RwLock<T> {
            if in_model() {
                RwLock::Model(shuttle::sync::RwLock::new(value))
            } else {
                RwLock::Std(std::sync::RwLock::new(value))
            }
        }

        pub fn read(&self) -> LockResult<RwLockReadGuard<'_, T>> {
            match self {
                RwLock::Std(l) => wrap(l.read(), RwLockReadGuard::Std),
                RwLock::Model(l) => wrap(l.read(), RwLockReadGuard::Model),
            }
        }

        pub fn write(&self) -> LockResult<RwLockWriteGuard<'_, T>> {
            match self {
                RwLock::Std(l) => wrap(l.write(), RwLockWriteGuard::Std),
                RwLock::Model(l) => wrap(l.write(), RwLockWriteGuard::Model),
            }
        }
    }

    impl<T: Default> Default for RwLock<T> {
        fn default() -> RwLock<T> {
            RwLock::new(T::default())
        }
    }

    impl<T> Deref for RwLockReadGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            match self {
                RwLockReadGuard::Std(g) => g,
                RwLockReadGuard::Model(g) => g,
            }
        }
    }

    impl<T> Deref for RwLockWriteGuard<'_, T> {
        type Target = T;
        fn deref(&self) -> &T {
            match self {
                RwLockWriteGuard::Std(g) => g,
                RwLockWriteGuard::Model(g) => g,
            }
        }
    }

    impl<T> DerefMut for RwLockWriteGuard<'_, T> {
        fn deref_mut(&mut self) -> &mut T {
            match self {
                RwLockWriteGuard::Std(g) => &mut *g,
                RwLockWriteGuard::Model(g) => &mut *g,
            }
        }
    }
}

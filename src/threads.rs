//! Threads with owners. Every long-lived thread of the daemon is started through the
//! [`Threads`] group of the component it works for: named, its `JoinHandle` kept, told to
//! end by the group's [`Stop`] signal, and joined at shutdown within a bound (`run.rs`
//! says in which order the groups stop). A thread that does not end in time (stuck in a
//! hung source call) is detached with a log line: the process exits without it.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What runs when a group stops, to wake a thread blocked somewhere its `Stop` cannot
/// reach (an `accept`, a channel).
type Waker = Box<dyn FnOnce() + Send>;

/// A group's stop signal, as its threads see it.
#[derive(Default)]
pub struct Stop {
    stopped: Mutex<bool>,
    cv: Condvar,
    wakers: Mutex<Vec<Waker>>,
}

impl Stop {
    pub fn is_set(&self) -> bool {
        *self.stopped.lock().unwrap()
    }

    /// Sleeps for `d` or until the signal is set; false when it is.
    pub fn sleep(&self, d: Duration) -> bool {
        let guard = self.stopped.lock().unwrap();
        let (guard, _) = self.cv.wait_timeout_while(guard, d, |s| !*s).unwrap();
        !*guard
    }

    fn set(&self) {
        *self.stopped.lock().unwrap() = true;
        self.cv.notify_all();
        let wakers = std::mem::take(&mut *self.wakers.lock().unwrap());
        for w in wakers {
            w();
        }
    }
}

/// The threads one component started, and their stop signal.
pub struct Threads {
    group: &'static str,
    stop: Arc<Stop>,
    handles: Mutex<Vec<JoinHandle<()>>>,
}

impl Threads {
    pub fn new(group: &'static str) -> Threads {
        Threads {
            group,
            stop: Arc::default(),
            handles: Mutex::default(),
        }
    }

    /// The group's stop signal, for code that runs on its threads.
    pub fn stop_signal(&self) -> Arc<Stop> {
        self.stop.clone()
    }

    /// Runs `wake` when the group stops (at once if it has).
    pub fn on_stop(&self, wake: impl FnOnce() + Send + 'static) {
        let mut wakers = self.stop.wakers.lock().unwrap();
        if self.stop.is_set() {
            drop(wakers);
            wake();
        } else {
            wakers.push(Box::new(wake));
        }
    }

    /// Starts thread `name` running `f` with the group's stop signal.
    pub fn spawn(
        &self,
        name: impl Into<String>,
        f: impl FnOnce(Arc<Stop>) + Send + 'static,
    ) -> std::io::Result<()> {
        let stop = self.stop.clone();
        let h = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || f(stop))?;
        self.handles.lock().unwrap().push(h);
        Ok(())
    }

    /// Threads started and not yet joined or detached.
    pub fn len(&self) -> usize {
        self.handles.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sets the stop signal and runs the wakers; does not wait.
    pub fn stop(&self) {
        self.stop.set();
    }

    /// Sets the stop signal, then joins the group's threads until `deadline`; those still
    /// running then are detached and named in the log. Returns how many were detached.
    pub fn stop_and_join(&self, deadline: Instant) -> usize {
        self.stop();
        let mut handles = std::mem::take(&mut *self.handles.lock().unwrap());
        // No timed join in std: poll, briefly (a stop is rare and short).
        loop {
            let (done, running): (Vec<_>, Vec<_>) =
                handles.into_iter().partition(JoinHandle::is_finished);
            for h in done {
                if h.join().is_err() {
                    tracing::error!(group = self.group, "a thread panicked");
                }
            }
            handles = running;
            if handles.is_empty() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        for h in &handles {
            tracing::warn!(
                group = self.group,
                thread = h.thread().name().unwrap_or("?"),
                "did not stop in time (stuck in a call that does not return?): left \
                 running, detached; the process exits without it"
            );
        }
        handles.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_wakes_sleepers_and_runs_wakers() {
        let t = Threads::new("test");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let tx = Arc::new(Mutex::new(Some(tx)));
        let tx2 = tx.clone();
        t.on_stop(move || drop(tx2.lock().unwrap().take()));
        t.spawn(
            "sleeper",
            |stop| while stop.sleep(Duration::from_secs(3600)) {},
        )
        .unwrap();
        t.spawn("receiver", move |_| while rx.recv().is_ok() {})
            .unwrap();
        assert_eq!(t.len(), 2);
        let detached = t.stop_and_join(Instant::now() + Duration::from_secs(60));
        assert_eq!(detached, 0);
        assert!(t.is_empty());
    }

    #[test]
    fn a_stuck_thread_is_detached_at_the_deadline() {
        let t = Threads::new("test");
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let g = gate.clone();
        t.spawn("stuck", move |_| {
            let (m, cv) = &*g;
            let _open = cv.wait_while(m.lock().unwrap(), |open| !*open).unwrap();
        })
        .unwrap();
        t.spawn(
            "quick",
            |stop| while stop.sleep(Duration::from_secs(3600)) {},
        )
        .unwrap();
        let detached = t.stop_and_join(Instant::now() + Duration::from_millis(50));
        assert_eq!(detached, 1);
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
    }
}

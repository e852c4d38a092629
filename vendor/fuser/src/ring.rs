//! FUSE over io_uring (Linux 6.14+, `Documentation/filesystems/fuse-io-uring.rst`).
//!
//! After `FUSE_INIT` has negotiated `FUSE_OVER_IO_URING`, the kernel sends requests to ring
//! entries registered per CPU queue instead of `/dev/fuse`: a request made on CPU `q` goes to
//! queue `q`, its reply is committed with `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`, which also
//! fetches the next request. The caller and the thread that serves it stay on one CPU, which
//! saves the cross-CPU wake-ups a `read`/`writev` pair on `/dev/fuse` costs. Forgets,
//! interrupts and notifications still use `/dev/fuse`.
//!
//! Every queue has several threads, pinned to its CPU; each owns an io_uring with a few
//! entries. A request's bytes are gathered into the layout of a `/dev/fuse` read and
//! dispatched as usual. A reply may come from any thread: the entry's buffers belong to the
//! request until its commit, so the replier writes them and only the ring's own thread
//! submits the commit (io_uring runs the next request's copy in the submitting task's
//! context), woken by an eventfd when the reply came from elsewhere.

use std::io;
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::os::fd::FromRawFd;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU8;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::thread::ThreadId;

use io_uring::IoUring;
use io_uring::cqueue;
use io_uring::opcode;
use io_uring::squeue;
use io_uring::types;
use log::error;
use log::warn;

use crate::Filesystem;
use crate::channel::Channel;
use crate::ll::fuse_abi as abi;
use crate::reply::ReplyRaw;
use crate::request::RequestWithSender;
use crate::session::SessionEventLoop;

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// `struct fuse_uring_req_header`: the request's `fuse_in_header` (the reply's
/// `fuse_out_header`) in `in_out`, the opcode's own header in `op_in`, then `ent_in_out`.
#[repr(C)]
struct ReqHeader {
    in_out: [u8; 128],
    op_in: [u8; 128],
    commit_flags: u64,
    commit_id: u64,
    payload_sz: u32,
    padding: u32,
    reserved: u64,
}

// The layout the kernel reads and writes (checked when this crate is built, as it is not
// tested with hoardfs's `cargo test`).
const _: () = assert!(std::mem::size_of::<ReqHeader>() == 288);
const _: () = assert!(std::mem::offset_of!(ReqHeader, commit_id) == 264);
const _: () = assert!(std::mem::offset_of!(ReqHeader, payload_sz) == 272);

/// `struct fuse_uring_cmd_req`, in the SQE's 80-byte command area.
fn cmd_req(qid: u16, commit_id: u64) -> [u8; 80] {
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_ne_bytes());
    cmd[16..18].copy_from_slice(&qid.to_ne_bytes());
    cmd
}

const POLL_TOKEN: u64 = u64::MAX;
/// Entries a thread keeps free for the kernel. A request waits in the kernel for a free
/// entry of its CPU's queue, and a waiting request is handed to an entry only when another
/// request of that queue is committed (not when a new entry is registered): so free entries
/// must outnumber the requests that arrive on one CPU at once. An entry's buffers are
/// mapped, not touched, until a request uses them, and the kernel hands out the entry freed
/// last first, so the entries beyond those in use cost address space only.
const ENTRIES_PER_THREAD: usize = 64;
/// A reply the file system defers (a blocking lock's, until the lock is granted) holds its
/// entry: so a thread registers one more for each request it leaves waiting for its reply,
/// up to this many in all.
const MAX_ENTRIES_PER_THREAD: usize = 4096;

/// Page-aligned memory that the kernel copies requests into and replies out of; mapped
/// anonymously, so that a page costs memory only once a request or reply has used it.
struct Buffer {
    ptr: *mut u8,
    len: usize,
}

impl Buffer {
    fn new(len: usize) -> io::Result<Buffer> {
        let len = len.max(1);
        // SAFETY: a new private anonymous mapping; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Buffer {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// What an entry is doing, as its thread and its request's replier see it.
const IDLE: u8 = 0; // registered, waiting for a request (or not yet submitted)
const SERVING: u8 = 1; // a request is being served, no reply yet
const REPLIED: u8 = 2; // the reply is in the buffers, the commit not yet submitted

/// One ring entry: its buffers, shared with the reply of the request it holds.
pub(crate) struct Entry {
    header: Buffer,
    payload: Buffer,
    iov: [libc::iovec; 2],
    state: AtomicU8,
    wake: Arc<Wake>,
}

// SAFETY: the buffers are written by the request's replier only while the entry is SERVING
// (the kernel does not touch them then) and read by the ring thread after it sees REPLIED.
unsafe impl Send for Entry {}
// SAFETY: as above.
unsafe impl Sync for Entry {}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingEntry").finish_non_exhaustive()
    }
}

/// How a replier on another thread tells a ring thread that a commit is waiting.
struct Wake {
    eventfd: OwnedFd,
    thread: std::sync::OnceLock<ThreadId>,
}

impl Wake {
    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writing 8 bytes to an eventfd we own.
        unsafe { libc::write(self.eventfd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }
}

impl Entry {
    fn new(max_payload: usize, wake: Arc<Wake>) -> io::Result<Entry> {
        let header = Buffer::new(4096)?;
        let payload = Buffer::new(max_payload)?;
        let iov = [
            libc::iovec {
                iov_base: header.ptr.cast(),
                iov_len: std::mem::size_of::<ReqHeader>(),
            },
            libc::iovec {
                iov_base: payload.ptr.cast(),
                iov_len: max_payload,
            },
        ];
        Ok(Entry {
            header,
            payload,
            iov,
            state: AtomicU8::new(IDLE),
            wake,
        })
    }

    fn header(&self) -> *mut ReqHeader {
        self.header.ptr.cast()
    }

    /// Writes a reply (`fuse_out_header` and its body, as for `/dev/fuse`) into the buffers.
    pub(crate) fn send(&self, data: &[IoSlice<'_>]) -> io::Result<()> {
        if self.state.load(Ordering::Acquire) != SERVING {
            return Err(io::Error::from_raw_os_error(libc::EALREADY));
        }
        let total: usize = data.iter().map(|d| d.len()).sum();
        let out_len = std::mem::size_of::<abi::fuse_out_header>();
        if total < out_len || total - out_len > self.payload.len {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let header = self.header();
        // SAFETY: the entry is SERVING: its buffers are this request's until the commit.
        unsafe {
            let in_out = std::ptr::addr_of_mut!((*header).in_out).cast::<u8>();
            let mut at = 0usize;
            for d in data {
                let mut src = &d[..];
                while !src.is_empty() {
                    let (dst, room) = if at < out_len {
                        (in_out.add(at), out_len - at)
                    } else {
                        (self.payload.ptr.add(at - out_len), src.len())
                    };
                    let n = src.len().min(room);
                    std::ptr::copy_nonoverlapping(src.as_ptr(), dst, n);
                    src = &src[n..];
                    at += n;
                }
            }
            std::ptr::addr_of_mut!((*header).payload_sz).write((total - out_len) as u32);
        }
        self.state.store(REPLIED, Ordering::Release);
        if self.wake.thread.get() != Some(&std::thread::current().id()) {
            self.wake.wake();
        }
        Ok(())
    }
}

/// The ring side of a session, prepared before the `FUSE_INIT` reply and started with it.
#[derive(Debug)]
pub(crate) struct Ring {
    queues: usize,
    threads_per_queue: usize,
}

thread_local! {
    static ON_RING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread serves requests that came over io_uring.
pub fn serving_over_io_uring() -> bool {
    ON_RING.with(|on| on.get())
}

/// Whether this kernel lets a connection use io_uring (`fuse.enable_uring`).
pub(crate) fn kernel_allows() -> bool {
    std::fs::read_to_string("/sys/module/fuse/parameters/enable_uring")
        .is_ok_and(|v| v.trim() == "Y" || v.trim() == "1")
}

/// The kernel's queues: one per possible CPU.
fn possible_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_CONF) };
    usize::try_from(n).unwrap_or(1).max(1)
}

impl Ring {
    /// Checks that io_uring rings with 128-byte SQEs can be made here, before the reply to
    /// `FUSE_INIT` commits the connection to them (after it, requests wait for the ring).
    pub(crate) fn prepare(threads_per_queue: usize) -> io::Result<Ring> {
        drop(new_ring()?);
        Ok(Ring {
            queues: possible_cpus(),
            threads_per_queue: threads_per_queue.max(1),
        })
    }

    /// Starts the ring threads. `max_payload` is the kernel's `max(8 KiB, max_write,
    /// max_pages × page size)`.
    pub(crate) fn start<FS: Filesystem>(
        self,
        ch: &Channel,
        max_payload: usize,
        make_loop: impl Fn(String, Channel) -> SessionEventLoop<FS>,
    ) -> io::Result<RingThreads> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let mut wakes = Vec::new();
        for qid in 0..self.queues {
            for t in 0..self.threads_per_queue {
                let name = format!("fuser-ring-{qid}-{t}");
                let event_loop = make_loop(name.clone(), ch.clone());
                // SAFETY: eventfd has no memory preconditions; the result is checked.
                let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
                if efd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: a new descriptor we own.
                let wake = Arc::new(Wake {
                    eventfd: unsafe { OwnedFd::from_raw_fd(efd) },
                    thread: std::sync::OnceLock::new(),
                });
                wakes.push(wake.clone());
                let mut entries = Vec::with_capacity(ENTRIES_PER_THREAD);
                for _ in 0..ENTRIES_PER_THREAD {
                    entries.push(Arc::new(Entry::new(max_payload, wake.clone())?));
                }
                let stop = stop.clone();
                let dev = std::os::fd::AsFd::as_fd(ch).as_raw_fd();
                threads.push(std::thread::Builder::new().name(name).spawn(move || {
                    pin_to_cpu(qid);
                    ON_RING.with(|on| on.set(true));
                    let ring = match new_ring() {
                        Ok(ring) => ring,
                        Err(e) => {
                            error!("fuse ring queue {qid}: {e}");
                            return;
                        }
                    };
                    let _ = wake.thread.set(std::thread::current().id());
                    let queue = Queue {
                        ring,
                        dev,
                        qid: qid as u16,
                        max_payload,
                        wake,
                    };
                    if let Err(e) = queue.serve(entries, &stop, &event_loop) {
                        error!("fuse ring queue {qid}: {e}");
                    }
                })?);
            }
        }
        Ok(RingThreads {
            threads,
            wakes,
            stop,
        })
    }
}

/// The running ring threads; `stop` ends them once the connection has gone.
#[derive(Debug)]
pub(crate) struct RingThreads {
    threads: Vec<JoinHandle<()>>,
    wakes: Vec<Arc<Wake>>,
    stop: Arc<AtomicBool>,
}

impl std::fmt::Debug for Wake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wake").finish_non_exhaustive()
    }
}

impl RingThreads {
    pub(crate) fn stop(self) {
        self.stop.store(true, Ordering::Release);
        for w in &self.wakes {
            w.wake();
        }
        for t in self.threads {
            let _ = t.join();
        }
    }
}

/// A ring of this thread's own: only its thread submits to it (`SINGLE_ISSUER`), and the
/// kernel's work for it (copying a request into an entry) runs when that thread waits for
/// completions (`DEFER_TASKRUN`), not as a signal-like interruption of whatever the thread
/// is doing. That interruption made the kernel's copy of a request into a page of an entry
/// not yet touched fail with `EINTR` (the request failed with it: "Copy to ring failed: -4").
fn new_ring() -> io::Result<IoUring<squeue::Entry128, cqueue::Entry>> {
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build((ENTRIES_PER_THREAD + 1).next_power_of_two() as u32)
}

fn pin_to_cpu(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET stays within its bounds for cpu < 1024.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu < 1024 {
            libc::CPU_SET(cpu, &mut set);
            // An offline CPU's queue still serves, unpinned.
            let _ = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
}

/// One ring thread's share of a CPU queue.
struct Queue {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    /// The /dev/fuse descriptor the commands name (any descriptor of the connection).
    dev: i32,
    qid: u16,
    max_payload: usize,
    wake: Arc<Wake>,
}

impl Queue {
    fn register(&self, entry: &Entry, index: usize) -> io::Result<()> {
        let sqe = opcode::UringCmd80::new(types::Fd(self.dev), CMD_REGISTER)
            .cmd(cmd_req(self.qid, 0))
            .addr(Some(entry.iov.as_ptr() as u64))
            .build()
            .user_data(index as u64);
        self.push(&with_len(sqe, 2))
    }

    fn commit(&self, index: usize, commit_id: u64) -> io::Result<()> {
        let sqe = opcode::UringCmd80::new(types::Fd(self.dev), CMD_COMMIT_AND_FETCH)
            .cmd(cmd_req(self.qid, commit_id))
            .build()
            .user_data(index as u64);
        self.push(&sqe)
    }

    fn arm_poll(&self) -> io::Result<()> {
        let sqe: squeue::Entry128 = opcode::PollAdd::new(
            types::Fd(self.wake.eventfd.as_raw_fd()),
            libc::POLLIN as u32,
        )
        .build()
        .user_data(POLL_TOKEN)
        .into();
        self.push(&sqe)
    }

    fn push(&self, sqe: &squeue::Entry128) -> io::Result<()> {
        // SAFETY: only this queue's thread touches its submission queue; the SQEs' buffers
        // (the entries' iovecs) live as long as the ring.
        unsafe {
            if self.ring.submission_shared().push(sqe).is_err() {
                self.ring.submit()?;
                self.ring
                    .submission_shared()
                    .push(sqe)
                    .map_err(|_| io::Error::from_raw_os_error(libc::EBUSY))?;
            }
        }
        Ok(())
    }

    fn serve<FS: Filesystem>(
        &self,
        mut entries: Vec<Arc<Entry>>,
        stop: &AtomicBool,
        event_loop: &SessionEventLoop<FS>,
    ) -> io::Result<()> {
        for (i, e) in entries.iter().enumerate() {
            self.register(e, i)?;
        }
        self.arm_poll()?;
        let mut request = crate::read_buf::FuseReadBuf::new();
        let mut done: Vec<(u64, i32)> = Vec::new();
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
            if stop.load(Ordering::Acquire) {
                return Ok(());
            }
            done.clear();
            // SAFETY: only this thread reads the completion queue.
            unsafe { self.ring.completion_shared() }
                .for_each(|c| done.push((c.user_data(), c.result())));
            // Replies given on other threads, announced by the eventfd.
            let mut replied_elsewhere = false;
            for &(token, res) in &done {
                if token == POLL_TOKEN {
                    let mut buf = [0u8; 8];
                    // SAFETY: reading 8 bytes from our eventfd into a local buffer.
                    unsafe {
                        libc::read(self.wake.eventfd.as_raw_fd(), buf.as_mut_ptr().cast(), 8)
                    };
                    self.arm_poll()?;
                    replied_elsewhere = true;
                    continue;
                }
                let index = token as usize;
                let Some(entry) = entries.get(index).cloned() else {
                    continue;
                };
                if res == -libc::EINTR || res == -libc::EAGAIN {
                    self.register(&entry, index)?;
                    continue;
                }
                if res < 0 {
                    // The connection ended (ENOTCONN, ECANCELED) or the kernel refused the ring.
                    if res != -libc::ENOTCONN && res != -libc::ECANCELED {
                        warn!(
                            "fuse ring queue {}: {}",
                            self.qid,
                            io::Error::from_raw_os_error(-res)
                        );
                    }
                    return Ok(());
                }
                self.dispatch(&entry, request.as_mut(), event_loop)?;
                if entry.state.load(Ordering::Acquire) == SERVING
                    && entries.len() < MAX_ENTRIES_PER_THREAD
                {
                    // The reply is deferred: keep as many entries free as before.
                    let fresh = Arc::new(Entry::new(self.max_payload, self.wake.clone())?);
                    self.register(&fresh, entries.len())?;
                    entries.push(fresh);
                }
                self.commit_if_replied(&entry, index)?;
            }
            if replied_elsewhere {
                for (i, e) in entries.iter().enumerate() {
                    self.commit_if_replied(e, i)?;
                }
            }
        }
    }

    /// Commits `entry`'s reply, if it has one that is not committed yet.
    fn commit_if_replied(&self, entry: &Entry, index: usize) -> io::Result<()> {
        if entry
            .state
            .compare_exchange(REPLIED, IDLE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            // SAFETY: the reply is in the buffers; the commit id is the request's.
            let id = unsafe { std::ptr::addr_of!((*entry.header()).commit_id).read() };
            self.commit(index, id)?;
        }
        Ok(())
    }

    /// Serves the request the kernel put in `entry`: gathers `fuse_in_header`, the opcode's
    /// header and the payload into the layout a read of /dev/fuse gives, and dispatches it.
    fn dispatch<FS: Filesystem>(
        &self,
        entry: &Arc<Entry>,
        buf: &mut [u8],
        event_loop: &SessionEventLoop<FS>,
    ) -> io::Result<()> {
        let in_len = std::mem::size_of::<abi::fuse_in_header>();
        let header = entry.header();
        // SAFETY: the kernel has completed the entry's command: its buffers hold the
        // request and are ours until the commit.
        let (commit_id, len) = unsafe {
            let commit_id = std::ptr::addr_of!((*header).commit_id).read();
            let payload_sz = std::ptr::addr_of!((*header).payload_sz).read() as usize;
            let in_out = std::ptr::addr_of!((*header).in_out).cast::<u8>();
            // fuse_in_header.len counts the whole request, as on /dev/fuse.
            let total = in_out.cast::<u32>().read_unaligned() as usize;
            let op_len = total.saturating_sub(in_len + payload_sz).min(128);
            let len = in_len + op_len + payload_sz;
            if len > buf.len() || payload_sz > entry.payload.len {
                return Err(io::Error::from_raw_os_error(libc::E2BIG));
            }
            std::ptr::copy_nonoverlapping(in_out, buf.as_mut_ptr(), in_len);
            std::ptr::copy_nonoverlapping(
                std::ptr::addr_of!((*header).op_in).cast::<u8>(),
                buf.as_mut_ptr().add(in_len),
                op_len,
            );
            std::ptr::copy_nonoverlapping(
                entry.payload.ptr,
                buf.as_mut_ptr().add(in_len + op_len),
                payload_sz,
            );
            buf[..4].copy_from_slice(&(len as u32).to_ne_bytes());
            (commit_id, len)
        };
        entry.state.store(SERVING, Ordering::Release);
        let sender = event_loop.ch.sender();
        match RequestWithSender::new_ring(sender.clone(), entry.clone(), &buf[..len]) {
            Some(req) => {
                if let Ok(crate::ll::Operation::Destroy(_)) = req.request.operation() {
                    req.reply::<crate::ReplyEmpty>().ok();
                } else {
                    req.dispatch(event_loop);
                }
            }
            None => {
                // Unparseable: answer EIO, so that the caller does not wait forever.
                let reply: ReplyRaw = crate::reply::Reply::new(
                    crate::ll::RequestId(commit_id),
                    crate::reply::ReplySender::Ring(entry.clone(), sender),
                );
                reply.send_ll(&crate::ll::ResponseErrno(crate::ll::Errno::EIO));
            }
        }
        Ok(())
    }
}

/// Sets the SQE's `len` (the iovec count of a register), which `UringCmd80` leaves at 0.
fn with_len(sqe: squeue::Entry128, len: u32) -> squeue::Entry128 {
    const LEN_OFFSET: usize = 24; // struct io_uring_sqe: opcode, flags, ioprio, fd, off, addr, len
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: Entry128 is repr(C) over struct io_uring_sqe and 64 more bytes; `len` is the
    // u32 at byte 24 of the SQE in every version of the ABI.
    unsafe {
        let mut bytes: [u8; 128] = std::mem::transmute(sqe);
        bytes[LEN_OFFSET..LEN_OFFSET + 4].copy_from_slice(&len.to_ne_bytes());
        std::mem::transmute::<[u8; 128], squeue::Entry128>(bytes)
    }
}

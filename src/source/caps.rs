//! What a kind of source can do. The core asks these, never which kind of source it has:
//! each branch names the capability it is about (`GuardedSource::capabilities`).

/// The capabilities of one source, declared by its kind (a directory tree, an object store).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Files and directories open as descriptors: fetches read through one, opens check
    /// identity by `fstat` of an `O_PATH` descriptor, uncached reads and `lseek` use one.
    /// Without them a file is read by requests that name the version they expect.
    pub descriptors: bool,
    /// Files change in place (write-through). Without: a file opened for writing is made
    /// whole in the cache and uploaded whole on close and fsync (`fs/object.rs`), a new
    /// file or directory is made with its owner and mode in one request, and an attribute
    /// change rewrites the object, which moves its mtime.
    pub in_place_writes: bool,
    pub hard_links: bool,
    pub symlinks: bool,
    /// Device nodes, FIFOs and sockets (`mknod`).
    pub special_files: bool,
    pub xattrs: bool,
    /// POSIX locks and flock taken on the source, so that they hold for all its clients;
    /// without, the kernel keeps them, local to this machine.
    pub posix_locks: bool,
    /// `SEEK_DATA`/`SEEK_HOLE` answered by the source, which knows its holes.
    pub seek_data: bool,
    /// inotify sees every change made to it (a local file system).
    pub watchable: bool,
    /// Every read is a request of its own with a high fixed cost (a ranged GET): fetches
    /// read a whole chunk per request.
    pub reads_by_request: bool,
    /// A stat names the version exactly (an ETag's digest in the ctime), so identities are
    /// never racy (ARCHITECTURE.md, "Racy identities").
    pub exact_versions: bool,
    /// The source's own kernel clears set-ID bits and `security.capability` on our writes
    /// and chowns, so the mount may claim `FUSE_HANDLE_KILLPRIV_V2`.
    pub clears_set_id: bool,
    /// Calls carry their own timeouts (`S3Options`): the health timeout is off unless one
    /// is given, since one shorter than an upload would take the mount offline mid-upload.
    pub own_timeouts: bool,
}

impl Capabilities {
    /// A directory tree (`BeneathRoot`); `remote`: on a network or FUSE file system.
    pub const fn posix(remote: bool) -> Capabilities {
        Capabilities {
            descriptors: true,
            in_place_writes: true,
            hard_links: true,
            symlinks: true,
            special_files: true,
            xattrs: true,
            posix_locks: true,
            seek_data: true,
            watchable: !remote,
            reads_by_request: false,
            exact_versions: false,
            clears_set_id: true,
            own_timeouts: false,
        }
    }

    /// An object store (`object_tree.rs`).
    pub const OBJECT_STORE: Capabilities = Capabilities {
        descriptors: false,
        in_place_writes: false,
        hard_links: false,
        symlinks: false,
        special_files: false,
        xattrs: false,
        posix_locks: false,
        seek_data: false,
        watchable: false,
        reads_by_request: true,
        exact_versions: true,
        clears_set_id: false,
        own_timeouts: true,
    };
}

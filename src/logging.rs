//! Logging: `tracing` to stderr (a daemon's stderr is `CACHE_DIR/hoardfs.log`), filtered by
//! `HOARDFS_LOG` (an `EnvFilter` spec: `debug`, `hoardfs::cleaner=debug,info`, ...; default
//! `info`: one line per significant event). The filter can be replaced on a live mount
//! (`hoardfs set MOUNTPOINT log=debug`), and panics are logged before the default hook runs.

use std::sync::OnceLock;

use tracing_subscriber::{EnvFilter, prelude::*, reload};

/// The level when `HOARDFS_LOG` is unset: mount, unmount, cleaner passes, corruption and
/// errors; nothing per request.
pub const DEFAULT_FILTER: &str = "info";

type Reloader = Box<dyn Fn(EnvFilter) -> Result<(), String> + Send + Sync>;
static RELOAD: OnceLock<Reloader> = OnceLock::new();

/// Installs the subscriber and the panic hook. Call once, first thing in `main`.
pub fn init() {
    let filter = match std::env::var("HOARDFS_LOG") {
        Ok(spec) => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            eprintln!("hoardfs: ignoring HOARDFS_LOG={spec:?}: {e}");
            EnvFilter::new(DEFAULT_FILTER)
        }),
        Err(_) => EnvFilter::new(DEFAULT_FILTER),
    };
    let (filter, handle) = reload::Layer::new(filter);
    tracing_subscriber::registry()
        .with(filter)
        // No colours: a daemon's stderr is its log file, redirected after this point.
        .with(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_writer(std::io::stderr),
        )
        .init();
    let _ = RELOAD.set(Box::new(move |f| {
        handle.reload(f).map_err(|e| e.to_string())
    }));

    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let thread = std::thread::current();
        tracing::error!(thread = thread.name().unwrap_or("unnamed"), "panic: {info}");
        default_hook(info);
    }));
}

/// Replaces the filter of this process's log (`set log SPEC` on the control socket).
pub fn set_filter(spec: &str) -> Result<(), String> {
    let filter = EnvFilter::try_new(spec).map_err(|e| format!("log: {e}"))?;
    let reload = RELOAD.get().ok_or("log: logging is not initialised")?;
    reload(filter)?;
    tracing::info!("log filter is now {spec:?}");
    Ok(())
}

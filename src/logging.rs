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

const LEVELS: &[&str] = &["off", "error", "warn", "info", "debug", "trace"];

/// Parses a filter: a level, or `TARGET=LEVEL` directives (`EnvFilter` syntax), separated
/// by commas. A bare word that is not a level is refused: `EnvFilter` would take it as a
/// target name (`verbose` would log only a target of that name, i.e. nothing).
pub fn parse_filter(spec: &str) -> Result<EnvFilter, String> {
    for d in spec.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        if !d.contains(['=', '[']) && !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(d)) {
            return Err(format!(
                "{d:?} is not a level ({}) nor TARGET=LEVEL",
                LEVELS.join(", ")
            ));
        }
    }
    EnvFilter::try_new(spec).map_err(|e| format!("{spec:?} is not a level nor a filter: {e}"))
}

/// The filter the process started with: `HOARDFS_LOG`'s if it is one, else the default
/// (`hoardfs set MNT log=auto` returns to it).
pub fn initial_filter() -> String {
    match std::env::var("HOARDFS_LOG") {
        Ok(spec) if parse_filter(&spec).is_ok() => spec,
        _ => DEFAULT_FILTER.to_string(),
    }
}

/// Installs the subscriber and the panic hook. Call once, first thing in `main`.
pub fn init() {
    let filter = match std::env::var("HOARDFS_LOG") {
        Ok(spec) => parse_filter(&spec).unwrap_or_else(|e| {
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
    let filter = parse_filter(spec).map_err(|e| format!("log: {e}"))?;
    let reload = RELOAD.get().ok_or("log: logging is not initialised")?;
    reload(filter)?;
    tracing::info!("log filter is now {spec:?}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_are_levels_or_directives() {
        for ok in [
            "info",
            "DEBUG",
            "off",
            "hoardfs=debug",
            "hoardfs::cleaner=trace,warn",
            "",
        ] {
            assert!(parse_filter(ok).is_ok(), "{ok}");
        }
        for bad in ["verbose", "info,chatty", "hoardfs=loud", "hoardfs"] {
            assert!(parse_filter(bad).is_err(), "{bad}");
        }
    }
}

//! `hoardfs`: thin entry point. Exit status 0 on success, 1 on any error (printed), 2 for
//! bad usage: an unknown option, or a value no machine would accept (clap, `-o` and the
//! config file's parsing, `Config::check_values`).

use clap::Parser;
use hoardfs::cli::{Cli, Command, ConfigAction};

fn main() {
    let cli = Cli::parse();
    hoardfs::logging::init();
    let result = match cli.command {
        Some(Command::Stats { mountpoint, json }) => hoardfs::control::request_stats(&mountpoint)
            .map(|s| {
                if json {
                    println!("{}", serde_json::to_string_pretty(&s).unwrap());
                } else {
                    print!("{}", s.table());
                }
            }),
        Some(Command::Clean { mountpoint, to }) => hoardfs::control::request_clean(&mountpoint, to)
            .map(|freed| println!("freed {freed} bytes")),
        Some(Command::Pin { paths }) => paths
            .iter()
            .try_for_each(|p| hoardfs::control::request_pin(p, true)),
        Some(Command::Unpin { paths }) => paths
            .iter()
            .try_for_each(|p| hoardfs::control::request_pin(p, false)),
        Some(Command::Set {
            mountpoint,
            settings,
        }) => settings.iter().try_for_each(|kv| {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| anyhow::anyhow!("{kv:?}: expected KEY=VALUE"))?;
            hoardfs::control::request_set(&mountpoint, k, v)
        }),
        Some(Command::Offline { mountpoint }) => {
            hoardfs::control::request_set(&mountpoint, "online", "off")
        }
        Some(Command::Online { mountpoint }) => {
            hoardfs::control::request_set(&mountpoint, "online", "on")
        }
        Some(Command::Warm { paths, pin, jobs }) => hoardfs::warm::warm(&paths, pin, jobs),
        Some(Command::Abort { mount, config }) => abort(&mount, config.as_deref()),
        Some(Command::Config {
            action: ConfigAction::Check { file },
        }) => match hoardfs::config_file::load(&file) {
            Ok(f) => {
                let names: Vec<&str> = f.mount_names().collect();
                println!("{}: ok; mounts: {}", file.display(), names.join(", "));
                Ok(())
            }
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(1);
            }
        },
        Some(Command::Generate { what }) => hoardfs::manpage::generate(what),
        None => match cli.mount.into_config().and_then(|cfg| {
            cfg.check_values().map_err(|e| e.to_string())?;
            Ok(cfg)
        }) {
            Ok(cfg) => hoardfs::run::mount(cfg),
            Err(e) => {
                eprintln!("hoardfs: {e}");
                std::process::exit(2);
            }
        },
    };
    if let Err(e) = result {
        eprintln!("hoardfs: {e:#}");
        std::process::exit(1);
    }
}

/// `hoardfs abort`: MOUNT is a mount point, or a section of `config` (by name or mount point).
fn abort(mount: &std::path::Path, config: Option<&std::path::Path>) -> anyhow::Result<()> {
    use hoardfs::run::MountPoint;
    let mountpoint = match config {
        None => mount.to_path_buf(),
        Some(file) => {
            let f = hoardfs::config_file::load(file).map_err(anyhow::Error::msg)?;
            f.select(Some(&mount.to_string_lossy()))
                .map_err(anyhow::Error::msg)?
                .mountpoint
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "{}: [mount.{}] names no mountpoint",
                        file.display(),
                        mount.display()
                    )
                })?
        }
    };
    match hoardfs::run::clear_dead_mount(&mountpoint)? {
        MountPoint::Free => println!("{}: no hoardfs mount there", mountpoint.display()),
        MountPoint::Answers { mountpoint, source } => println!(
            "{}: a hoardfs mount of {source} whose daemon answers: left alone",
            mountpoint.display()
        ),
        MountPoint::Cleared => println!(
            "{}: its daemon did not answer; connection aborted and mount detached",
            mountpoint.display()
        ),
    }
    Ok(())
}

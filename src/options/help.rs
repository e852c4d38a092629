//! The help texts made from the option table: `-o`'s and `hoardfs set`'s.

use super::{OPTIONS, Opt};

/// The `-o` help text.
pub fn o_help() -> String {
    let opts: Vec<String> = OPTIONS
        .iter()
        .filter(|o| o.is_mount_option())
        .map(Opt::usage)
        .collect();
    format!(
        "Mount options, comma separated, as in fstab: {}; the generic mount(8) options \
         (defaults, _netdev, nofail, auto, noauto, user, users, nodev, nosuid, noexec, ...) \
         are accepted and ignored",
        opts.join(", ")
    )
}

/// `hoardfs set`'s short help: every live key.
pub fn set_help() -> String {
    let keys: Vec<String> = OPTIONS
        .iter()
        .filter(|o| o.live.is_some())
        .map(Opt::usage)
        .collect();
    format!(
        "KEY=VALUE pairs: {}; KEY=auto restores a key's default",
        keys.join(", ")
    )
}

/// `hoardfs set --help`: every live key with its help and default.
pub fn set_long_help() -> String {
    let mut s = String::from(
        "KEY=VALUE pairs, applied in order; KEY=auto restores the default (as at mount \
         time, from the mount's other options). The keys:\n",
    );
    for o in OPTIONS.iter().filter(|o| o.live.is_some()) {
        s.push_str(&format!("\n  {}\n      {}", o.usage(), o.flag_help()));
    }
    s
}

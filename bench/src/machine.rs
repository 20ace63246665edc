//! The machine a benchmark ran on, recorded beside its figures so two runs can be compared:
//! CPU model and the flags that matter to the kernels, cores, memory, kernel release, the file
//! system of the NVMe directory, the git revision and a timestamp. Every field is best effort:
//! what cannot be read is `"unknown"` (or 0), never an error.

use std::path::{Path, PathBuf};

use serde::Serialize;

/// CPU flags recorded when present (the optimizer kernel's SIMD paths and conversions).
pub const RELEVANT_CPU_FLAGS: &[&str] = &["avx2", "fma", "f16c", "avx512f", "avx512_bf16"];

/// One machine at one moment.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Machine {
    /// `model name` of the first CPU in /proc/cpuinfo.
    pub cpu_model: String,
    /// The [`RELEVANT_CPU_FLAGS`] this CPU has, in that order.
    pub cpu_flags: Vec<String>,
    /// Cores available to this process (`std::thread::available_parallelism`).
    pub cores: usize,
    /// `MemTotal` of /proc/meminfo, bytes.
    pub memory_bytes: u64,
    /// Kernel release (/proc/sys/kernel/osrelease).
    pub kernel: String,
    /// The directory whose file system is recorded (the NVMe directory), if one was given.
    pub dir: Option<PathBuf>,
    /// Its file system (`ext4`, `xfs`, `btrfs`, `tmpfs`, `overlay`, ... or `0x<magic>`);
    /// `"unknown"` without a directory.
    pub fs_type: String,
    /// `git rev-parse HEAD` in the working directory, `"unknown"` outside a checkout.
    pub git_rev: String,
    /// Seconds since the Unix epoch when recorded.
    pub timestamp_unix_s: u64,
}

/// Records this machine for a training config's run: the file system is that of its first
/// `[budgets] nvme_dirs` entry, or of its nearest existing ancestor when the directory does not
/// exist yet (the current directory without one).
pub fn record_for_config(cfg: &oogc::config::TrainConfig) -> Machine {
    let nvme_dir = cfg.budgets.nvme_dirs.first().map(PathBuf::as_path);
    let fs_dir = nvme_dir.and_then(|d| d.ancestors().find(|a| a.exists())).unwrap_or(Path::new("."));
    record(Some(fs_dir))
}

/// Records this machine; `dir` is the directory whose file system matters (NVMe scratch).
pub fn record(dir: Option<&Path>) -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        cpuinfo
            .lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    let flags: Vec<String> = field("flags").unwrap_or_default().split_whitespace().map(str::to_string).collect();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_kib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0);
    Machine {
        cpu_model: field("model name").unwrap_or_else(|| "unknown".into()),
        cpu_flags: RELEVANT_CPU_FLAGS.iter().filter(|f| flags.iter().any(|g| g == *f)).map(|f| f.to_string()).collect(),
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        memory_bytes: memory_kib * 1024,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into()),
        dir: dir.map(Path::to_path_buf),
        fs_type: dir.map_or_else(|| "unknown".into(), fs_type),
        git_rev: git_rev(),
        timestamp_unix_s: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
    }
}

/// The file system of `dir` by its statfs magic number; `"unknown"` when statfs fails.
pub fn fs_type(dir: &Path) -> String {
    match rustix::fs::statfs(dir) {
        #[allow(clippy::unnecessary_cast)]
        Ok(st) => fs_name(st.f_type as u64 & 0xffff_ffff),
        Err(_) => "unknown".into(),
    }
}

/// The name of a statfs `f_type` magic number (linux/magic.h), else `0x<hex>`.
pub fn fs_name(magic: u64) -> String {
    let name = match magic {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0x0102_1994 => "tmpfs",
        0x794C_7630 => "overlay",
        0x6969 => "nfs",
        0x6573_5546 => "fuse",
        0x2FC1_2FC1 => "zfs",
        0xF2F5_2010 => "f2fs",
        0x8584_58F6 => "ramfs",
        _ => return format!("{magic:#x}"),
    };
    name.into()
}

fn git_rev() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_this_machine() {
        let dir = std::env::temp_dir();
        let m = record(Some(&dir));
        assert!(m.cores >= 1);
        assert!(m.memory_bytes > 0, "{m:?}");
        assert_ne!(m.fs_type, "unknown", "{m:?}");
        assert!(m.timestamp_unix_s > 0);
        assert_eq!(fs_name(0xEF53), "ext4");
        assert_eq!(fs_name(0x1234), "0x1234");
    }
}

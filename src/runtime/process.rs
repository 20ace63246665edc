//! The process's own figures, read from the kernel: resident set size and its peak, minor page
//! faults, free disk space (what the host budget and the checkpoint writer check against).

use std::path::Path;

/// Bytes available to this process on the file system of `dir` (statvfs: `f_bavail × f_frsize`).
///
/// # Errors
/// statvfs failed.
pub fn statvfs_free_bytes(dir: &Path) -> std::io::Result<u64> {
    oogc_swapper::nvme::free_bytes(dir)
}

/// The process's peak resident set size, bytes (`VmHWM` of `/proc/self/status`); `None` where
/// it cannot be read.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_kib("VmHWM:").map(|k| k * 1024)
}

/// The process's resident set size now, bytes (`VmRSS` of `/proc/self/status`).
pub fn rss_bytes() -> Option<u64> {
    proc_status_kib("VmRSS:").map(|k| k * 1024)
}

/// The process's minor page faults so far (field 10, `minflt`, of `/proc/self/stat`): pages
/// mapped on first touch without I/O, the cost of memory allocated afresh. `None` where it
/// cannot be read.
pub fn minor_faults() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // After the command name (in parentheses, which may hold spaces): state is field 3, minflt 10.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(7)?.parse().ok()
}

fn proc_status_kib(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].trim().trim_end_matches("kB").trim().parse().ok()
}

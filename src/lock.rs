//! Exclusive run directories (DESIGN.md invariant 4: one run at a time owns its directories).
//!
//! A run takes an exclusive `flock` on a lock file, [`LOCK_FILE`], in its checkpoint directory
//! and in each of its NVMe directories, before it writes anything there, and holds it for its
//! whole life ([`RunLock`], kept by the `Trainer`). The file holds the holder's pid, command line
//! and start time (JSON), so a second run is refused with who holds the directory and the fix
//! ([`LockError::Held`]) — without this, two runs of one config would write the same checkpoint
//! directory (DeepSpeed #7549 is that bug).
//!
//! | state of `.oogc.lock` | meaning | what `acquire` does |
//! |---|---|---|
//! | absent or empty, not locked | free (a run that ended empties it) | takes it |
//! | locked (`flock` refused) | a live run holds it | [`LockError::Held`] naming the holder |
//! | holds a holder, not locked | its run was killed (the kernel dropped the lock) | takes it over with a warning and removes the dead run's NVMe store files ([`StaleLock`]) |
//!
//! The file is never deleted (deleting a lock file races with a run opening it); a run that
//! ends empties it while still holding the lock. Several NVMe directories on one file system
//! (same `st_dev`) are warned about: striping over one disk gains nothing.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use oogc_swapper::StatePlacement;

/// Name of the lock file in a run directory.
pub const LOCK_FILE: &str = ".oogc.lock";

/// What a run directory is for (names the config key in messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirRole {
    /// `[checkpoint] dir`.
    Checkpoint,
    /// An entry of `[budgets] nvme_dirs`.
    Nvme,
}

impl DirRole {
    /// The config key of such a directory.
    pub fn key(self) -> &'static str {
        match self {
            DirRole::Checkpoint => "[checkpoint] dir",
            DirRole::Nvme => "[budgets] nvme_dirs",
        }
    }
}

/// Who holds (or held) a directory: the content of its lock file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// Process id.
    pub pid: u32,
    /// Its command line, arguments joined by spaces.
    pub command: String,
    /// When it took the lock, seconds since the Unix epoch.
    pub started_unix_s: u64,
}

impl Holder {
    fn this_process() -> Self {
        Self {
            pid: std::process::id(),
            command: std::env::args().collect::<Vec<_>>().join(" "),
            started_unix_s: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        }
    }
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {}, `{}`, started {}", self.pid, self.command, utc(self.started_unix_s))
    }
}

/// `YYYY-MM-DD HH:MM:SS UTC` of a Unix time in seconds (Howard Hinnant's civil-from-days); also
/// the date in `oogc gpu-check`'s report.
pub fn utc(unix_s: u64) -> String {
    let (days, secs) = ((unix_s / 86_400) as i64, unix_s % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", secs / 3600, secs / 60 % 60, secs % 60)
}

/// A run directory cannot be locked.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another live run holds the directory.
    #[error(
        "{dir} ({key}) is in use by another oogc run ({})\n  fix: wait for that run to end, or stop it{} \
         (SIGTERM writes a checkpoint first), or give this run other directories ({key})",
        holder.as_ref().map_or_else(|| "holder unknown: it has not written its lock file yet".to_string(), Holder::to_string),
        holder.as_ref().map_or_else(String::new, |h| format!(" with `kill -TERM {}`", h.pid))
    )]
    Held {
        /// The directory.
        dir: PathBuf,
        /// Its config key.
        key: &'static str,
        /// Who holds it, when its lock file could be read.
        holder: Option<Holder>,
    },
    /// The directory or its lock file cannot be created, opened or locked.
    #[error(
        "cannot lock {dir} ({key}): {source}\n  fix: point {key} at a directory this process can create and write"
    )]
    Io {
        /// The directory.
        dir: PathBuf,
        /// Its config key.
        key: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// A lock taken over from a run that was killed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleLock {
    /// The directory.
    pub dir: PathBuf,
    /// The dead holder, when its lock file could be parsed.
    pub holder: Option<Holder>,
    /// NVMe store files of the dead run removed from the directory.
    pub removed_files: usize,
    /// Their bytes.
    pub removed_bytes: u64,
}

/// One locked directory: the open lock file (the `flock` lives as long as it is open).
#[derive(Debug)]
struct DirLock {
    dir: PathBuf,
    file: File,
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Empty it while still holding the lock: an empty file is a free directory.
        if let Err(e) = self.file.set_len(0) {
            tracing::warn!(dir = %self.dir.display(), error = %e, "cannot empty the run lock file");
        }
    }
}

/// The locks of one run on its directories; released (and the lock files emptied) on drop.
#[derive(Debug)]
pub struct RunLock {
    locks: Vec<DirLock>,
    stale: Vec<StaleLock>,
    warnings: Vec<String>,
}

impl RunLock {
    /// Locks the directories a run of `cfg` writes: `[checkpoint] dir` when set, and
    /// `[budgets] nvme_dirs` when the optimizer state lives there. Creates them if missing.
    ///
    /// # Errors
    /// As [`RunLock::acquire`].
    pub fn for_config(cfg: &TrainConfig) -> Result<Self, LockError> {
        let mut dirs = Vec::new();
        if let Some(d) = &cfg.checkpoint.dir {
            dirs.push((d.clone(), DirRole::Checkpoint));
        }
        if cfg.budgets.optimizer_state == StatePlacement::Nvme {
            dirs.extend(cfg.budgets.nvme_dirs.iter().map(|d| (d.clone(), DirRole::Nvme)));
        }
        Self::acquire(&dirs)
    }

    /// Locks each directory of `dirs` (created if missing; one listed twice is locked once).
    /// Takes over stale locks of killed runs with a warning ([`RunLock::stale`]); warns when NVMe
    /// directories share a file system ([`RunLock::warnings`]).
    ///
    /// # Errors
    /// [`LockError::Held`] naming the live holder of a directory; [`LockError::Io`] when a
    /// directory or lock file cannot be created or locked. Locks taken before the error are
    /// released.
    pub fn acquire(dirs: &[(PathBuf, DirRole)]) -> Result<Self, LockError> {
        let me = Holder::this_process();
        let mut run = RunLock { locks: Vec::new(), stale: Vec::new(), warnings: Vec::new() };
        let mut seen: Vec<PathBuf> = Vec::new();
        let mut devices: Vec<(u64, PathBuf)> = Vec::new();
        for (dir, role) in dirs {
            let key = role.key();
            let io = |source| LockError::Io { dir: dir.clone(), key, source };
            std::fs::create_dir_all(dir).map_err(io)?;
            let canonical = dir.canonicalize().map_err(io)?;
            if *role == DirRole::Nvme {
                let dev = std::fs::metadata(&canonical).map_err(io)?.dev();
                if let Some((_, other)) = devices.iter().find(|(d, p)| *d == dev && *p != canonical) {
                    let w = format!(
                        "[budgets] nvme_dirs {} and {} are on one file system: striping over one disk gains nothing; \
                         list one directory per disk",
                        other.display(),
                        canonical.display()
                    );
                    tracing::warn!("{w}");
                    run.warnings.push(w);
                }
                devices.push((dev, canonical.clone()));
            }
            if seen.contains(&canonical) {
                continue;
            }
            seen.push(canonical.clone());
            let (lock, stale) = lock_dir(&canonical, *role, &me)?;
            run.locks.push(lock);
            run.stale.extend(stale);
        }
        Ok(run)
    }

    /// The directories held.
    pub fn dirs(&self) -> impl Iterator<Item = &Path> {
        self.locks.iter().map(|l| l.dir.as_path())
    }

    /// Locks taken over from killed runs.
    pub fn stale(&self) -> &[StaleLock] {
        &self.stale
    }

    /// Warnings (NVMe directories sharing a file system).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
}

/// Bytes of the NVMe store files a killed run left in `dir`: those of the holder its
/// [`LOCK_FILE`] names when nobody holds the lock any more (a shared `flock` succeeds, so the
/// holder is gone). [`RunLock`] removes them when it takes the lock over, after the budget check
/// that runs before anything is written; that check counts them as free space (else a run
/// restarted after a kill on a full disk would be refused for the space its own predecessor
/// holds). 0 without a lock file, with a live holder, or when anything cannot be read.
pub fn stale_store_bytes(dir: &Path) -> u64 {
    let Ok(mut file) = File::open(dir.join(LOCK_FILE)) else { return 0 };
    if rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockShared).is_err() {
        return 0;
    }
    let mut text = String::new();
    if file.read_to_string(&mut text).is_err() {
        return 0;
    }
    let Some(holder) = serde_json::from_str::<Holder>(text.trim()).ok().filter(|h| h.pid != std::process::id()) else {
        return 0;
    };
    let prefix = oogc_swapper::nvme::store_file_prefix(holder.pid);
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".swap")))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

fn lock_dir(dir: &Path, role: DirRole, me: &Holder) -> Result<(DirLock, Option<StaleLock>), LockError> {
    let key = role.key();
    let io = |source| LockError::Io { dir: dir.to_path_buf(), key, source };
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(io)?;
    let mut text = String::new();
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => {
            let _ = file.read_to_string(&mut text);
            return Err(LockError::Held {
                dir: dir.to_path_buf(),
                key,
                holder: serde_json::from_str(text.trim()).ok(),
            });
        }
        Err(e) if e == rustix::io::Errno::NOLCK || e == rustix::io::Errno::OPNOTSUPP => {
            tracing::warn!(
                dir = %dir.display(),
                "the file system refuses file locks ({e}): this run cannot keep other runs out of {key}"
            );
        }
        Err(e) => return Err(io(e.into())),
    }
    file.read_to_string(&mut text).map_err(io)?;
    let stale = if text.trim().is_empty() {
        None
    } else {
        let holder: Option<Holder> = serde_json::from_str(text.trim()).ok();
        let (mut removed_files, mut removed_bytes) = (0, 0);
        if let Some(h) = holder.as_ref().filter(|h| role == DirRole::Nvme && h.pid != me.pid) {
            match oogc_swapper::nvme::remove_stale_store_files(dir, h.pid) {
                Ok((n, b)) => (removed_files, removed_bytes) = (n, b),
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot remove a killed run's NVMe store files")
                }
            }
        }
        let who = holder.as_ref().map_or_else(|| format!("unreadable holder `{}`", text.trim()), Holder::to_string);
        tracing::warn!(
            "{} ({key}): taking over the lock of a run that did not end cleanly ({who}); removed {removed_files} \
             of its NVMe store files ({removed_bytes} bytes)",
            dir.display()
        );
        Some(StaleLock { dir: dir.to_path_buf(), holder, removed_files, removed_bytes })
    };
    let mut record = serde_json::to_string(me).expect("holder serializes");
    record.push('\n');
    (|| -> std::io::Result<()> {
        file.set_len(0)?;
        file.seek(SeekFrom::Start(0))?;
        file.write_all(record.as_bytes())?;
        file.flush()
    })()
    .map_err(io)?;
    Ok((DirLock { dir: dir.to_path_buf(), file }, stale))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid_and_a_fix() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("ckpt");
        let first = RunLock::acquire(&[(ckpt.clone(), DirRole::Checkpoint)]).unwrap();
        assert!(first.stale().is_empty());
        let err = RunLock::acquire(&[(ckpt.clone(), DirRole::Checkpoint)]).unwrap_err();
        match &err {
            LockError::Held { holder: Some(h), key, .. } => {
                assert_eq!(h.pid, std::process::id());
                assert_eq!(*key, "[checkpoint] dir");
            }
            other => panic!("expected Held, got {other:?}"),
        }
        let text = err.to_string();
        assert!(text.contains("in use") && text.contains("fix") && text.contains("kill -TERM"), "{text}");
        drop(first);
        assert_eq!(std::fs::read_to_string(ckpt.join(LOCK_FILE)).unwrap(), "", "a clean end empties it");
        let again = RunLock::acquire(&[(ckpt.clone(), DirRole::Checkpoint)]).unwrap();
        assert!(again.stale().is_empty());
    }

    #[test]
    fn a_stale_lock_is_taken_over_and_the_dead_runs_store_files_removed() {
        let dir = tempfile::tempdir().unwrap();
        let dead = Holder { pid: 4_000_000, command: "oogc train --config x.toml".into(), started_unix_s: 1 };
        std::fs::write(dir.path().join(LOCK_FILE), serde_json::to_string(&dead).unwrap()).unwrap();
        let leftover = dir.path().join(format!("{}3-0.swap", oogc_swapper::nvme::store_file_prefix(dead.pid)));
        std::fs::write(&leftover, [0u8; 100]).unwrap();
        let other = dir.path().join("oogc-nvme-4000001-0-0.swap");
        std::fs::write(&other, [0u8; 10]).unwrap();
        let lock = RunLock::acquire(&[(dir.path().into(), DirRole::Nvme)]).unwrap();
        let stale = &lock.stale()[0];
        assert_eq!(stale.holder.as_ref(), Some(&dead));
        assert_eq!((stale.removed_files, stale.removed_bytes), (1, 100));
        assert!(!leftover.exists() && other.exists(), "only the dead holder's files go");
        let now: Holder =
            serde_json::from_str(std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap().trim()).unwrap();
        assert_eq!(now.pid, std::process::id());
    }

    #[test]
    fn a_dead_runs_store_files_count_as_free_until_the_lock_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(stale_store_bytes(dir.path()), 0, "no lock file");
        let dead = Holder { pid: 4_000_000, command: "oogc train".into(), started_unix_s: 1 };
        std::fs::write(dir.path().join(LOCK_FILE), serde_json::to_string(&dead).unwrap()).unwrap();
        let prefix = oogc_swapper::nvme::store_file_prefix(dead.pid);
        std::fs::write(dir.path().join(format!("{prefix}0-0.swap")), [0u8; 100]).unwrap();
        std::fs::write(dir.path().join(format!("{prefix}1-0.swap")), [0u8; 20]).unwrap();
        std::fs::write(dir.path().join("oogc-nvme-4000001-0-0.swap"), [0u8; 10]).unwrap();
        assert_eq!(stale_store_bytes(dir.path()), 120, "the dead holder's files only");
        // Once a live run holds the lock, nothing there is stale.
        let lock = RunLock::acquire(&[(dir.path().into(), DirRole::Nvme)]).unwrap();
        std::fs::write(dir.path().join(format!("{prefix}0-0.swap")), [0u8; 100]).unwrap();
        // Even naming another pid (the flock decides, not the text).
        std::fs::write(dir.path().join(LOCK_FILE), serde_json::to_string(&dead).unwrap()).unwrap();
        assert_eq!(stale_store_bytes(dir.path()), 0, "a held lock");
        drop(lock);
    }

    #[test]
    fn nvme_dirs_on_one_file_system_are_warned_about_and_a_dir_listed_twice_is_locked_once() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let lock = RunLock::acquire(&[
            (a.clone(), DirRole::Nvme),
            (b.clone(), DirRole::Nvme),
            (a.clone(), DirRole::Checkpoint),
        ])
        .unwrap();
        assert_eq!(lock.dirs().count(), 2);
        assert!(lock.warnings().iter().any(|w| w.contains("one file system")), "{:?}", lock.warnings());
    }

    #[test]
    fn utc_formats_a_known_time() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_700_000_000), "2023-11-14 22:13:20 UTC");
        // Leap days, and a century that is not a leap year (`date -u -d @S`).
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(utc(4_107_542_399), "2100-02-28 23:59:59 UTC");
        assert_eq!(utc(4_107_542_400), "2100-03-01 00:00:00 UTC");
    }
}

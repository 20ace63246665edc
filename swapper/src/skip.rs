//! Capability skips: the one way a test (or a harness) says it did not run a part because the
//! machine lacks something — a CUDA device, io_uring, a bind mount, MPI — loud, counted, and
//! refusable.
//!
//! [`skip`] writes `<test>: skipped (<capability>): <why>` to the process's standard error
//! directly (not through `eprintln!`, which the test harness captures), appends the same line to
//! the file named by `OOGC_SKIP_LOG` when it is set (CI prints and checks that file), and panics
//! instead when the capability is required: `OOGC_REQUIRE` lists required capabilities by name,
//! comma-separated (`OOGC_REQUIRE=io_uring,mount`, or `all`); the older `OOGC_REQUIRE_GPU=1` and
//! `OOGC_REQUIRE_URING=1` still require `gpu` and `io_uring`.

use std::io::Write;

/// The environment variable naming the required capabilities (comma-separated, or `all`).
pub const REQUIRE_ENV: &str = "OOGC_REQUIRE";
/// The environment variable naming the file every skip line is appended to.
pub const LOG_ENV: &str = "OOGC_SKIP_LOG";

/// What a machine may lack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capability {
    /// A CUDA device (`gpu`).
    Gpu,
    /// The kernel's io_uring (`io_uring`): refused by seccomp in some containers.
    IoUring,
    /// A read-only bind mount as root (`mount`): needs `CAP_SYS_ADMIN`.
    Mount,
    /// Ranks launched by `mpirun` (`ranks`): the `mpi` feature and Open MPI.
    Ranks,
    /// A git checkout to compare the build's revision with (`git`).
    Git,
}

impl Capability {
    /// Every capability, in the order of their names in messages.
    pub const ALL: [Capability; 5] =
        [Capability::Gpu, Capability::IoUring, Capability::Mount, Capability::Ranks, Capability::Git];

    /// The name used in `OOGC_REQUIRE` and in skip lines.
    pub fn name(self) -> &'static str {
        match self {
            Capability::Gpu => "gpu",
            Capability::IoUring => "io_uring",
            Capability::Mount => "mount",
            Capability::Ranks => "ranks",
            Capability::Git => "git",
        }
    }

    /// Whether the environment requires this capability (`OOGC_REQUIRE`, or the older
    /// per-capability switches).
    pub fn required(self) -> bool {
        let legacy = match self {
            Capability::Gpu => Some("OOGC_REQUIRE_GPU"),
            Capability::IoUring => Some("OOGC_REQUIRE_URING"),
            _ => None,
        };
        if legacy.is_some_and(|v| std::env::var(v).as_deref() == Ok("1")) {
            return true;
        }
        std::env::var(REQUIRE_ENV).is_ok_and(|list| required_by(&list, self))
    }
}

/// Whether the comma-separated `list` (an `OOGC_REQUIRE` value) names `cap` or `all`.
fn required_by(list: &str, cap: Capability) -> bool {
    list.split(',').map(str::trim).any(|n| n == "all" || n == cap.name())
}

/// Says that `test` skipped its part needing `capability`, because `why` — or panics when the
/// environment requires that capability (see the module docs).
///
/// # Panics
/// When `capability` is required: `<test>: <capability> is required (OOGC_REQUIRE) but
/// unavailable: <why>`.
pub fn skip(capability: Capability, test: &str, why: &str) {
    let name = capability.name();
    if capability.required() {
        panic!("{test}: {name} is required ({REQUIRE_ENV} or its OOGC_REQUIRE_* switch) but unavailable: {why}");
    }
    let line = format!("{test}: skipped ({name}): {}\n", why.trim());
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os(LOG_ENV) {
        // One append per line: lines from parallel tests and processes do not interleave.
        let logged = std::fs::OpenOptions::new().create(true).append(true).open(&path);
        if let Err(e) = logged.and_then(|mut f| f.write_all(line.as_bytes())) {
            panic!("{test}: {LOG_ENV}={}: cannot append the skip line: {e}", std::path::Path::new(&path).display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_require_list_names_capabilities_or_all() {
        assert!(required_by("io_uring,mount", Capability::Mount));
        assert!(required_by(" io_uring , mount ", Capability::IoUring));
        assert!(!required_by("io_uring,mount", Capability::Gpu));
        assert!(!required_by("", Capability::Gpu));
        assert!(!required_by("io_uringx", Capability::IoUring));
        for cap in Capability::ALL {
            assert!(required_by("all", cap), "{cap:?}");
        }
    }

    /// In a child process (the variables are process-wide): a skip appends its line to the
    /// log; a required capability panics naming it.
    #[test]
    fn a_skip_is_logged_and_a_required_one_panics() {
        if let Ok(mode) = std::env::var("OOGC_SKIP_CHILD") {
            skip(Capability::Mount, "child", &format!("mode {mode}"));
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("skips.txt");
        let exe = std::env::current_exe().unwrap();
        let run = |require: &str| {
            std::process::Command::new(&exe)
                .args(["--exact", "skip::tests::a_skip_is_logged_and_a_required_one_panics", "--nocapture"])
                .env("OOGC_SKIP_CHILD", require)
                .env(LOG_ENV, &log)
                .env(REQUIRE_ENV, require)
                .output()
                .unwrap()
        };
        let out = run("gpu");
        assert!(out.status.success(), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("child: skipped (mount): mode gpu"), "{out:?}");
        let out = run("mount");
        assert!(!out.status.success(), "a required capability's skip passed: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("mount is required"), "{out:?}");
        assert_eq!(std::fs::read_to_string(&log).unwrap(), "child: skipped (mount): mode gpu\n");
    }
}

//! The device call rehearsed without a GPU: `scripts/device-check.sh` with `OOGC_BIN` this build's
//! binary on the sim device leaves in `$OUT` the five files the README names, within every limit
//! of the device tool (`scripts/check-out-limits.sh`); a gpu-check stopped at the hard limit is
//! packed all the same; the limits checker names each limit a folder breaks; the capped packer
//! (`scripts/pack-capped.sh`) cuts the largest files, keeping a log's head and tail, until the
//! tarball fits, and says so in its manifest.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `scripts/device-check.sh ARGS` with `OUT=out`, its reports and scratch in `dir`, `bin` as the
/// binary and `env` besides.
fn device_check(out: &Path, dir: &Path, bin: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(repo().join("scripts/device-check.sh"))
        .args(args)
        .env("OUT", out)
        .env("OOGC_BIN", bin)
        .env("OOGC_DEVICE_CHECK_DIR", dir)
        .envs(env.iter().copied())
        .output()
        .expect("run scripts/device-check.sh")
}

fn check_limits(dir: &Path, required: &[&str]) -> Output {
    Command::new(repo().join("scripts/check-out-limits.sh")).arg(dir).args(required).output().expect("run the checker")
}

/// The names of the files in `dir` (not recursive), sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// The paths inside a .tar.gz (`tar -tzf`).
fn tar_list(tgz: &Path) -> Vec<String> {
    let o = Command::new("tar").arg("-tzf").arg(tgz).output().unwrap();
    assert!(o.status.success(), "tar -tzf {}: {}", tgz.display(), text(&o.stderr));
    text(&o.stdout).lines().map(str::to_string).collect()
}

/// One file of a .tar.gz, as text (`tar -xzOf`).
fn tar_file(tgz: &Path, path: &str) -> String {
    let o = Command::new("tar").arg("-xzOf").arg(tgz).arg(path).output().unwrap();
    assert!(o.status.success(), "tar -xzOf {} {path}: {}", tgz.display(), text(&o.stderr));
    text(&o.stdout)
}

const FILES: [&str; 5] = ["device-check.log", "env.txt", "gpu-check-files.tar.gz", "gpu-check.jsonl", "gpu-check.md"];

#[test]
fn sim_rehearsal_leaves_five_files_within_the_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, dir) = (tmp.path().join("out"), tmp.path().join("dc"));
    let bin = Path::new(env!("CARGO_BIN_EXE_oogc"));
    let o = device_check(&out, &dir, bin, &["--device", "sim", "--only", "1,2"], &[]);
    let stdout = text(&o.stdout);
    assert!(o.status.success(), "exit {:?}\nstdout:\n{stdout}\nstderr:\n{}", o.status, text(&o.stderr));
    assert_eq!(names(&out), FILES, "$OUT");
    // The script's own check, then the checker run here.
    assert!(stdout.contains("5 files, ") && stdout.contains("within the device tool's limits"), "{stdout}");
    assert!(stdout.contains("==== device-check summary: gpu-check exit 0"), "{stdout}");
    let c = check_limits(&out, &["gpu-check.md", "gpu-check.jsonl", "device-check.log"]);
    assert!(c.status.success(), "{}", text(&c.stdout));

    // The report and the rows, with the binary's revision.
    let rev = text(&Command::new(bin).arg("--version").output().unwrap().stdout);
    let rev = rev.trim().rsplit_once("(rev ").and_then(|(_, r)| r.strip_suffix(')')).unwrap().to_string();
    let md = std::fs::read_to_string(out.join("gpu-check.md")).unwrap();
    assert!(md.contains(&format!("git rev `{rev}`")) && md.contains("- device: `sim`"), "{md}");
    assert!(md.contains("1 passed, 0 failed, 1 skipped"), "{md}");
    let rows: Vec<Value> = std::fs::read_to_string(out.join("gpu-check.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r["git_rev"] == rev.as_str()), "{rows:?}");
    // The whole log holds gpu-check's own lines; env.txt the binary's version.
    let log = std::fs::read_to_string(out.join("device-check.log")).unwrap();
    assert!(log.contains("gpu-check: 1 environment") && log.contains("device-check summary"), "{log}");
    assert!(std::fs::read_to_string(out.join("env.txt")).unwrap().contains(&format!("(rev {rev})")));

    // The tarball: the per-check logs and rows, the checks' subprocess output, the manifest.
    let tgz = out.join("gpu-check-files.tar.gz");
    let list = tar_list(&tgz);
    for p in [
        "gpu-check-files/MANIFEST.txt",
        "gpu-check-files/logs/1-environment.log",
        "gpu-check-files/logs/2-swapper-tests.log",
        "gpu-check-files/rows/1.json",
        "gpu-check-files/work/1-environment/ldd.stdout",
    ] {
        assert!(list.iter().any(|l| l == p), "{p} not in the tarball: {list:?}");
    }
    let manifest = tar_file(&tgz, "gpu-check-files/MANIFEST.txt");
    assert!(manifest.contains("cut or dropped to fit") && manifest.contains("\n  nothing\n"), "{manifest}");
    assert!(manifest.contains("logs/1-environment.log"), "{manifest}");
}

#[test]
fn a_gpu_check_stopped_at_the_hard_limit_is_packed_all_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, dir) = (tmp.path().join("out"), tmp.path().join("dc"));
    // A stand-in for a hung run: it writes the start of a report, a log and partial figures,
    // then never ends (SIGTERM from the script's timeout ends it).
    let fake = tmp.path().join("fake-oogc");
    std::fs::write(
        &fake,
        "#!/bin/bash\n\
         if [ \"$1\" = --version ]; then echo 'oogc 0.0.0 (rev fake)'; exit 0; fi\n\
         out=$3\n\
         mkdir -p \"$out/logs\" \"$out/rows\"\n\
         printf '# oogc gpu-check\\n\\n| 3 | ops | pass | 1.0 | | |\\n' > \"$out/gpu-check.md\"\n\
         echo '{\"id\":3,\"status\":\"pass\"}' > \"$out/gpu-check.jsonl\"\n\
         echo 'check 4 started' > \"$out/logs/4-fixtures.log\"\n\
         echo '{\"notes\":[\"half way\"]}' > \"$out/rows/4.partial.json\"\n\
         exec sleep 300\n",
    )
    .unwrap();
    let mut perms = std::fs::metadata(&fake).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&fake, perms).unwrap();

    let o = device_check(&out, &dir, &fake, &["--device", "sim"], &[("OOGC_DEVICE_CHECK_LIMIT_S", "2")]);
    let stdout = text(&o.stdout);
    assert_eq!(o.status.code(), Some(124), "timeout's status is the script's\n{stdout}\n{}", text(&o.stderr));
    assert!(stdout.contains("stopped at the hard limit of 2 s"), "{stdout}");
    assert!(stdout.contains("(no summary line: gpu-check did not finish)"), "{stdout}");
    assert_eq!(names(&out), FILES);
    let c = check_limits(&out, &["gpu-check.md", "gpu-check.jsonl", "device-check.log"]);
    assert!(c.status.success(), "{}", text(&c.stdout));
    assert!(std::fs::read_to_string(out.join("gpu-check.md")).unwrap().contains("| 3 | ops | pass"));
    let tgz = out.join("gpu-check-files.tar.gz");
    assert_eq!(tar_file(&tgz, "gpu-check-files/logs/4-fixtures.log"), "check 4 started\n");
    assert!(tar_file(&tgz, "gpu-check-files/rows/4.partial.json").contains("half way"));
}

#[test]
fn the_limits_checker_names_each_broken_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let ok = tmp.path().join("ok");
    std::fs::create_dir_all(ok.join("a/b")).unwrap();
    std::fs::write(ok.join("gpu-check.md"), "# report\n").unwrap();
    std::fs::write(ok.join("a/b/deepest-allowed.txt"), "x").unwrap();
    let c = check_limits(&ok, &["gpu-check.md"]);
    assert!(c.status.success(), "{}", text(&c.stdout));

    let bad = tmp.path().join("bad");
    std::fs::create_dir_all(bad.join("a/b/c")).unwrap();
    std::fs::write(bad.join("a/b/c/too-deep.txt"), "x").unwrap();
    std::fs::write(bad.join("bad name.txt"), "x").unwrap();
    std::fs::write(bad.join("not-a.tar.gz"), "plain text").unwrap();
    std::fs::write(bad.join("ninth-file.txt"), "x").unwrap();
    std::os::unix::fs::symlink("/etc/hostname", bad.join("link")).unwrap();
    // Sparse files: their sizes count, no disk is written.
    for i in 0..5 {
        let f = std::fs::File::create(bad.join(format!("big{i}.bin"))).unwrap();
        f.set_len(if i == 0 { 17 << 20 } else { 15 << 20 }).unwrap();
    }
    let c = check_limits(&bad, &["gpu-check.md"]);
    let stdout = text(&c.stdout);
    assert_eq!(c.status.code(), Some(1), "{stdout}");
    for expected in [
        "a/b/c/: a folder 3 deep",
        "a/b/c/too-deep.txt: 3 folders deep",
        "the name 'bad name.txt' has characters",
        "link: a symbolic link",
        "big0.bin: 17825792 bytes (each file under 16777216",
        "not-a.tar.gz: not a readable gzip'd tar",
        "9 files (at most 8)",
        "bytes in all (at most 67108864",
        "gpu-check.md: missing or empty (required)",
        "LIMITS BROKEN",
    ] {
        assert!(stdout.contains(expected), "no `{expected}` in:\n{stdout}");
    }
}

#[test]
fn the_packer_cuts_the_largest_files_until_the_tarball_fits() {
    let tmp = tempfile::tempdir().unwrap();
    let stage = tmp.path().join("files");
    std::fs::create_dir_all(stage.join("logs")).unwrap();
    std::fs::create_dir_all(stage.join("rows")).unwrap();
    // 2 MB of pseudo-random hex digits (splitmix64): about 1 MB compressed, far over the cap.
    let mut state = 1u64;
    let big: String = (0..125_000)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            format!("{:016x}", z ^ (z >> 31))
        })
        .collect();
    std::fs::write(stage.join("logs/big.log"), &big).unwrap();
    std::fs::write(stage.join("logs/small.log"), "a small log\n").unwrap();
    std::fs::write(stage.join("rows/1.json"), "{\"id\":1}\n").unwrap();
    let tgz = tmp.path().join("files.tar.gz");
    let cap = 200_000u64;
    let o = Command::new(repo().join("scripts/pack-capped.sh"))
        .arg(&tgz)
        .arg(cap.to_string())
        .arg(&stage)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}\n{}", text(&o.stdout), text(&o.stderr));
    let size = std::fs::metadata(&tgz).unwrap().len();
    assert!(size <= cap, "{size} bytes over the cap {cap}");
    let list = tar_list(&tgz);
    for p in ["files/MANIFEST.txt", "files/logs/big.log", "files/logs/small.log", "files/rows/1.json"] {
        assert!(list.iter().any(|l| l == p), "{p} not in {list:?}");
    }
    // The cut log keeps its head and its tail, and says what went.
    let cut = tar_file(&tgz, "files/logs/big.log");
    assert!(cut.len() < big.len() / 4, "{} of {} bytes kept", cut.len(), big.len());
    assert!(cut.starts_with(&big[..1000]) && cut.ends_with(&big[big.len() - 1000..]));
    assert!(cut.contains("bytes cut here by scripts/pack-capped.sh"));
    let manifest = tar_file(&tgz, "files/MANIFEST.txt");
    assert!(manifest.contains("cut logs/big.log from 2000000 to "), "{manifest}");
    assert!(manifest.contains("     2000000  logs/big.log"), "the size as found: {manifest}");
    assert_eq!(tar_file(&tgz, "files/rows/1.json"), "{\"id\":1}\n");
}

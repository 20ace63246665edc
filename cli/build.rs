//! Embeds the git revision the binary is built from as `OOGC_GIT_REV` (`oogc --version`, every
//! `oogc gpu-check` row and its report's header): `git rev-parse --short=12 HEAD`, with `-dirty`
//! when a tracked file differs from HEAD (`git status --porcelain --untracked-files=no`), else
//! `unknown` (no git, or not a checkout). `OOGC_GIT_REV` set in the build's environment wins (a
//! build from a source archive can name its revision). `OOGC_GIT_REV_FROM` says which (`git`,
//! `env`, `unknown`).
//!
//! Rebuilt when HEAD moves (HEAD, the branch's ref, packed-refs), the index changes, or a file of
//! a workspace member changes (what makes the tree dirty for the binary's code); an edit to
//! another tracked file (README.md) alone shows up at the next of those.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=OOGC_GIT_REV");
    let (rev, from) = match std::env::var("OOGC_GIT_REV") {
        Ok(r) if !r.trim().is_empty() => (r.trim().to_string(), "env"),
        _ => git_rev().map_or(("unknown".into(), "unknown"), |r| (r, "git")),
    };
    println!("cargo:rustc-env=OOGC_GIT_REV={rev}");
    // Where it came from (`git`, `env` or `unknown`), for the test that compares it with git: cargo
    // also sets OOGC_GIT_REV when it runs the package's tests, so that variable cannot tell.
    println!("cargo:rustc-env=OOGC_GIT_REV_FROM={from}");
}

/// `git` in the workspace root, its trimmed stdout when it succeeds.
fn git(root: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").arg("-C").arg(root).args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn git_rev() -> Option<String> {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR")?);
    let root = manifest.parent()?.to_path_buf();
    let short = git(&root, &["rev-parse", "--short=12", "HEAD"]).filter(|s| !s.is_empty())?;
    // What moves HEAD or changes the index (a worktree's HEAD and index are its own; refs are
    // in the common directory). Only paths that exist: cargo reruns a script whose named path is
    // missing at every build.
    let mut watched: Vec<PathBuf> = Vec::new();
    let branch = git(&root, &["symbolic-ref", "-q", "HEAD"]);
    for p in ["HEAD", "index", "packed-refs"].into_iter().chain(branch.as_deref()) {
        if let Some(path) = git(&root, &["rev-parse", "--path-format=absolute", "--git-path", p]) {
            watched.push(path.into());
        }
    }
    // Each workspace member's Rust sources (not the whole tree: target/ changes with every build).
    for member in workspace_members(&root) {
        for p in ["src", "Cargo.toml", "build.rs"] {
            watched.push(root.join(&member).join(p));
        }
    }
    watched.push(root.join("Cargo.lock"));
    for path in watched.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let dirty = git(&root, &["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    Some(if dirty { format!("{short}-dirty") } else { short })
}

/// The `members = [...]` of the workspace's Cargo.toml (quoted paths), empty when unreadable.
fn workspace_members(root: &Path) -> Vec<String> {
    let Ok(toml) = std::fs::read_to_string(root.join("Cargo.toml")) else { return Vec::new() };
    let Some(start) = toml.find("\nmembers") else { return Vec::new() };
    let rest = &toml[start..];
    let Some(list) = rest.split_once('[').and_then(|(_, r)| r.split_once(']')).map(|(l, _)| l) else {
        return Vec::new();
    };
    list.split(',').map(|s| s.trim().trim_matches('"').to_string()).filter(|s| !s.is_empty()).collect()
}

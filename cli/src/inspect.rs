//! `oogc inspect`: a checkpoint's step, metadata and tensors; with `--verify`, the checksums of
//! every checkpoint in a directory (or of one file).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use oogc::checksum::Verification;

#[derive(Debug, Args)]
pub(crate) struct InspectCmd {
    /// A checkpoint file or directory.
    pub(crate) path: PathBuf,
    /// Verify the checksums (a crc32c per tensor and one for the file) of the file, or of every
    /// checkpoint in the directory: one line each; exit status 1 if any fails.
    #[arg(long)]
    pub(crate) verify: bool,
}

/// `--verify`: one line per checkpoint; an error when one fails.
fn verify(cmd: &InspectCmd) -> anyhow::Result<ExitCode> {
    let files = if cmd.path.is_dir() {
        let all = oogc::checkpoint::list(&cmd.path).context("oogc inspect --verify")?;
        anyhow::ensure!(!all.is_empty(), "no checkpoint (ckpt-*.safetensors) in {}", cmd.path.display());
        all.into_iter().rev().map(|(_, p)| p).collect()
    } else {
        vec![cmd.path.clone()]
    };
    let mut bad = 0;
    for f in &files {
        match oogc::checkpoint::verify(f) {
            Ok(Verification::Verified { tensors, bytes }) => {
                println!("ok        {}: {tensors} tensors, {bytes} bytes, crc32c verified", f.display())
            }
            Ok(Verification::Unverified) => println!(
                "unverified {}: no checksums (written before oogc checked them); it loads, but cannot be verified",
                f.display()
            ),
            Err(e) => {
                bad += 1;
                println!("CORRUPT   {e}");
            }
        }
    }
    anyhow::ensure!(bad == 0, "{bad} of {} checkpoints fail verification (see above)", files.len());
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn inspect(cmd: InspectCmd) -> anyhow::Result<ExitCode> {
    use std::fmt::Write as _;
    use std::io::Write as _;
    if cmd.verify {
        return verify(&cmd);
    }
    // The header, then one parameter's master weights at a time (checked as they are read).
    let ckpt = oogc::checkpoint::AnyReader::open(&cmd.path).context("oogc inspect")?;
    // Every tensor's crc32c first (through a fixed buffer), as a resume would find them.
    ckpt.verify().context("oogc inspect")?;
    let is_state =
        |name: &str| name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq") || name.ends_with(".absmax");
    let mut names = ckpt.names();
    names.sort();
    let numel = |name: &str| ckpt.info(name).map_or(0, |(_, shape)| shape.iter().product::<usize>());
    let mut out = String::new();
    writeln!(out, "step: {}", ckpt.step().context("oogc inspect")?)?;
    for (k, v) in ckpt.metadata().iter().filter(|(k, _)| *k != "config") {
        writeln!(out, "{k}: {v}")?;
    }
    let params: usize = names.iter().filter(|n| !is_state(n)).map(|n| numel(n)).sum();
    writeln!(out, "tensors: {} ({} parameters, {} bytes in all)", names.len(), params, ckpt.data_bytes())?;
    for name in names.iter().filter(|n| !is_state(n)) {
        let t = ckpt.tensor(name).context("oogc inspect")?.expect("a name of the file");
        let data = t.data.into_f32().unwrap_or_default();
        let n = data.len().max(1) as f64;
        let rms = (data.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>() / n).sqrt();
        let finite = data.iter().all(|x| x.is_finite());
        writeln!(out, "  {:<40} {:?} rms {rms:.4e}{}", t.name, t.shape, if finite { "" } else { "  NOT FINITE" })?;
    }
    // A closed pipe (`| head`) is not an error.
    match std::io::stdout().write_all(out.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(ExitCode::SUCCESS),
        r => Ok(r.map(|()| ExitCode::SUCCESS)?),
    }
}

//! `oogc inspect`: a checkpoint's step, metadata and tensors.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

#[derive(Debug, Args)]
pub(crate) struct InspectCmd {
    /// A checkpoint file or directory.
    pub(crate) path: PathBuf,
}

pub(crate) fn inspect(cmd: InspectCmd) -> anyhow::Result<()> {
    use std::fmt::Write as _;
    use std::io::Write as _;
    let ckpt = oogc::checkpoint::load(&cmd.path).context("oogc inspect")?;
    let is_state = |name: &str| name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq");
    let mut out = String::new();
    writeln!(out, "step: {}", ckpt.step)?;
    for (k, v) in ckpt.metadata.iter().filter(|(k, _)| *k != "config") {
        writeln!(out, "{k}: {v}")?;
    }
    let params: usize = ckpt.tensors.iter().filter(|t| !is_state(&t.name)).map(|t| t.data.len()).sum();
    writeln!(out, "tensors: {} ({} parameters, {} bytes in all)", ckpt.tensors.len(), params, ckpt.num_bytes())?;
    for t in ckpt.tensors.iter().filter(|t| !is_state(&t.name)) {
        let n = t.data.len().max(1) as f64;
        let rms = (t.data.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>() / n).sqrt();
        let finite = t.data.iter().all(|x| x.is_finite());
        writeln!(out, "  {:<40} {:?} rms {rms:.4e}{}", t.name, t.shape, if finite { "" } else { "  NOT FINITE" })?;
    }
    // A closed pipe (`| head`) is not an error.
    match std::io::stdout().write_all(out.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

//! `oogc train --dump-batches FILE`: every step's token windows as the sampler handed them to the
//! trainer, so that another implementation (python/tests/test_trainer_vs_torch.py: PyTorch) can
//! train on exactly the same batches. The file's format: [`BatchDump`].

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::data::Batch;

use super::{Result, TrainError};

/// An open `--dump-batches` file.
///
/// The file is JSON Lines, one object per micro-batch of each step, in the order they are trained:
///
/// ```text
/// {"step":1,"micro":0,"inputs":[[ids of sequence 0], ...],"targets":[[...], ...]}
/// ```
///
/// `step` is 1-based (as in the metrics file), `micro` in `0..[train] micro_batches`; `inputs`
/// and `targets` hold `batch_size` rows of `seq_len` token ids each (integers, exact). The
/// sampler draws windows of `seq_len + 1` tokens: `inputs` is a window's first `seq_len`,
/// `targets` its last `seq_len` (the inputs shifted by one), and every target counts in the loss
/// (mean cross-entropy over all of the step's targets). A step's `k` micro-batches are one batch
/// of `k × batch_size` windows cut in order: micro-batch `m` has windows `m × batch_size ..
/// (m + 1) × batch_size`. The file holds the steps of one invocation (created or truncated at
/// its start: a resumed run's file begins at the step after its checkpoint); each line is
/// flushed before the step computes, so a step that fails is in it.
#[derive(Debug)]
pub struct BatchDump {
    path: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
}

/// One line of the file.
#[derive(serde::Serialize)]
struct Line<'a> {
    step: u64,
    micro: usize,
    inputs: Vec<&'a [u32]>,
    targets: Vec<&'a [u32]>,
}

impl BatchDump {
    /// Creates (or truncates) `path`.
    ///
    /// # Errors
    /// [`TrainError::BatchDump`] naming the path when it cannot be created (a missing
    /// directory, no permission).
    pub fn create(path: &Path) -> Result<Self> {
        let file = std::fs::File::create(path).map_err(|e| io_error(path, &e))?;
        Ok(Self { path: path.into(), out: std::io::BufWriter::new(file) })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes step `step`'s batch, cut into `micro_batches` micro-batches of equal size (one line
    /// each), and flushes.
    ///
    /// # Errors
    /// [`TrainError::BatchDump`] naming the path when a write fails (a full disk).
    ///
    /// # Panics
    /// If `micro_batches` is 0 or does not divide the batch's sequences.
    pub fn write_step(&mut self, step: u64, batch: &Batch, micro_batches: usize) -> Result<()> {
        let rows = batch.batch_size;
        assert!(micro_batches > 0 && rows % micro_batches == 0, "{rows} sequences in {micro_batches} micro-batches");
        let per_micro = rows / micro_batches;
        let seq = batch.seq_len;
        for micro in 0..micro_batches {
            let range = micro * per_micro * seq..(micro + 1) * per_micro * seq;
            let line = Line {
                step,
                micro,
                inputs: batch.inputs[range.clone()].chunks(seq).collect(),
                targets: batch.targets[range].chunks(seq).collect(),
            };
            serde_json::to_writer(&mut self.out, &line)
                .map_err(std::io::Error::from)
                .and_then(|()| self.out.write_all(b"\n"))
                .map_err(|e| io_error(&self.path, &e))?;
        }
        self.out.flush().map_err(|e| io_error(&self.path, &e))
    }
}

/// [`TrainError::BatchDump`] for an I/O error on `path`.
fn io_error(path: &Path, e: &std::io::Error) -> TrainError {
    TrainError::BatchDump {
        path: path.into(),
        reason: format!("{e}\n  fix: name a file in a directory that exists and is writable, on a disk with room"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Split;

    #[derive(serde::Deserialize)]
    struct Read {
        step: u64,
        micro: usize,
        inputs: Vec<Vec<u32>>,
        targets: Vec<Vec<u32>>,
    }

    #[test]
    fn each_micro_batch_is_a_line_of_the_samplers_windows_inputs_and_shifted_targets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("batches.jsonl");
        let text: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
        let split = Split::bytes(&text);
        let mut sampler = crate::data::Sampler::new(7);
        let (seq, rows, k) = (5, 4, 2);
        let mut dump = BatchDump::create(&path).unwrap();
        let batches: Vec<Batch> = (1..=3).map(|_| sampler.sample(&split, rows, seq)).collect();
        for (i, b) in batches.iter().enumerate() {
            dump.write_step(i as u64 + 1, b, k).unwrap();
        }
        drop(dump);
        let lines: Vec<Read> =
            std::fs::read_to_string(&path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 3 * k);
        for (n, line) in lines.iter().enumerate() {
            let (b, micro) = (&batches[n / k], n % k);
            assert_eq!((line.step, line.micro), ((n / k) as u64 + 1, micro));
            assert_eq!(line.inputs.len(), rows / k);
            for (r, (inp, tgt)) in line.inputs.iter().zip(&line.targets).enumerate() {
                let row = micro * rows / k + r;
                assert_eq!(inp.as_slice(), &b.inputs[row * seq..(row + 1) * seq]);
                assert_eq!(tgt.as_slice(), &b.targets[row * seq..(row + 1) * seq]);
                // A window of seq + 1 consecutive tokens of the text: the targets are the inputs
                // shifted by one.
                assert_eq!(&inp[1..], &tgt[..seq - 1]);
                assert_eq!(tgt[seq - 1], (inp[seq - 1] + 1) % 256);
            }
        }
        // Created afresh: a second dump truncates.
        BatchDump::create(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap().len(), 0);
    }

    #[test]
    fn an_unwritable_path_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing").join("batches.jsonl");
        let e = BatchDump::create(&path).unwrap_err().to_string();
        assert!(e.contains("missing/batches.jsonl") && e.contains("fix:"), "{e}");
    }
}

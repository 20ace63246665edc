//! Training text: bytes are tokens (vocabulary 256), a train/validation split, and a seeded batch
//! sampler whose state is saved in checkpoints so a resumed run sees the same batches.

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Where to get the text the README's main job trains on.
pub const TINYSHAKESPEARE_URL: &str =
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt";

/// The text cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file is missing or unreadable.
    #[error(
        "cannot read training text {path}: {source}\n  fix: set [data] path in the config (relative to the config file) \
         to a text file; the example configs expect ../shared/data/tinyshakespeare.txt beside the repository \
         (download it from {TINYSHAKESPEARE_URL})"
    )]
    Read {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is too short for one training and one validation sequence.
    #[error(
        "training text {path} has {len} bytes; a split with val_fraction {val_fraction} needs at least {needed} \
         (seq_len + 1 tokens on each side)\n  fix: use a longer text or a shorter train.seq_len"
    )]
    TooShort {
        /// The path.
        path: PathBuf,
        /// Bytes in the file.
        len: usize,
        /// Bytes needed.
        needed: usize,
        /// The configured fraction.
        val_fraction: f64,
    },
}

/// A byte-level corpus split into a training head and a validation tail.
#[derive(Debug, Clone)]
pub struct TextData {
    path: PathBuf,
    bytes: Vec<u8>,
    split: usize,
}

impl TextData {
    /// Reads `path` and holds out its last `val_fraction` for validation.
    ///
    /// # Errors
    /// [`DataError::Read`] when the file is missing or unreadable; [`DataError::TooShort`] when
    /// either side of the split is shorter than `seq_len + 1` bytes (an empty file included).
    pub fn load(path: &Path, val_fraction: f64, seq_len: usize) -> Result<Self, DataError> {
        let bytes = std::fs::read(path).map_err(|source| DataError::Read { path: path.to_path_buf(), source })?;
        Self::from_bytes(path, bytes, val_fraction, seq_len)
    }

    /// As [`TextData::load`], from bytes already in memory (`path` names them in errors).
    ///
    /// # Errors
    /// [`DataError::TooShort`].
    pub fn from_bytes(path: &Path, bytes: Vec<u8>, val_fraction: f64, seq_len: usize) -> Result<Self, DataError> {
        let len = bytes.len();
        let split = ((len as f64) * (1.0 - val_fraction)).round() as usize;
        if split < seq_len + 1 || len - split.min(len) < seq_len + 1 {
            let needed = ((seq_len + 1) as f64 / val_fraction.min(1.0 - val_fraction)).ceil() as usize;
            return Err(DataError::TooShort { path: path.to_path_buf(), len, needed, val_fraction });
        }
        Ok(Self { path: path.to_path_buf(), bytes, split })
    }

    /// The file the text came from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Training bytes.
    pub fn train(&self) -> &[u8] {
        &self.bytes[..self.split]
    }

    /// Validation bytes.
    pub fn val(&self) -> &[u8] {
        &self.bytes[self.split..]
    }

    /// Entropy of the training text's byte frequencies (unigram model), in nats per byte: the
    /// loss a model that ignores context cannot beat.
    pub fn unigram_entropy_nats(&self) -> f64 {
        let mut counts = [0u64; 256];
        self.train().iter().for_each(|&b| counts[b as usize] += 1);
        let n = self.train().len() as f64;
        counts.iter().filter(|&&c| c > 0).map(|&c| c as f64 / n).map(|p| -p * p.ln()).sum()
    }
}

/// A batch: `inputs` and `targets` are `[batch, seq_len]` row-major token ids; `targets` is
/// `inputs` shifted by one byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Sequences.
    pub batch_size: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// `batch_size × seq_len` input tokens.
    pub inputs: Vec<u32>,
    /// `batch_size × seq_len` next tokens.
    pub targets: Vec<u32>,
}

/// Samples random windows of a byte slice with a ChaCha8 generator; its state is serializable so
/// a checkpoint records the data position exactly.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Sampler {
    rng: ChaCha8Rng,
}

impl Sampler {
    /// A sampler seeded from `seed` (the same seed gives the same batches).
    pub fn new(seed: u64) -> Self {
        Self { rng: ChaCha8Rng::seed_from_u64(seed) }
    }

    /// The next batch of `batch_size` windows of `seq_len + 1` bytes of `text`.
    ///
    /// # Panics
    /// If `text.len() < seq_len + 1` ([`TextData`] guarantees it is not).
    pub fn next_batch(&mut self, text: &[u8], batch_size: usize, seq_len: usize) -> Batch {
        assert!(text.len() > seq_len, "text of {} bytes is shorter than seq_len + 1", text.len());
        let mut inputs = Vec::with_capacity(batch_size * seq_len);
        let mut targets = Vec::with_capacity(batch_size * seq_len);
        for _ in 0..batch_size {
            let start = self.rng.random_range(0..text.len() - seq_len);
            let w = &text[start..start + seq_len + 1];
            inputs.extend(w[..seq_len].iter().map(|&b| b as u32));
            targets.extend(w[1..].iter().map(|&b| b as u32));
        }
        Batch { batch_size, seq_len, inputs, targets }
    }
}

/// Fixed validation batches: evenly spaced windows of the validation text, the same every
/// evaluation so the losses are comparable across steps.
pub fn validation_batches(data: &TextData, batches: usize, batch_size: usize, seq_len: usize) -> Vec<Batch> {
    let val = data.val();
    let windows = batches * batch_size;
    let span = val.len() - seq_len;
    (0..batches)
        .map(|b| {
            let mut inputs = Vec::with_capacity(batch_size * seq_len);
            let mut targets = Vec::with_capacity(batch_size * seq_len);
            for i in 0..batch_size {
                let k = b * batch_size + i;
                let start = (k * span) / windows.max(1);
                inputs.extend(val[start..start + seq_len].iter().map(|&x| x as u32));
                targets.extend(val[start + 1..start + seq_len + 1].iter().map(|&x| x as u32));
            }
            Batch { batch_size, seq_len, inputs, targets }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_batches_and_resume_position() {
        let text: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let data = TextData::from_bytes(Path::new("t"), text, 0.1, 8).unwrap();
        assert_eq!(data.train().len(), 900);
        assert_eq!(data.val().len(), 100);
        let mut s = Sampler::new(7);
        let b = s.next_batch(data.train(), 3, 8);
        assert_eq!(b.inputs.len(), 24);
        for r in 0..3 {
            assert_eq!(&b.inputs[r * 8 + 1..r * 8 + 8], &b.targets[r * 8..r * 8 + 7]);
        }
        // Saving the sampler and restoring it continues the same sequence.
        let saved = serde_json::to_string(&s).unwrap();
        let next = s.next_batch(data.train(), 3, 8);
        let mut restored: Sampler = serde_json::from_str(&saved).unwrap();
        assert_eq!(restored.next_batch(data.train(), 3, 8), next);
        let v = validation_batches(&data, 2, 3, 8);
        assert_eq!(v.len(), 2);
        assert!(v.iter().all(|b| b.targets.len() == 24));
    }

    #[test]
    fn short_or_missing_text_is_a_clear_error() {
        let err = TextData::from_bytes(Path::new("t.txt"), vec![], 0.1, 8).unwrap_err().to_string();
        assert!(err.contains("t.txt") && err.contains("0 bytes"), "{err}");
        let err = TextData::load(Path::new("/nonexistent/x.txt"), 0.1, 8).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/x.txt") && err.contains("tinyshakespeare"), "{err}");
    }

    #[test]
    fn unigram_entropy_of_uniform_bytes_is_ln_256() {
        let text: Vec<u8> = (0..256 * 20).map(|i| (i % 256) as u8).collect();
        let data = TextData::from_bytes(Path::new("t"), text, 0.1, 8).unwrap();
        // The training head is not a whole number of periods; entropy is close to ln 256.
        assert!((data.unigram_entropy_nats() - 256f64.ln()).abs() < 1e-3);
    }
}

//! Tiers, tensor ids and tensor metadata.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Where bytes live: the three tiers of oogc, fastest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// GPU memory (or the sim device's enforced-capacity host memory).
    Device,
    /// Pinned (page-locked) host memory.
    Host,
    /// Files on NVMe drives.
    Nvme,
}

impl Tier {
    /// All tiers, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Nvme];

    /// Index of the tier in [`Tier::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The next slower tier, if any.
    pub fn below(self) -> Option<Tier> {
        match self {
            Tier::Device => Some(Tier::Host),
            Tier::Host => Some(Tier::Nvme),
            Tier::Nvme => None,
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Nvme => "nvme",
        })
    }
}

/// A tensor's identity in the swapper, chosen by the caller (unique per manager).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorId(pub u64);

impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Element type of a tensor's bytes. The swapper moves bytes; the dtype only sizes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// bfloat16.
    BF16,
    /// IEEE half.
    F16,
    /// Raw bytes.
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }

    /// Bytes of `numel` elements of this type: the one way a buffer's size follows from its
    /// element count (compute copies, gradients, staging, checkpoints, budgets).
    pub fn num_bytes(self, numel: usize) -> usize {
        numel * self.size_in_bytes()
    }

    /// Whether it is a floating-point type (`f32`, `bf16`, `f16`): what gradients, compute
    /// copies and optimizer state may be.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::U8)
    }

    /// Lowercase name (`f32`, `bf16`, `f16`, `u8`), as in configs.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U8 => "u8",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a unit's state lives between its uses: its home tier below the device (ZeRO-Infinity's
/// `offload_optimizer.device` / `offload_param.device`: `cpu` or `nvme`). Used for the optimizer
/// state (fp32 master weights, Adam `m` and `v`) and for the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StatePlacement {
    /// Host memory.
    #[default]
    Host,
    /// The NVMe store, streamed in chunks through host memory when used.
    Nvme,
}

impl StatePlacement {
    /// The tier it names: [`Tier::Host`] or [`Tier::Nvme`].
    pub fn tier(self) -> Tier {
        match self {
            StatePlacement::Host => Tier::Host,
            StatePlacement::Nvme => Tier::Nvme,
        }
    }
}

/// What the swapper knows of a tensor: its id, name, shape, dtype and home tier.
///
/// The *home* tier is where the authoritative copy lives when nothing needs it: [`Tier::Host`]
/// (pinned host memory, never evicted below it) or [`Tier::Nvme`] (host copies are a cache that
/// is written back on eviction). A tensor is never homed on the device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Identity, unique per manager.
    pub id: TensorId,
    /// Human-readable name (for errors and traces), e.g. `blocks.3.attn.qkv.weight`.
    pub name: String,
    /// Shape in elements.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Home tier: `Host` or `Nvme`.
    pub home: Tier,
}

impl TensorMeta {
    /// A tensor of `shape` elements of `dtype`, homed on `home`.
    pub fn new(id: TensorId, name: impl Into<String>, shape: &[usize], dtype: DType, home: Tier) -> Self {
        Self { id, name: name.into(), shape: shape.to_vec(), dtype, home }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.len() * self.dtype.size_in_bytes()
    }
}

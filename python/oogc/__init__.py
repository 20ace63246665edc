"""oogc: out-of-GPU-core training for PyTorch.

The low-level API mirrors the Rust ``Runtime`` (see ``oogc._oogc``); ``oogc.torch.offload``
wraps a ``torch.nn.Module`` on top of it.
"""

from oogc._oogc import (
    ConfigError,
    DeviceError,
    Fetched,
    OogcError,
    OutOfMemoryError,
    Runtime,
    StorageError,
    UsageError,
    world,
)

__all__ = [
    "ConfigError",
    "DeviceError",
    "Fetched",
    "OogcError",
    "OutOfMemoryError",
    "Runtime",
    "StorageError",
    "UsageError",
    "world",
]

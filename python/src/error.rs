//! The crate's one error type ([`Error`]) and the Python exceptions it becomes, with the Rust
//! error's message unchanged:
//!
//! | exception | raised for |
//! |---|---|
//! | `OogcError` | the base of all below; anything else the runtime reports |
//! | `ConfigError` | a bad config key or value (dict, TOML, the swapper's or optimizer's checks) |
//! | `UsageError` | a call out of order or with a wrong argument: unknown unit, wrong dtype, shape or length, a released fetch |
//! | `OutOfMemoryError` | a budget below the minimum working set, a tier out of memory |
//! | `StorageError` | NVMe: a bad directory, an I/O error, a corrupt block, io_uring refused |
//! | `DeviceError` | no CUDA device, CUDA not compiled in, a driver error |

use oogc::optimizer::Error as OptimizerError;
use oogc::prefetch::Error as PrefetchError;
use oogc::runtime::RuntimeError;
use oogc::swapper::Error as SwapperError;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::PyErr;

create_exception!(_oogc, OogcError, PyException, "Every error oogc raises; the message is the Rust error's.");
create_exception!(_oogc, ConfigError, OogcError, "A bad config key or value; the message names the key.");
create_exception!(
    _oogc,
    UsageError,
    OogcError,
    "A call out of order or with a wrong argument (unknown unit, dtype, shape, length, a released fetch)."
);
create_exception!(
    _oogc,
    OutOfMemoryError,
    OogcError,
    "A budget below the minimum working set, or a tier out of memory; the message gives the bytes."
);
create_exception!(_oogc, StorageError, OogcError, "NVMe: a bad directory, an I/O error, a corrupt block.");
create_exception!(_oogc, DeviceError, OogcError, "No CUDA device, CUDA not compiled in, a driver error.");

/// What the bindings report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The runtime failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A bad config (the message names the key).
    #[error("{0}")]
    Config(String),
    /// A call out of order or with a wrong argument.
    #[error("{0}")]
    Usage(String),
    /// A Python call made on the caller's behalf raised (torch's, `__dlpack__`).
    #[error(transparent)]
    Python(#[from] PyErr),
}

/// Result of the bindings.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which exception a runtime error becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Other,
    Config,
    Usage,
    OutOfMemory,
    Storage,
    Device,
}

fn swapper_kind(e: &SwapperError) -> Kind {
    match e {
        SwapperError::OutOfMemory { .. } => Kind::OutOfMemory,
        SwapperError::NotCompiledWithCuda
        | SwapperError::NoCudaDevice { .. }
        | SwapperError::Cuda { .. }
        | SwapperError::Device(_)
        | SwapperError::Ordering { .. } => Kind::Device,
        SwapperError::NvmeDir { .. }
        | SwapperError::Io { .. }
        | SwapperError::Corrupt { .. }
        | SwapperError::UringUnavailable { .. } => Kind::Storage,
        SwapperError::Config { .. } => Kind::Config,
        SwapperError::UnknownTensor(_) | SwapperError::DuplicateTensor(_) | SwapperError::InvalidRequest(_) => {
            Kind::Usage
        }
        #[allow(unreachable_patterns)]
        _ => Kind::Other,
    }
}

fn optimizer_kind(e: &OptimizerError) -> Kind {
    match e {
        OptimizerError::Config { .. } | OptimizerError::IsaUnavailable { .. } | OptimizerError::NoNvmeStore { .. } => {
            Kind::Config
        }
        OptimizerError::LengthMismatch { .. }
        | OptimizerError::UnknownUnit { .. }
        | OptimizerError::DuplicateUnit { .. }
        | OptimizerError::Protocol(_) => Kind::Usage,
        OptimizerError::Swapper { source, .. } => swapper_kind(source),
        #[allow(unreachable_patterns)]
        _ => Kind::Other,
    }
}

fn prefetch_kind(e: &PrefetchError) -> Kind {
    match e {
        PrefetchError::BudgetBelowWorkingSet { .. } => Kind::OutOfMemory,
        PrefetchError::Config { .. } => Kind::Config,
        PrefetchError::Swapper(s) => swapper_kind(s),
        #[allow(unreachable_patterns)]
        _ => Kind::Other,
    }
}

fn runtime_kind(e: &RuntimeError) -> Kind {
    match e {
        RuntimeError::Swapper(s) => swapper_kind(s),
        RuntimeError::Optimizer(o) => optimizer_kind(o),
        RuntimeError::Prefetch(p) => prefetch_kind(p),
        RuntimeError::BudgetBelowWorkingSet { .. } => Kind::OutOfMemory,
        RuntimeError::Usage(_) => Kind::Usage,
        #[allow(unreachable_patterns)]
        _ => Kind::Other,
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        let kind = match &e {
            Error::Runtime(r) => runtime_kind(r),
            Error::Config(_) => Kind::Config,
            Error::Usage(_) => Kind::Usage,
            Error::Python(_) => {
                let Error::Python(err) = e else { unreachable!() };
                return err;
            }
        };
        let message = e.to_string();
        match kind {
            Kind::Other => OogcError::new_err(message),
            Kind::Config => ConfigError::new_err(message),
            Kind::Usage => UsageError::new_err(message),
            Kind::OutOfMemory => OutOfMemoryError::new_err(message),
            Kind::Storage => StorageError::new_err(message),
            Kind::Device => DeviceError::new_err(message),
        }
    }
}

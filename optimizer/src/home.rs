//! Where each unit's compute copy lives: its one home, which the optimizer writes the new copy
//! into ([`ComputeCopyHome`]). The runtime's home is the residency manager's host copy (itself a
//! cache of an NVMe home when parameters live on NVMe), so a unit's compute copy exists once in
//! host memory, not once there and once in the optimizer. [`MemoryHome`] is the home of an
//! optimizer used on its own (tests, benchmarks): one `Vec` per unit.
//!
//! The optimizer keeps a second copy only for speculation (the new copy of a speculated unit,
//! written while the step is open and published into the home once the step is final), within
//! the roll-back budget.

use std::collections::HashMap;
use std::sync::Arc;

use oogc_swapper::TensorId;
use parking_lot::{Mutex, RwLock};

/// The home of the units' compute copies, which the optimizer reads and writes through.
///
/// `write` and `read` may block (the residency manager may have to make room or read NVMe);
/// the optimizer calls them from its worker threads and from [`crate::PipelinedOptimizer`]'s
/// `publish`, `import_state`, `read_compute_copy`, never while holding a lock the home might
/// wait for.
pub trait ComputeCopyHome: Send + Sync {
    /// A unit is added with its first compute copy (`bytes`, the compute dtype's bytes). A home
    /// that already holds it (the runtime registered it with the residency manager) only checks
    /// the length.
    ///
    /// # Errors
    /// The home refused the unit (out of memory, a length that differs from the registered one).
    fn add_unit(&self, unit: TensorId, bytes: &[u8]) -> oogc_swapper::Result<()>;

    /// Calls `f` with the unit's compute copy to overwrite every byte of it (its old bytes need
    /// not be read: the slice's contents are unspecified).
    ///
    /// # Errors
    /// The home could not make the copy writable (host budget, NVMe I/O, unknown unit).
    fn write(&self, unit: TensorId, f: &mut dyn FnMut(&mut [u8])) -> oogc_swapper::Result<()>;

    /// Calls `f` with the unit's compute copy to update it in place: its current bytes are
    /// there to read (fetched from a lower tier if need be), and every byte `f` leaves is the
    /// new copy. How an update whose master weights live in the compute copy writes it.
    ///
    /// # Errors
    /// As [`ComputeCopyHome::write`], and reading the old bytes (NVMe I/O, corrupt block).
    fn update(&self, unit: TensorId, f: &mut dyn FnMut(&mut [u8])) -> oogc_swapper::Result<()>;

    /// Calls `f` with the unit's compute copy.
    ///
    /// # Errors
    /// The home could not read the copy (NVMe I/O, corrupt block, unknown unit).
    fn read(&self, unit: TensorId, f: &mut dyn FnMut(&[u8])) -> oogc_swapper::Result<()>;
}

/// A [`ComputeCopyHome`] in plain memory: one byte vector per unit. The home of an optimizer
/// used on its own.
#[derive(Debug, Default)]
pub struct MemoryHome {
    /// One lock per unit, so that updates of different units write at once.
    copies: RwLock<HashMap<TensorId, Arc<Mutex<Vec<u8>>>>>,
}

impl MemoryHome {
    /// An empty home.
    pub fn new() -> Self {
        Self::default()
    }
}

fn unknown(unit: TensorId) -> oogc_swapper::Error {
    oogc_swapper::Error::UnknownTensor(unit)
}

impl ComputeCopyHome for MemoryHome {
    fn add_unit(&self, unit: TensorId, bytes: &[u8]) -> oogc_swapper::Result<()> {
        match self.copies.write().entry(unit) {
            std::collections::hash_map::Entry::Occupied(_) => Err(oogc_swapper::Error::DuplicateTensor(unit)),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Arc::new(Mutex::new(bytes.to_vec())));
                Ok(())
            }
        }
    }

    fn write(&self, unit: TensorId, f: &mut dyn FnMut(&mut [u8])) -> oogc_swapper::Result<()> {
        let copy = self.copies.read().get(&unit).cloned().ok_or_else(|| unknown(unit))?;
        f(&mut copy.lock());
        Ok(())
    }

    /// As [`MemoryHome::write`]: the vector holds the old bytes.
    fn update(&self, unit: TensorId, f: &mut dyn FnMut(&mut [u8])) -> oogc_swapper::Result<()> {
        self.write(unit, f)
    }

    fn read(&self, unit: TensorId, f: &mut dyn FnMut(&[u8])) -> oogc_swapper::Result<()> {
        let copy = self.copies.read().get(&unit).cloned().ok_or_else(|| unknown(unit))?;
        f(&copy.lock());
        Ok(())
    }
}

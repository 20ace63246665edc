//! The runtime's [`ComputeCopyHome`]: a unit's compute copy lives in the residency manager (its
//! host copy, itself a cache of the NVMe extent when parameters live on NVMe), and the optimizer
//! writes each new copy there — one home, no second copy in the optimizer.

use std::sync::Arc;

use oogc_optimizer::ComputeCopyHome;
use oogc_swapper::{Access, ResidencyManager, TensorId, Tier};

/// The residency manager as the optimizer's compute-copy home.
pub(super) struct ResidencyHome {
    residency: Arc<ResidencyManager>,
}

impl ResidencyHome {
    pub(super) fn new(residency: Arc<ResidencyManager>) -> Self {
        Self { residency }
    }
}

impl ComputeCopyHome for ResidencyHome {
    /// The runtime registered the unit with these bytes already: only the length is checked.
    fn add_unit(&self, unit: TensorId, bytes: &[u8]) -> oogc_swapper::Result<()> {
        let meta = self.residency.meta(unit)?;
        if meta.num_bytes() != bytes.len() {
            return Err(oogc_swapper::Error::InvalidRequest(format!(
                "unit {unit} ({}): its compute copy is {} bytes, the optimizer's {}",
                meta.name,
                meta.num_bytes(),
                bytes.len()
            )));
        }
        Ok(())
    }

    /// The host copy, pinned for [`Access::Overwrite`]: made without reading NVMe when absent,
    /// the stale device copy dropped, written back to NVMe from this buffer when evicted.
    fn write(&self, unit: TensorId, f: &mut dyn FnMut(&mut [u8])) -> oogc_swapper::Result<()> {
        let pin = self.residency.acquire(unit, Tier::Host, Access::Overwrite)?;
        f(&mut pin.host_bytes_mut());
        Ok(())
    }

    fn read(&self, unit: TensorId, f: &mut dyn FnMut(&[u8])) -> oogc_swapper::Result<()> {
        let pin = self.residency.acquire(unit, Tier::Host, Access::Read)?;
        f(&pin.host_bytes());
        Ok(())
    }
}

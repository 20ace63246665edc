//! The runtime's [`ComputeCopyHome`]: a unit's compute copy lives in the residency manager (its
//! host copy, itself a cache of the NVMe extent when parameters live on NVMe), and the optimizer
//! writes each new copy there — one home, no second copy in the optimizer.

use std::sync::Arc;

use oogc_optimizer::ComputeCopyHome;
use oogc_swapper::{Access, ResidencyManager, TensorId, Tier};

/// Calls `f` with `unit`'s host copy to overwrite every byte of it: pinned for
/// [`Access::Overwrite`], made without reading NVMe when absent, the stale device copy dropped,
/// written back to NVMe from this buffer when evicted. How every new compute copy enters the
/// tiers: the optimizer's (through [`ResidencyHome`]), or one gathered from the ranks' shards.
///
/// # Errors
/// The residency manager could not make the host copy (host budget, unknown unit).
pub(super) fn overwrite_host_copy(
    residency: &ResidencyManager,
    unit: TensorId,
    f: &mut dyn FnMut(&mut [u8]),
) -> oogc_swapper::Result<()> {
    let pin = residency.acquire(unit, Tier::Host, Access::Overwrite)?;
    f(&mut pin.host_bytes_mut());
    Ok(())
}

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

    /// [`overwrite_host_copy`].
    fn write(&self, unit: TensorId, f: &mut dyn FnMut(&mut [u8])) -> oogc_swapper::Result<()> {
        overwrite_host_copy(&self.residency, unit, f)
    }

    /// The host copy pinned for [`Access::Write`]: read from NVMe when absent, a stale device
    /// copy dropped, written back when evicted.
    fn update(&self, unit: TensorId, f: &mut dyn FnMut(&mut [u8])) -> oogc_swapper::Result<()> {
        let pin = self.residency.acquire(unit, Tier::Host, Access::Write)?;
        f(&mut pin.host_bytes_mut());
        Ok(())
    }

    fn read(&self, unit: TensorId, f: &mut dyn FnMut(&[u8])) -> oogc_swapper::Result<()> {
        let pin = self.residency.acquire(unit, Tier::Host, Access::Read)?;
        f(&pin.host_bytes());
        Ok(())
    }
}

/// The home of a rank's compute copies with sharded parameters: a unit gathered at its fetch has
/// its shard in the tiers ([`ResidencyHome`], written there by the optimizer); a unit kept
/// whole on every rank (an MoE expert, fetched as the rank's routing decides) has the
/// optimizer's shard of its copy in a home of its own ([`oogc_optimizer::MemoryHome`]), from
/// which `Runtime::finish_step` all-gathers the whole copy into the tiers.
pub(super) struct RankHome {
    shards: ResidencyHome,
    whole: oogc_optimizer::MemoryHome,
    /// The units kept whole (in `whole`).
    whole_units: parking_lot::RwLock<std::collections::HashSet<TensorId>>,
}

impl RankHome {
    pub(super) fn new(residency: Arc<ResidencyManager>) -> Self {
        Self {
            shards: ResidencyHome::new(residency),
            whole: oogc_optimizer::MemoryHome::new(),
            whole_units: parking_lot::RwLock::new(std::collections::HashSet::new()),
        }
    }

    /// `unit` is kept whole: its optimizer's copy goes to the home of its own. Call before the
    /// optimizer adds the unit.
    pub(super) fn keep_whole(&self, unit: TensorId) {
        self.whole_units.write().insert(unit);
    }

    fn of(&self, unit: TensorId) -> &dyn ComputeCopyHome {
        if self.whole_units.read().contains(&unit) {
            &self.whole
        } else {
            &self.shards
        }
    }
}

impl ComputeCopyHome for RankHome {
    fn add_unit(&self, unit: TensorId, bytes: &[u8]) -> oogc_swapper::Result<()> {
        self.of(unit).add_unit(unit, bytes)
    }

    fn write(&self, unit: TensorId, f: &mut dyn FnMut(&mut [u8])) -> oogc_swapper::Result<()> {
        self.of(unit).write(unit, f)
    }

    fn update(&self, unit: TensorId, f: &mut dyn FnMut(&mut [u8])) -> oogc_swapper::Result<()> {
        self.of(unit).update(unit, f)
    }

    fn read(&self, unit: TensorId, f: &mut dyn FnMut(&[u8])) -> oogc_swapper::Result<()> {
        self.of(unit).read(unit, f)
    }
}

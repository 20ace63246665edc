//! The residency manager with an NVMe store below the host tier: every path
//! (device ↔ host ↔ NVMe) round-trips bytes, corruption is caught, and a full store loses nothing.

use std::io::{Read, Seek, SeekFrom, Write};
use std::time::Duration;

use oogc_swapper::{
    Access, DType, Device, EngineChoice, Error, LruPolicy, NvmeConfig, NvmeStore, ResidencyConfig, ResidencyManager,
    SimDevice, SimDeviceConfig, TensorId, TensorMeta, Tier,
};
use proptest::prelude::*;

fn manager(dir: &std::path::Path, engine: EngineChoice, device: u64, host: u64, nvme: u64) -> ResidencyManager {
    let store = NvmeStore::open(NvmeConfig { engine, ..NvmeConfig::new(vec![dir.to_path_buf()], nvme) }).unwrap();
    let dev = SimDevice::new(SimDeviceConfig { capacity_bytes: device, ..Default::default() }).unwrap();
    ResidencyManager::new(
        Device::Sim(dev),
        Some(std::sync::Arc::new(store)),
        ResidencyConfig {
            host_budget_bytes: host,
            lock_host_memory: false,
            wait_timeout: Duration::from_secs(20),
            ..Default::default()
        },
        Box::new(LruPolicy),
    )
    .unwrap()
}

fn nvme_meta(id: u64, bytes: usize) -> TensorMeta {
    TensorMeta::new(TensorId(id), format!("t{id}"), &[bytes], DType::U8, Tier::Nvme)
}

fn pattern(id: u64, version: u8, bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| (i as u64 * 131 + id * 17 + version as u64 * 3) as u8).collect()
}

fn engines() -> Vec<EngineChoice> {
    vec![EngineChoice::Auto, EngineChoice::Psync]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    /// Random sizes through device ↔ host ↔ NVMe: tensors homed on NVMe, a host budget one tensor
    /// short of all of them and a device budget of about one, so every acquire evicts, dirty copies are
    /// written back (D2H, then host → NVMe) and refetched (NVMe → host → device).
    #[test]
    fn random_sizes_round_trip_through_every_tier(sizes in proptest::collection::vec(1usize..400_000, 3..6)) {
        for engine in engines() {
            let dir = tempfile::tempdir().unwrap();
            let max = *sizes.iter().max().unwrap();
            // One size class short of holding every tensor: each round must evict to NVMe.
            let classes: Vec<u64> = sizes.iter().map(|&n| oogc_swapper::host::size_class(n) as u64).collect();
            let host = classes.iter().sum::<u64>() - classes.iter().min().unwrap();
            let m = manager(dir.path(), engine, max as u64 + 10, host, 64 << 20);
            for (i, &n) in sizes.iter().enumerate() {
                m.register(nvme_meta(i as u64, n), &pattern(i as u64, 0, n)).unwrap();
            }
            for round in 1..3u8 {
                for (i, &n) in sizes.iter().enumerate() {
                    let id = TensorId(i as u64);
                    let g = m.acquire(id, Tier::Device, Access::Write).unwrap();
                    let mut b = g.device_buffer_mut();
                    let s = b.as_sim_mut().unwrap().compute_write().unwrap();
                    prop_assert_eq!(&*s, &pattern(i as u64, round - 1, n)[..], "engine {:?} tensor {} round {}", engine, i, round);
                    s.copy_from_slice(&pattern(i as u64, round, n));
                    drop(b);
                    drop(g);
                    m.check_invariants().unwrap();
                }
            }
            for (i, &n) in sizes.iter().enumerate() {
                prop_assert_eq!(m.read_to_vec(TensorId(i as u64)).unwrap(), pattern(i as u64, 2, n));
            }
            let mt = m.metrics();
            prop_assert!(mt.nvme_write.bytes > 0 && mt.nvme_read.bytes > 0 && mt.dtoh.bytes > 0);
        }
    }
}

#[test]
fn a_corrupt_extent_is_an_error_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let size = 64 * 1024;
    // Host room for one tensor: registering the second evicts the first (clean) to NVMe only.
    let m = manager(dir.path(), EngineChoice::Auto, 1 << 20, size as u64, 1 << 20);
    m.register(nvme_meta(1, size), &pattern(1, 0, size)).unwrap();
    m.register(nvme_meta(2, size), &pattern(2, 0, size)).unwrap();
    assert!(!m.residency(TensorId(1)).unwrap().host);
    // Tensor 1 was the first extent written: it starts at offset 0 of the only store file.
    let path = m.nvme().unwrap().file_paths().next().unwrap().to_path_buf();
    let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mut byte = [0u8; 1];
    f.seek(SeekFrom::Start(100)).unwrap();
    f.read_exact(&mut byte).unwrap();
    f.seek(SeekFrom::Start(100)).unwrap();
    f.write_all(&[byte[0] ^ 0xff]).unwrap();
    f.sync_all().unwrap();
    drop(f);
    match m.acquire(TensorId(1), Tier::Device, Access::Read) {
        Err(Error::Corrupt { tensor, offset, .. }) => {
            assert_eq!(tensor, TensorId(1));
            assert_eq!(offset, 0, "the corrupt block starts at the extent's first byte");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    // The manager is still consistent and the other tensor is fine.
    m.check_invariants().unwrap();
    assert_eq!(m.read_to_vec(TensorId(2)).unwrap(), pattern(2, 0, size));
}

#[test]
fn a_full_store_fails_the_write_back_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let size = 64 * 1024;
    // The store holds exactly three tensors; write-backs are copy-on-write, so a fourth extent
    // is needed to write a dirty one back.
    let m = manager(dir.path(), EngineChoice::Auto, 1 << 20, size as u64, 3 * size as u64);
    for id in 0..3 {
        m.register(nvme_meta(id, size), &pattern(id, 0, size)).unwrap();
    }
    let new = pattern(0, 7, size);
    m.acquire(TensorId(0), Tier::Host, Access::Write).unwrap().host_bytes_mut().copy_from_slice(&new);
    // Bringing tensor 1 to the host must evict dirty tensor 0: the store is full.
    match m.acquire(TensorId(1), Tier::Host, Access::Read) {
        Err(Error::OutOfMemory { tier: Tier::Nvme, .. }) => {}
        other => panic!("expected OutOfMemory on nvme, got {other:?}"),
    }
    let info = m.residency(TensorId(0)).unwrap();
    assert!(info.host && info.host_dirty, "the dirty host copy stays: {info:?}");
    assert_eq!(m.read_to_vec(TensorId(0)).unwrap(), new);
    m.check_invariants().unwrap();
    // Free room on the store: the write-back goes through, and every byte is still there.
    m.remove(TensorId(2)).unwrap();
    assert_eq!(m.read_to_vec(TensorId(1)).unwrap(), pattern(1, 0, size));
    assert!(!m.residency(TensorId(0)).unwrap().host);
    assert_eq!(m.read_to_vec(TensorId(0)).unwrap(), new);
}

#[test]
fn prefetch_from_nvme_reaches_the_device() {
    let dir = tempfile::tempdir().unwrap();
    let size = 200_000;
    let m = manager(dir.path(), EngineChoice::Auto, 1 << 20, 1 << 20, 4 << 20);
    for id in 0..6 {
        m.register(nvme_meta(id, size), &pattern(id, 0, size)).unwrap();
    }
    let handles: Vec<_> = (0..3).map(|id| m.prefetch(TensorId(id), Tier::Device).unwrap()).collect();
    for h in handles {
        h.wait().unwrap();
    }
    for id in 0..3 {
        let g = m.acquire(TensorId(id), Tier::Device, Access::Read).unwrap();
        assert_eq!(g.device_buffer().as_sim().unwrap().compute_read().unwrap(), &pattern(id, 0, size)[..]);
    }
    assert!(m.metrics().prefetch_hits >= 3);
    m.check_invariants().unwrap();
}

/// A failing disk (an injected EIO on one write, `FaultPlan`) loses nothing: the write-back of a
/// dirty host copy fails with an error naming the store file and offset, the old extent and the
/// dirty host copy stay, and once the disk works again the bytes go through.
#[test]
fn a_failed_nvme_write_names_the_file_and_offset_and_loses_nothing() {
    use oogc_swapper::FaultPlan;
    let dir = tempfile::tempdir().unwrap();
    let size = 64 * 1024;
    // Registering writes tensors 0..3 (writes 1..3); the 4th write is the write-back below.
    let store =
        NvmeStore::open_with_faults(NvmeConfig::new(vec![dir.path().to_path_buf()], 8 << 20), FaultPlan::fail_write(4))
            .unwrap();
    let file = store.file_paths().next().unwrap().to_path_buf();
    let dev = SimDevice::new(SimDeviceConfig { capacity_bytes: 1 << 20, ..Default::default() }).unwrap();
    let config = ResidencyConfig {
        host_budget_bytes: size as u64,
        lock_host_memory: false,
        wait_timeout: Duration::from_secs(20),
        ..Default::default()
    };
    let m =
        ResidencyManager::new(Device::Sim(dev), Some(std::sync::Arc::new(store)), config, Box::new(LruPolicy)).unwrap();
    for id in 0..3 {
        m.register(nvme_meta(id, size), &pattern(id, 0, size)).unwrap();
    }
    let new = pattern(0, 9, size);
    m.acquire(TensorId(0), Tier::Host, Access::Write).unwrap().host_bytes_mut().copy_from_slice(&new);
    // Bringing tensor 1 to the host evicts dirty tensor 0: its write-back is the failing write.
    match m.acquire(TensorId(1), Tier::Host, Access::Read) {
        Err(Error::Io { path, offset, source, .. }) => {
            assert_eq!(path, file, "names the store file");
            assert!(source.to_string().contains("injected"), "{source}");
            println!("write-back failed as injected: {} at offset {offset}", path.display());
        }
        other => panic!("expected Error::Io, got {other:?}"),
    }
    let info = m.residency(TensorId(0)).unwrap();
    assert!(info.host && info.host_dirty, "the dirty host copy stays: {info:?}");
    assert_eq!(m.read_to_vec(TensorId(0)).unwrap(), new);
    m.check_invariants().unwrap();
    // The next write works: the write-back goes through and every byte is there.
    assert_eq!(m.read_to_vec(TensorId(1)).unwrap(), pattern(1, 0, size));
    assert!(!m.residency(TensorId(0)).unwrap().host);
    assert_eq!(m.read_to_vec(TensorId(0)).unwrap(), new);
    assert_eq!(m.read_to_vec(TensorId(2)).unwrap(), pattern(2, 0, size));
}

//! Behaviour of the NVMe store through its public API: round trips through both engines,
//! striping, corruption, bad directories, a write that fails mid-way, and the io_uring fallback.
//!
//! Tests that need something this machine may not have (io_uring, `mount`) skip through
//! `oogc_swapper::skip` (a line on stderr, counted in `OOGC_SKIP_LOG`);
//! `OOGC_REQUIRE=io_uring,mount` turns those skips into failures.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use oogc_swapper::skip::{skip, Capability};
use oogc_swapper::{
    EngineChoice, EngineKind, Error, NvmeConfig, NvmeStore, PinnedPool, PinnedPoolConfig, TensorId, Tier,
};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};

const CHILD_ENV: &str = "OOGC_NVME_TEST_CHILD";

fn pool() -> PinnedPool {
    PinnedPool::with_mmap(&PinnedPoolConfig { budget_bytes: 512 << 20, lock: false })
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn config(dirs: &[&Path], capacity_bytes: u64, engine: EngineChoice) -> NvmeConfig {
    NvmeConfig { engine, ..NvmeConfig::new(dirs.iter().map(|d| d.to_path_buf()).collect(), capacity_bytes) }
}

/// Opens a store with `engine`, or prints why io_uring is skipped and returns `None`.
fn open_or_skip(cfg: NvmeConfig) -> Option<NvmeStore> {
    match NvmeStore::open(cfg) {
        Ok(s) => Some(s),
        Err(Error::UringUnavailable { reason }) => {
            skip(Capability::IoUring, "nvme", &format!("io_uring unavailable here ({reason})"));
            None
        }
        Err(e) => panic!("open failed: {e}"),
    }
}

fn write_read(store: &NvmeStore, pool: &PinnedPool, id: u64, data: &[u8]) -> (Vec<u8>, Vec<u32>) {
    let (r, _buf) = store.write(TensorId(id), pool.alloc_copy(data).unwrap()).wait();
    let ext = r.unwrap();
    assert_eq!(ext.num_bytes(), data.len() as u64);
    let bytes = read_back(store, pool, &ext).unwrap();
    let crcs = ext.checksums().to_vec();
    store.free(ext);
    (bytes, crcs)
}

fn read_back(store: &NvmeStore, pool: &PinnedPool, ext: &oogc_swapper::Extent) -> oogc_swapper::Result<Vec<u8>> {
    let (r, buf) = store.read(ext, pool.alloc(ext.num_bytes() as usize).unwrap()).wait();
    r.map(|()| buf.as_slice().to_vec())
}

#[test]
fn random_sizes_round_trip_through_both_engines_with_identical_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let p = pool();
    let psync = NvmeStore::open(config(&[dir.path()], 64 << 20, EngineChoice::Psync)).unwrap();
    assert_eq!(psync.engine_kind(), EngineKind::Psync);
    let uring = open_or_skip(config(&[dir.path()], 64 << 20, EngineChoice::Uring));
    let mut runner = TestRunner::new(PropConfig { cases: 24, ..PropConfig::default() });
    runner
        .run(&(1usize..(5 << 20), any::<u64>()), |(len, seed)| {
            let data = pattern(len, seed);
            let (bytes, crcs) = {
                let ext = psync.write(TensorId(seed), p.alloc_copy(&data).unwrap()).wait().0.unwrap();
                let back = read_back(&psync, &p, &ext).unwrap();
                let crcs = ext.checksums().to_vec();
                psync.free(ext);
                (back, crcs)
            };
            prop_assert!(bytes == data, "psync round trip of {} bytes differs", len);
            if let Some(u) = &uring {
                let ext = u.write(TensorId(seed), p.alloc_copy(&data).unwrap()).wait().0.unwrap();
                let back = read_back(u, &p, &ext).unwrap();
                prop_assert!(back == bytes, "io_uring and psync differ for {} bytes", len);
                prop_assert_eq!(ext.checksums(), &crcs[..]);
                u.free(ext);
            }
            prop_assert_eq!(psync.used_bytes(), 0);
            Ok(())
        })
        .unwrap();
}

#[test]
fn striped_store_over_three_dirs_round_trips_many_tensors_in_flight() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let paths: Vec<&Path> = dirs.iter().map(|d| d.path()).collect();
    for engine in [EngineChoice::Psync, EngineChoice::Uring] {
        let mut cfg = config(&paths, 96 << 20, engine);
        cfg.block_bytes = 256 << 10;
        let Some(store) = open_or_skip(cfg) else { continue };
        let store = Arc::new(store);
        let p = pool();
        // Several threads, several writes in flight each.
        let threads: Vec<_> = (0..3u64)
            .map(|t| {
                let (store, p) = (store.clone(), p.clone());
                std::thread::spawn(move || {
                    let sizes = [1usize, 4095, 4097, 700_001, (1 << 20) + 3, 3 << 20];
                    let handles: Vec<_> = sizes
                        .iter()
                        .enumerate()
                        .map(|(i, &n)| {
                            let id = t * 100 + i as u64;
                            (id, n, store.write(TensorId(id), p.alloc_copy(&pattern(n, id)).unwrap()))
                        })
                        .collect();
                    let exts: Vec<_> = handles.into_iter().map(|(id, n, h)| (id, n, h.wait().0.unwrap())).collect();
                    for (id, n, ext) in exts {
                        assert_eq!(ext.tensor(), TensorId(id));
                        assert_eq!(read_back(&store, &p, &ext).unwrap(), pattern(n, id), "tensor {id}");
                        store.free(ext);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(store.used_bytes(), 0);
        let (rd, wr) = store.link_stats();
        assert_eq!(rd.snapshot().ops, 18);
        assert_eq!(wr.snapshot().bytes, rd.snapshot().bytes);
        let files: Vec<PathBuf> = store.file_paths().map(Path::to_path_buf).collect();
        assert_eq!(files.len(), 3);
        drop(store);
        assert!(files.iter().all(|f| !f.exists()), "store files removed on drop");
    }
}

#[test]
fn a_flipped_byte_is_reported_as_corrupt_with_the_block_offset() {
    let dir = tempfile::tempdir().unwrap();
    for engine in [EngineChoice::Psync, EngineChoice::Uring] {
        let Some(store) = open_or_skip(config(&[dir.path()], 16 << 20, engine)) else { continue };
        let p = pool();
        let data = pattern((3 << 20) + 123, 5);
        let other = store.write(TensorId(6), p.alloc_copy(&pattern(5000, 6)).unwrap()).wait().0.unwrap();
        let ext = store.write(TensorId(7), p.alloc_copy(&data).unwrap()).wait().0.unwrap();
        let bad = ext.blocks()[1];
        let path = store.file_paths().nth(bad.file).unwrap().to_path_buf();
        {
            let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
            let at = bad.offset + 777;
            let mut b = [0u8];
            f.seek(SeekFrom::Start(at)).unwrap();
            f.read_exact(&mut b).unwrap();
            f.seek(SeekFrom::Start(at)).unwrap();
            f.write_all(&[b[0] ^ 0x40]).unwrap();
            f.sync_all().unwrap();
        }
        match read_back(&store, &p, &ext) {
            Err(Error::Corrupt { tensor, path: p2, offset, expected, actual }) => {
                assert_eq!(tensor, TensorId(7));
                assert_eq!(p2, path);
                assert_eq!(offset, bad.offset);
                assert_eq!(expected, ext.checksums()[1]);
                assert_ne!(expected, actual);
            }
            other => panic!("{engine:?}: expected Corrupt, got {other:?}"),
        }
        assert_eq!(read_back(&store, &p, &other).unwrap(), pattern(5000, 6), "other extents stay readable");
    }
}

#[test]
fn bad_directories_are_refused_before_anything_is_written() {
    let base = tempfile::tempdir().unwrap();
    let expect_dir_err = |cfg: NvmeConfig, path: &Path, what: &str| match NvmeStore::open(cfg) {
        Err(e @ Error::NvmeDir { .. }) => {
            let Error::NvmeDir { path: ref p, needed_bytes, ref reason } = e else { unreachable!() };
            assert_eq!(p, path, "{what}");
            assert!(needed_bytes > 0);
            assert!(reason.contains(what), "{what}: {reason}");
            let msg = e.to_string();
            assert!(msg.contains(&path.display().to_string()) && msg.contains(&needed_bytes.to_string()), "{msg}");
        }
        other => panic!("{what}: expected NvmeDir, got {other:?}"),
    };
    let missing = base.path().join("missing");
    expect_dir_err(config(&[&missing], 1 << 20, EngineChoice::Auto), &missing, "does not exist");
    let file = base.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    expect_dir_err(config(&[&file], 1 << 20, EngineChoice::Auto), &file, "not a directory");
    // A good dir first and a bad one second: the first gets no file.
    let good = base.path().join("good");
    std::fs::create_dir(&good).unwrap();
    expect_dir_err(config(&[&good, &missing], 1 << 20, EngineChoice::Auto), &missing, "does not exist");
    assert_eq!(std::fs::read_dir(&good).unwrap().count(), 0);
    // More than the free space.
    expect_dir_err(config(&[&good], 1 << 60, EngineChoice::Auto), &good, "bytes free");

    let ro = base.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    if rustix::process::geteuid().is_root() {
        let bind = Command::new("mount").args(["--bind"]).arg(&ro).arg(&ro).status();
        let remount = Command::new("mount").args(["-o", "remount,bind,ro"]).arg(&ro).status();
        match (bind, remount) {
            (Ok(a), Ok(b)) if a.success() && b.success() => {
                expect_dir_err(config(&[&ro], 1 << 20, EngineChoice::Auto), &ro, "read-only");
                let _ = Command::new("umount").arg(&ro).status();
            }
            other => {
                let _ = Command::new("umount").arg(&ro).status();
                skip(
                    Capability::Mount,
                    "nvme: the read-only directory",
                    &format!(
                        "running as root, permission bits do not apply, and a read-only bind mount failed ({other:?})"
                    ),
                );
            }
        }
    } else {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        expect_dir_err(config(&[&ro], 1 << 20, EngineChoice::Auto), &ro, "not writable");
    }
}

/// Runs this test binary's test `name` again in a child with `CHILD_ENV=scenario` (and `env`),
/// under `sh` with SIGXFSZ ignored, and asserts it passed.
fn run_child(name: &str, scenario: &str, env: &[(&str, &str)]) {
    let exe = std::env::current_exe().unwrap();
    let script = format!("trap '' XFSZ; exec \"{}\" {name} --exact --nocapture --test-threads=1", exe.display());
    let mut cmd = Command::new("sh");
    cmd.args(["-c", &script]).env(CHILD_ENV, scenario);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    print!("{text}");
    assert!(out.status.success(), "child {scenario} failed:\n{text}");
    assert!(text.contains("1 passed"), "child ran no test:\n{text}");
}

/// A write that runs into the file size limit (RLIMIT_FSIZE → EFBIG, the same error path as a
/// disk that fails mid-write: the space is preallocated, so ENOSPC itself shows at open) returns
/// `Error::Io`, frees its extent, and leaves earlier extents readable. Runs in a child process
/// because the limit is per process.
#[test]
fn a_write_failing_mid_way_frees_its_extent_and_keeps_earlier_ones() {
    let Ok(scenario) = std::env::var(CHILD_ENV) else {
        for engine in ["psync", "uring"] {
            run_child("a_write_failing_mid_way_frees_its_extent_and_keeps_earlier_ones", engine, &[]);
        }
        return;
    };
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let engine = if scenario == "uring" { EngineChoice::Uring } else { EngineChoice::Psync };
    let dir = tempfile::tempdir().unwrap();
    let Some(store) = open_or_skip(config(&[dir.path()], 32 << 20, engine)) else { return };
    let p = pool();
    let a_data = pattern((3 << 20) + 100, 1);
    let a = store.write(TensorId(1), p.alloc_copy(&a_data).unwrap()).wait().0.unwrap();
    let used = store.used_bytes();
    let old = getrlimit(Resource::Fsize);
    let limit = 5u64 << 20;
    setrlimit(Resource::Fsize, Rlimit { current: Some(limit), maximum: old.maximum }).unwrap();
    let (r, _buf) = store.write(TensorId(2), p.alloc_copy(&pattern(4 << 20, 2)).unwrap()).wait();
    setrlimit(Resource::Fsize, old).unwrap();
    match r {
        Err(Error::Io { path, offset, len, source }) => {
            println!("{scenario}: write failed as expected: {path:?} offset {offset} len {len}: {source}");
            assert_eq!(path, store.file_paths().next().unwrap());
            assert!(offset >= limit && len > 0, "offset {offset} len {len}");
            assert_eq!(source.raw_os_error(), Some(libc_efbig()), "{source}");
        }
        other => panic!("expected Error::Io, got {other:?}"),
    }
    assert_eq!(store.used_bytes(), used, "the failed write's extent is freed");
    assert_eq!(read_back(&store, &p, &a).unwrap(), a_data, "earlier extents are intact");
    // The store still works once the cause is gone.
    let c = store.write(TensorId(3), p.alloc_copy(&pattern(4 << 20, 3)).unwrap()).wait().0.unwrap();
    assert_eq!(read_back(&store, &p, &c).unwrap(), pattern(4 << 20, 3));
}

fn libc_efbig() -> i32 {
    rustix::io::Errno::FBIG.raw_os_error()
}

/// `OOGC_DISABLE_URING=1` makes `Auto` take the pread/pwrite engine (the fallback path) and
/// `Uring` fail with `UringUnavailable`. In a child, because the variable is process-wide.
#[test]
fn auto_falls_back_to_psync_when_uring_is_unavailable() {
    if std::env::var(CHILD_ENV).is_err() {
        run_child("auto_falls_back_to_psync_when_uring_is_unavailable", "fallback", &[("OOGC_DISABLE_URING", "1")]);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = NvmeStore::open(config(&[dir.path()], 8 << 20, EngineChoice::Auto)).unwrap();
    assert_eq!(store.engine_kind(), EngineKind::Psync);
    let p = pool();
    let data = pattern(12345, 9);
    let (bytes, _) = write_read(&store, &p, 1, &data);
    assert_eq!(bytes, data);
    match NvmeStore::open(config(&[dir.path()], 8 << 20, EngineChoice::Uring)) {
        Err(e @ Error::UringUnavailable { .. }) => assert!(e.to_string().contains("OOGC_DISABLE_URING")),
        other => panic!("expected UringUnavailable, got {other:?}"),
    }
}

#[test]
fn full_store_reports_out_of_memory_and_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let store = NvmeStore::open(config(&[dir.path()], 8 << 20, EngineChoice::Auto)).unwrap();
    let p = pool();
    let a = store.write(TensorId(1), p.alloc_copy(&pattern(6 << 20, 1)).unwrap()).wait().0.unwrap();
    match store.write(TensorId(2), p.alloc(3 << 20).unwrap()).wait().0 {
        Err(Error::OutOfMemory { tier: Tier::Nvme, requested_bytes, available_bytes }) => {
            assert_eq!(requested_bytes, 3 << 20);
            assert_eq!(available_bytes, 2 << 20);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    assert_eq!(read_back(&store, &p, &a).unwrap(), pattern(6 << 20, 1));
    let empty = store.write(TensorId(3), p.alloc(0).unwrap()).wait().0.unwrap();
    assert_eq!(read_back(&store, &p, &empty).unwrap(), Vec::<u8>::new());
}

#[test]
fn buffered_io_works_when_direct_io_is_off() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(&[dir.path()], 8 << 20, EngineChoice::Auto);
    cfg.direct_io = false;
    let store = NvmeStore::open(cfg).unwrap();
    assert_eq!(store.direct_io(), vec![false]);
    let p = pool();
    let data = pattern(777_777, 4);
    assert_eq!(write_read(&store, &p, 1, &data).0, data);
}

//! The ordering API of [`Device`] on the sim device, whose checker holds callers to the CUDA
//! ordering contract: the runtime's patterns (gradient staging, activation staging, freeing a
//! buffer compute used) pass when ordered and fail, naming the operation, when one ordering call
//! is removed; random programs that order every operation raise nothing, and the same programs
//! with one stale event are caught.

use oogc_swapper::{
    Device, DeviceBuffer, DeviceEvent, Error, OrderingHazard, PinnedPool, PinnedPoolConfig, SimDevice, SimDeviceConfig,
};
use proptest::prelude::*;

fn device() -> Device {
    Device::Sim(SimDevice::new(SimDeviceConfig { capacity_bytes: 1 << 20, ..Default::default() }).unwrap())
}

fn pool() -> PinnedPool {
    PinnedPool::with_mmap(&PinnedPoolConfig { budget_bytes: 16 << 20, lock: false })
}

fn write(buf: &mut DeviceBuffer, v: u8) {
    buf.as_sim_mut().unwrap().compute_write().unwrap().fill(v);
}

fn read(buf: &DeviceBuffer) -> Result<Vec<u8>, Error> {
    buf.as_sim().unwrap().compute_read().map(<[u8]>::to_vec)
}

fn hazard<T: std::fmt::Debug>(r: Result<T, Error>) -> OrderingHazard {
    match r {
        Err(Error::Ordering { hazard, .. }) => hazard,
        other => panic!("expected an ordering violation, got {other:?}"),
    }
}

/// Gradient staging: the backward writes a unit's gradients into a staging buffer, the D2H
/// follows an event recorded after it, the staging buffer is reused for the next unit.
fn stage_gradients(dev: &Device, forget_the_event: bool) -> Result<(), Error> {
    let pool = pool();
    let mut staging = dev.alloc_for_compute(256)?;
    let mut stale = dev.record_compute_event()?;
    for unit in 1..=3u8 {
        write(&mut staging, unit); // the backward of `unit`
        let after = if forget_the_event { stale.clone() } else { dev.record_compute_event()? };
        let (t, _) = dev.dtoh_after(staging, pool.alloc(256)?, Some(&after))?;
        let (grads, buf) = t.wait()?;
        assert_eq!(grads.as_slice(), &[unit; 256][..]);
        staging = buf;
        stale = after;
    }
    dev.free_after(staging, None)
}

#[test]
fn gradient_staging_passes_and_fails_without_its_compute_event() {
    let dev = device();
    stage_gradients(&dev, false).unwrap();
    dev.check_ordering().unwrap();

    let dev = device();
    let e = stage_gradients(&dev, true).unwrap_err();
    assert!(e.to_string().contains("dtoh of a buffer compute wrote after the `after` event"), "{e}");
    assert!(e.to_string().contains("fix: record the `after` event (Device::record_compute_event)"), "{e}");
    assert_eq!(hazard(dev.check_ordering()), OrderingHazard::DtohBeforeComputeWrite);
}

/// Activation staging: compute reads a checkpoint from a staging buffer; the next checkpoint's
/// H2D reuses the buffer after an event recorded after that read, is handed to compute without a
/// host wait, and compute waits for the copy before reading it.
fn reload_activations(dev: &Device, skip_compute_wait: bool, skip_reuse_event: bool) -> Result<(), Error> {
    let pool = pool();
    let (t, _) = dev.htod_after(pool.alloc_copy(&[1; 128])?, dev.alloc(128)?, None)?;
    let mut staging = t.wait()?.1;
    let mut before_read = dev.record_compute_event()?;
    for k in 2..=4u8 {
        assert_eq!(read(&staging)?, vec![k - 1; 128]); // the recompute reads the checkpoint
        let after = if skip_reuse_event { before_read.clone() } else { dev.record_compute_event()? };
        let (t, copied) = dev.htod_after(pool.alloc_copy(&[k; 128])?, staging, Some(&after))?;
        let (buf, host) = t.release_device()?;
        if !skip_compute_wait {
            dev.compute_waits_for(&copied)?;
        }
        staging = buf;
        drop(host.wait()?);
        before_read = after;
    }
    assert_eq!(read(&staging)?, vec![4; 128]);
    dev.free_after(staging, None)
}

#[test]
fn activation_staging_passes_and_fails_without_each_of_its_ordering_calls() {
    let dev = device();
    reload_activations(&dev, false, false).unwrap();
    dev.check_ordering().unwrap();

    let dev = device();
    let e = reload_activations(&dev, true, false).unwrap_err();
    assert!(e.to_string().contains("compute access to a buffer whose htod was waited for neither"), "{e}");
    assert_eq!(hazard(dev.check_ordering()), OrderingHazard::ComputeBeforeHtod);

    let dev = device();
    let e = reload_activations(&dev, false, true).unwrap_err();
    assert!(e.to_string().contains("htod into a buffer compute used after the `after` event"), "{e}");
    assert_eq!(hazard(dev.check_ordering()), OrderingHazard::HtodOverComputeAccess);
}

/// A buffer compute used, freed: `free_after` an event after the use, or a wait before the drop.
#[test]
fn a_free_passes_when_ordered_and_a_bare_drop_is_reported_by_the_next_call() {
    let dev = device();
    let mut a = dev.alloc_for_compute(64).unwrap();
    write(&mut a, 1);
    let done = dev.record_compute_event().unwrap();
    dev.free_after(a, Some(&done)).unwrap();
    let b = dev.alloc_for_compute(64).unwrap();
    read(&b).unwrap();
    dev.copy_waits_for_compute().unwrap();
    drop(b);
    dev.check_ordering().unwrap();

    let c = dev.alloc_for_compute(64).unwrap();
    read(&c).unwrap();
    drop(c); // the ordering call removed
    let e = dev.alloc(64).unwrap_err();
    assert!(
        e.to_string().contains("drop (free) of a buffer compute used after the copy stream's last ordering"),
        "{e}"
    );
    assert!(e.to_string().contains("fix: free it with Device::free_after"), "{e}");
    assert_eq!(hazard(dev.check_ordering()), OrderingHazard::DropBeforeComputeAccess);
    let v = dev.as_sim().unwrap().ordering_violations();
    assert_eq!((v.len(), v[0].num_bytes), (1, 64));
}

#[test]
fn events_of_the_sim_device_carry_its_clocks() {
    let dev = device();
    let DeviceEvent::Sim(e0) = dev.record_compute_event().unwrap() else { unreachable!() };
    // The allocation is copy 1 (stream-ordered on the copy stream); compute waits for it.
    let mut a = dev.alloc_for_compute(8).unwrap();
    write(&mut a, 0);
    let DeviceEvent::Sim(e1) = dev.record_compute_event().unwrap() else { unreachable!() };
    assert_eq!((e0.compute_pos(), e1.compute_pos()), (0, 1));
    assert_eq!((e0.copy_id(), e1.copy_id()), (0, 1), "compute is ordered after the allocation");
    let (t, copied) = dev.dtoh_after(a, pool().alloc(8).unwrap(), Some(&DeviceEvent::Sim(e1))).unwrap();
    let DeviceEvent::Sim(c) = copied else { unreachable!() };
    assert_eq!((c.copy_id(), c.compute_pos()), (2, 1));
    dev.free_after(t.wait().unwrap().1, None).unwrap();
}

/// A buffer compute uses first: allocated for compute, or ordered after its allocation some
/// other way (all copies, or an H2D into it that compute waited for); a plain allocation used by
/// compute at once is reported.
#[test]
fn compute_must_follow_a_buffer_s_allocation() {
    let dev = device();
    let mut a = dev.alloc_for_compute(16).unwrap();
    write(&mut a, 1);
    let b = dev.alloc(16).unwrap();
    dev.compute_waits_for_copies().unwrap();
    read(&b).unwrap();
    let (t, copied) = dev.htod_after(pool().alloc_copy(&[5; 16]).unwrap(), dev.alloc(16).unwrap(), None).unwrap();
    let (c, _host) = t.release_device().unwrap();
    dev.compute_waits_for(&copied).unwrap();
    assert_eq!(read(&c).unwrap(), vec![5; 16], "the H2D's event covers the allocation before it");
    for buf in [a, b, c] {
        dev.free_after(buf, None).unwrap();
    }
    dev.check_ordering().unwrap();

    let mut d = dev.alloc(16).unwrap();
    let e = d.as_sim_mut().unwrap().compute_write().map(|_| ()).unwrap_err();
    assert!(e.to_string().contains("allocated on the copy stream that compute was not ordered after"), "{e}");
    assert!(e.to_string().contains("fix: allocate a buffer compute uses first with Device::alloc_for_compute"), "{e}");
    assert_eq!(hazard(dev.check_ordering()), OrderingHazard::ComputeBeforeAlloc);
    dev.free_after(d, None).unwrap();
}

/// The runtime's sim device counts no host wait as ordering compute after an H2D (its contract:
/// compute waits on the copy's event); the default device counts it.
#[test]
fn a_host_wait_orders_compute_only_where_host_waits_count() {
    for counted in [true, false] {
        let dev = Device::Sim(
            SimDevice::new(SimDeviceConfig { host_wait_orders_compute: counted, ..Default::default() }).unwrap(),
        );
        let (t, copied) = dev.htod_after(pool().alloc_copy(&[3; 8]).unwrap(), dev.alloc(8).unwrap(), None).unwrap();
        let (_, buf) = t.wait().unwrap();
        match read(&buf) {
            Ok(v) => assert!(counted, "a host wait ordered compute where it must not: {v:?}"),
            Err(e) => {
                assert!(!counted, "{e}");
                assert_eq!(hazard(Err::<(), _>(e)), OrderingHazard::ComputeBeforeHtod);
                dev.compute_waits_for(&copied).unwrap();
                assert_eq!(read(&buf).unwrap(), vec![3; 8], "the event orders it");
            }
        }
        dev.free_after(buf, None).unwrap();
    }
}

/// One step of a random program over a few device buffers ("slots").
#[derive(Debug, Clone, Copy)]
enum Op {
    /// A kernel writes the slot (fills it with a new value).
    Write(usize),
    /// A kernel reads the slot.
    Read(usize),
    /// Record a compute event for later `_after` calls.
    Record,
    /// D2H of the slot, after a valid event (which one: the `u8`), checking its bytes.
    Dtoh(usize, u8),
    /// H2D of a new value into the slot (reuse), after a valid event; `true`: handed to compute
    /// early, waited for by compute before the next access.
    Htod(usize, u8, bool),
    /// Free the slot after a valid event and allocate a new buffer there.
    Free(usize, u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..3usize).prop_map(Op::Write),
        (0..3usize).prop_map(Op::Read),
        Just(Op::Record),
        (0..3usize, any::<u8>()).prop_map(|(s, c)| Op::Dtoh(s, c)),
        (0..3usize, any::<u8>(), any::<bool>()).prop_map(|(s, c, e)| Op::Htod(s, c, e)),
        (0..3usize, any::<u8>()).prop_map(|(s, c)| Op::Free(s, c)),
    ]
}

/// A slot of the program and what the program knows of it.
struct Slot {
    buf: Option<DeviceBuffer>,
    /// The bytes' value, when known.
    value: Option<u8>,
    /// Compute steps (counted by the program) of the last write and the last access.
    last_write: u64,
    last_access: u64,
    /// An early-released H2D compute has not waited for: its copy's event and number.
    pending: Option<(DeviceEvent, u64)>,
}

/// Runs `ops` with correct ordering, except — when `stale` is set — the first `_after` call for
/// which an event recorded before the buffer's relevant access exists gets that event, and the
/// call must fail. Returns the hazard the stale call raised, if one was made.
fn run_program(ops: &[Op], stale: bool) -> Option<OrderingHazard> {
    const LEN: usize = 32;
    let dev = device();
    let pool = pool();
    let mut slots: Vec<Slot> = (0..3)
        .map(|_| Slot {
            buf: Some(dev.alloc_for_compute(LEN).unwrap()),
            value: None,
            last_write: 0,
            last_access: 0,
            pending: None,
        })
        .collect();
    let mut step = 0u64; // compute accesses so far
    let mut copies = 0u64; // copies so far
    let mut compute_saw_copy = 0u64; // the program's view of what compute waited for
    let mut events: Vec<(u64, DeviceEvent)> = Vec::new(); // (step when recorded, event)

    // A valid event for an access at `last` (`None`: the plain form), or a stale one.
    let pick = |events: &[(u64, DeviceEvent)], last: u64, choice: u8, stale: bool| -> Option<Option<DeviceEvent>> {
        let fit: Vec<&DeviceEvent> =
            events.iter().filter(|(at, _)| if stale { *at < last } else { *at >= last }).map(|(_, e)| e).collect();
        if stale {
            return fit.last().map(|e| Some((*e).clone()));
        }
        let k = choice as usize % (fit.len() + 1);
        Some(fit.get(k).map(|e| (*e).clone()))
    };
    // Compute may touch the slot: an early H2D is waited for first, one way or the other.
    let before_compute = |dev: &Device, slot: &mut Slot, compute_saw_copy: &mut u64, all: bool, copies: u64| {
        if let Some((ev, n)) = slot.pending.take() {
            if *compute_saw_copy < n {
                if all {
                    dev.compute_waits_for_copies().unwrap();
                    *compute_saw_copy = copies;
                } else {
                    dev.compute_waits_for(&ev).unwrap();
                    *compute_saw_copy = n;
                }
            }
        }
    };

    for (i, &op) in ops.iter().enumerate() {
        match op {
            Op::Write(s) => {
                before_compute(&dev, &mut slots[s], &mut compute_saw_copy, i % 2 == 0, copies);
                step += 1;
                let v = (i % 251) as u8;
                write(slots[s].buf.as_mut().unwrap(), v);
                let slot = &mut slots[s];
                (slot.value, slot.last_write, slot.last_access) = (Some(v), step, step);
            }
            Op::Read(s) => {
                before_compute(&dev, &mut slots[s], &mut compute_saw_copy, i % 2 == 0, copies);
                step += 1;
                let got = read(slots[s].buf.as_ref().unwrap()).unwrap();
                if let Some(v) = slots[s].value {
                    assert_eq!(got, vec![v; LEN]);
                }
                slots[s].last_access = step;
            }
            Op::Record => events.push((step, dev.record_compute_event().unwrap())),
            Op::Dtoh(s, c) | Op::Htod(s, c, _) | Op::Free(s, c) => {
                let last = if matches!(op, Op::Dtoh(..)) { slots[s].last_write } else { slots[s].last_access };
                let after = match pick(&events, last, c, stale) {
                    Some(a) => {
                        if stale {
                            let buf = slots[s].buf.take().unwrap();
                            let r = match op {
                                Op::Dtoh(..) => dev.dtoh_after(buf, pool.alloc(LEN).unwrap(), a.as_ref()).map(|_| ()),
                                Op::Htod(..) => dev.htod_after(pool.alloc(LEN).unwrap(), buf, a.as_ref()).map(|_| ()),
                                _ => dev.free_after(buf, a.as_ref()),
                            };
                            return Some(hazard(r));
                        }
                        a
                    }
                    None => pick(&events, last, c, false).unwrap(),
                };
                let buf = slots[s].buf.take().unwrap();
                copies += u64::from(!matches!(op, Op::Free(..)));
                match op {
                    Op::Dtoh(..) => {
                        let (t, _) = dev.dtoh_after(buf, pool.alloc(LEN).unwrap(), after.as_ref()).unwrap();
                        let (host, buf) = t.wait().unwrap();
                        if let Some(v) = slots[s].value {
                            assert_eq!(host.as_slice(), &[v; LEN][..]);
                        }
                        slots[s].buf = Some(buf);
                    }
                    Op::Htod(_, _, early) => {
                        let v = (i % 253) as u8;
                        let src = pool.alloc_copy(&[v; LEN]).unwrap();
                        let (t, copied) = dev.htod_after(src, buf, after.as_ref()).unwrap();
                        let buf = if early {
                            let (buf, host) = t.release_device().unwrap();
                            drop(host);
                            slots[s].pending = Some((copied, copies));
                            buf
                        } else {
                            t.wait().unwrap().1
                        };
                        slots[s].buf = Some(buf);
                        slots[s].value = Some(v);
                    }
                    _ => {
                        dev.free_after(buf, after.as_ref()).unwrap();
                        let slot = &mut slots[s];
                        *slot = Slot {
                            buf: Some(dev.alloc_for_compute(LEN).unwrap()),
                            value: None,
                            last_write: 0,
                            last_access: 0,
                            pending: None,
                        };
                    }
                }
            }
        }
    }
    if stale {
        // No stale call in the program: add one at the end.
        let mut buf = slots[0].buf.take().unwrap();
        before_compute(&dev, &mut slots[0], &mut compute_saw_copy, true, copies);
        let early = dev.record_compute_event().unwrap();
        write(&mut buf, 1);
        return Some(hazard(dev.dtoh_after(buf, pool.alloc(LEN).unwrap(), Some(&early))));
    }
    for slot in &mut slots {
        dev.free_after(slot.buf.take().unwrap(), None).unwrap();
    }
    dev.check_ordering().unwrap();
    assert!(dev.as_sim().unwrap().ordering_violations().is_empty());
    None
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// Programs that order every copy, compute access and free raise nothing.
    #[test]
    fn ordered_programs_raise_nothing(ops in proptest::collection::vec(op(), 0..80)) {
        prop_assert_eq!(run_program(&ops, false), None);
    }

    /// The same programs with one stale `after` event are caught, naming the operation.
    #[test]
    fn one_stale_event_is_caught(ops in proptest::collection::vec(op(), 0..80)) {
        let h = run_program(&ops, true);
        prop_assert!(matches!(
            h,
            Some(
                OrderingHazard::DtohBeforeComputeWrite
                    | OrderingHazard::HtodOverComputeAccess
                    | OrderingHazard::FreeBeforeComputeAccess
            )
        ), "{:?}", h);
    }
}

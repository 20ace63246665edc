//! The extent allocator of one store file: best-fit over free ranges, with coalescing.
//!
//! | concept | what it is |
//! |---|---|
//! | granule | [`GRANULE_BYTES`] (4 KiB): every offset and length is a multiple of it, so O_DIRECT accepts them |
//! | free range | `(offset, len)` in bytes, kept twice: by offset (to coalesce) and by `(len, offset)` (to find the best fit) |
//! | best fit | the smallest free range that holds the request, lowest offset among equals |
//!
//! The two-index layout (by address for coalescing, by size for fitting) is the classic one of
//! Knuth's boundary-tag allocators and of foyer's region allocator; it costs `O(log n)` per call.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Error, Result};
use crate::tier::Tier;

/// Granularity of offsets and lengths in bytes (the O_DIRECT alignment of this store).
pub const GRANULE_BYTES: u64 = 4096;

/// Free-space map of one file of `capacity_bytes`: hands out granule-aligned ranges.
#[derive(Debug, Clone)]
pub struct ExtentAllocator {
    capacity_bytes: u64,
    free_bytes: u64,
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
}

impl ExtentAllocator {
    /// An allocator over `[0, capacity_bytes)` rounded down to [`GRANULE_BYTES`], all free.
    pub fn new(capacity_bytes: u64) -> Self {
        let capacity_bytes = capacity_bytes / GRANULE_BYTES * GRANULE_BYTES;
        let mut a = Self { capacity_bytes, free_bytes: 0, by_offset: BTreeMap::new(), by_size: BTreeSet::new() };
        if capacity_bytes > 0 {
            a.insert(0, capacity_bytes);
        }
        a
    }

    /// Bytes managed (a multiple of [`GRANULE_BYTES`]).
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Bytes free (possibly fragmented).
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Number of free ranges (1 when nothing is fragmented, 0 when full).
    pub fn free_ranges(&self) -> usize {
        self.by_offset.len()
    }

    /// Bytes of the largest free range.
    pub fn largest_free_bytes(&self) -> u64 {
        self.by_size.iter().next_back().map_or(0, |&(len, _)| len)
    }

    fn insert(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
        self.free_bytes += len;
    }

    fn remove(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
        self.free_bytes -= len;
    }

    /// Allocates `len_bytes` rounded up to [`GRANULE_BYTES`]; returns the byte offset.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] on [`Tier::Nvme`] when no free range is large enough
    /// (`available_bytes` is the free total, which may be fragmented); [`Error::InvalidRequest`]
    /// for `len_bytes == 0`.
    pub fn alloc(&mut self, len_bytes: u64) -> Result<u64> {
        if len_bytes == 0 {
            return Err(Error::InvalidRequest("extent allocation of 0 bytes".into()));
        }
        let len = len_bytes.next_multiple_of(GRANULE_BYTES);
        let Some(&(free_len, offset)) = self.by_size.range((len, 0)..).next() else {
            return Err(Error::OutOfMemory {
                tier: Tier::Nvme,
                requested_bytes: len,
                available_bytes: self.free_bytes,
            });
        };
        self.remove(offset, free_len);
        if free_len > len {
            self.insert(offset + len, free_len - len);
        }
        Ok(offset)
    }

    /// Returns `[offset, offset + len_bytes)` (length rounded up to [`GRANULE_BYTES`]) to the free
    /// map, merging it with free neighbours.
    ///
    /// # Errors
    /// [`Error::InvalidRequest`] when the range is unaligned, outside the file, or overlaps free
    /// space (a double free); the map is left unchanged.
    pub fn free(&mut self, offset: u64, len_bytes: u64) -> Result<()> {
        let len = len_bytes.next_multiple_of(GRANULE_BYTES);
        let end = offset.checked_add(len).filter(|&e| e <= self.capacity_bytes);
        let bad = |why: &str| Error::InvalidRequest(format!("extent free [{offset}, +{len}) {why}"));
        let Some(end) = end else { return Err(bad("is outside the file")) };
        if offset % GRANULE_BYTES != 0 || len == 0 {
            return Err(bad("is not 4 KiB-aligned or is empty"));
        }
        let prev = self.by_offset.range(..=offset).next_back().map(|(&o, &l)| (o, l));
        let next = self.by_offset.range(offset..).next().map(|(&o, &l)| (o, l));
        if prev.is_some_and(|(o, l)| o + l > offset) || next.is_some_and(|(o, _)| o < end) {
            return Err(bad("overlaps free space (double free)"));
        }
        let (mut start, mut stop) = (offset, end);
        if let Some((o, l)) = prev.filter(|&(o, l)| o + l == offset) {
            self.remove(o, l);
            start = o;
        }
        if let Some((o, l)) = next.filter(|&(o, _)| o == end) {
            self.remove(o, l);
            stop = o + l;
        }
        self.insert(start, stop - start);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn allocations_do_not_overlap_and_coalesce_back_to_one_range() {
        let mut a = ExtentAllocator::new(1 << 20);
        let x = a.alloc(10_000).unwrap();
        let y = a.alloc(4096).unwrap();
        let z = a.alloc(100_000).unwrap();
        let mut r = [(x, 12288), (y, 4096), (z, 102_400)];
        r.sort();
        for w in r.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{r:?} overlap");
        }
        assert_eq!(a.free_bytes(), (1 << 20) - 12288 - 4096 - 102_400);
        a.free(y, 4096).unwrap();
        assert_eq!(a.free_ranges(), 2, "a hole and the tail");
        a.free(x, 10_000).unwrap();
        assert_eq!(a.free_ranges(), 2, "x merged with y's hole");
        a.free(z, 100_000).unwrap();
        assert_eq!(a.free_ranges(), 1);
        assert_eq!(a.largest_free_bytes(), 1 << 20);
    }

    #[test]
    fn best_fit_takes_the_smallest_hole() {
        let mut a = ExtentAllocator::new(64 * 4096);
        let offs: Vec<u64> = (0..8).map(|_| a.alloc(4 * 4096).unwrap()).collect();
        a.free(offs[1], 4 * 4096).unwrap(); // hole of 4 pages
        a.free(offs[4], 4 * 4096).unwrap();
        a.free(offs[5], 4 * 4096).unwrap(); // hole of 8 pages
        assert_eq!(a.alloc(3 * 4096).unwrap(), offs[1]);
        assert_eq!(a.alloc(6 * 4096).unwrap(), offs[4]);
    }

    #[test]
    fn full_store_reports_out_of_memory_on_nvme() {
        let mut a = ExtentAllocator::new(8 * 4096);
        let _x = a.alloc(6 * 4096).unwrap();
        match a.alloc(3 * 4096) {
            Err(Error::OutOfMemory { tier: Tier::Nvme, requested_bytes, available_bytes }) => {
                assert_eq!(requested_bytes, 3 * 4096);
                assert_eq!(available_bytes, 2 * 4096);
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
    }

    #[test]
    fn double_free_and_bad_ranges_are_refused_without_change() {
        let mut a = ExtentAllocator::new(16 * 4096);
        let x = a.alloc(4096).unwrap();
        a.free(x, 4096).unwrap();
        let before = a.free_bytes();
        assert!(matches!(a.free(x, 4096), Err(Error::InvalidRequest(_))));
        assert!(matches!(a.free(100, 4096), Err(Error::InvalidRequest(_))));
        assert!(matches!(a.free(15 * 4096, 8192), Err(Error::InvalidRequest(_))));
        assert_eq!(a.free_bytes(), before);
    }

    proptest! {
        #[test]
        fn random_alloc_free_keeps_the_map_consistent(ops in prop::collection::vec((any::<bool>(), 1u64..40_000), 1..200)) {
            let cap = 256 * 4096;
            let mut a = ExtentAllocator::new(cap);
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (is_alloc, len) in ops {
                if is_alloc || live.is_empty() {
                    if let Ok(off) = a.alloc(len) {
                        let len = len.next_multiple_of(GRANULE_BYTES);
                        for &(o, l) in &live {
                            prop_assert!(off + len <= o || o + l <= off, "overlap");
                        }
                        live.push((off, len));
                    }
                } else {
                    let (o, l) = live.swap_remove(len as usize % live.len());
                    a.free(o, l).unwrap();
                }
                let used: u64 = live.iter().map(|&(_, l)| l).sum();
                prop_assert_eq!(a.free_bytes() + used, cap);
            }
            for (o, l) in live.drain(..) {
                a.free(o, l).unwrap();
            }
            prop_assert_eq!(a.free_ranges(), 1);
        }
    }
}

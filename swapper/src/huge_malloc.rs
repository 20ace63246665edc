//! The process allocator of `oogc train` ([`HugePageMalloc`]): the system's malloc, with every
//! block of [`HUGE_ADVICE_MIN_BYTES`] or more advised to the kernel as transparent-huge-page
//! memory (`madvise(MADV_HUGEPAGE)` on its 2 MiB-aligned interior).
//!
//! Why: candle allocates each tensor afresh, and a step of a large model makes many big ones (a
//! unit's fetched weights, their gradients, the MLP's hidden activations: 177 MB each at d_model
//! 2048). glibc's malloc maps blocks above its mmap threshold (32 MiB at most) afresh every time
//! and unmaps them on free, so each step faults every page of them in again: 227 M minor faults
//! over 8 steps of the README's beyond-RAM run, 464 s of system time. With 2 MiB pages a block
//! faults 512 × fewer times. This is what glibc's own `glibc.malloc.hugetlb=1` tunable does (it
//! advises the blocks malloc maps), without the environment variable. Blocks the runtime itself
//! reuses step after step come from pools (the optimizer's `GradPool` for gradients, the pinned
//! pools): they fault once. [`tune_malloc`] sets the rest of malloc for training.
//!
//! The advice is best effort: with THP `never` in
//! `/sys/kernel/mm/transparent_hugepage/enabled` it does nothing, and memory works the same.
//! Resident bytes do not grow for blocks that are written whole (every tensor is); a block's
//! unaligned head and tail keep 4 KiB pages.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};

use crate::host::HUGE_PAGE_BYTES;

/// Blocks at least this large (bytes) are advised as huge-page memory.
pub const HUGE_ADVICE_MIN_BYTES: usize = MMAP_THRESHOLD_BYTES;

/// glibc's mmap threshold as [`tune_malloc`] fixes it, bytes: blocks below it come from malloc's
/// heaps (reused after a free), blocks from it up are mapped afresh (and advised by
/// [`HugePageMalloc`]). 32 MiB is glibc's largest (`DEFAULT_MMAP_THRESHOLD_MAX`).
pub const MMAP_THRESHOLD_BYTES: usize = 32 << 20;

/// The trim threshold `oogc` runs with ([`tune_malloc`]), bytes: free memory kept at the top of a
/// malloc heap. Measured on a 19.3 M-parameter Llama with a 32 k vocabulary (batch 4 × 128, the
/// sim device; `target/release/oogc train`, 8 steps, glibc's arenas per thread): minor faults per
/// step after the first four 52–60 k with 64 MiB, 2.6–4.7 k with 256 MiB, 3.2–18.6 k with 1 GiB
/// (glibc's default, dynamic from 128 KiB: 52–64 k); peak RSS 748, 748 and 741 MB. With one arena
/// and the pools (as `oogc` runs now): 160 faults per step from the third, peak RSS 659–680 MB.
pub const TRIM_THRESHOLD_BYTES: usize = 256 << 20;

/// Sets glibc's malloc for a training process (`mallopt`): one arena for every thread (glibc
/// gives threads arenas of their own, up to 8 per core, and memory freed in one is not reused by
/// another: the same run's peak RSS then varied by 90 MB from run to run with a 32 k vocabulary,
/// against none with one arena, 50–140 MB lower), the mmap threshold fixed at
/// [`MMAP_THRESHOLD_BYTES`] (instead of glibc's dynamic one, which starts at 128 KiB and moves with
/// each freed mapping), and the trim threshold at `trim_bytes` (free memory at the top of a heap
/// kept for reuse instead of given back: candle's per-step temporaries, freed and made again
/// every step, then stay mapped instead of faulting their pages in again). Returns whether glibc
/// took both (false on another C library, which keeps its own defaults).
pub fn tune_malloc(trim_bytes: usize) -> bool {
    let trim = libc::c_int::try_from(trim_bytes).unwrap_or(libc::c_int::MAX);
    #[cfg(target_env = "gnu")]
    {
        // SAFETY: mallopt only sets malloc's parameters (thread-safe in glibc, under its lock).
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1) == 1
                && libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, trim) == 1
        }
    }
    #[cfg(not(target_env = "gnu"))]
    {
        let _ = trim;
        false
    }
}

/// The system allocator with large blocks advised `MADV_HUGEPAGE` (module docs). Install it in
/// a binary with `#[global_allocator]`.
#[derive(Debug, Clone, Copy, Default)]
pub struct HugePageMalloc;

/// Advises the 2 MiB-aligned interior of `[ptr, ptr + len)` as huge-page memory.
fn advise(ptr: *mut u8, len: usize) {
    if ptr.is_null() || len < HUGE_ADVICE_MIN_BYTES {
        return;
    }
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE_BYTES);
    let end = (ptr as usize + len) / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
    if end > start {
        // SAFETY: `[start, end)` lies inside the block the allocator has just handed out (mapped
        // memory, page-aligned since 2 MiB-aligned). `MADV_HUGEPAGE` changes only how the kernel
        // backs the pages, never their contents; its failure (THP off, old kernel) is harmless and
        // ignored.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

// SAFETY: every call is forwarded to `System` with the caller's arguments, so `System`'s
// guarantees hold; `advise` only gives the kernel advice about memory of the returned block.
unsafe impl GlobalAlloc for HugePageMalloc {
    /// `System`'s `alloc`, then the advice for a large block.
    ///
    /// # Safety
    /// As [`GlobalAlloc::alloc`]: the caller's layout (and pointer) contract.
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout (non-zero size per GlobalAlloc's contract).
        let p = unsafe { System.alloc(layout) };
        advise(p, layout.size());
        p
    }

    /// `System`'s `alloc_zeroed`, then the advice for a large block.
    ///
    /// # Safety
    /// As [`GlobalAlloc::alloc_zeroed`]: the caller's layout (and pointer) contract.
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`. calloc does not touch freshly mapped blocks (they are zero), so the
        // advice comes before their first fault.
        let p = unsafe { System.alloc_zeroed(layout) };
        advise(p, layout.size());
        p
    }

    /// `System`'s `dealloc`.
    ///
    /// # Safety
    /// As [`GlobalAlloc::dealloc`]: `ptr` came from this allocator with `layout`.
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` through this allocator with `layout` (caller's contract).
        unsafe { System.dealloc(ptr, layout) }
    }

    /// `System`'s `realloc`, then the advice for a large block.
    ///
    /// # Safety
    /// As [`GlobalAlloc::realloc`]: the caller's layout (and pointer) contract.
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as given (caller's contract: `ptr` from this allocator with `layout`).
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        advise(p, new_size);
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_of_every_size_work_as_memory() {
        let a = HugePageMalloc;
        for size in [1, 4096, HUGE_ADVICE_MIN_BYTES - 1, HUGE_ADVICE_MIN_BYTES, 40 << 20] {
            let layout = Layout::from_size_align(size, 64).unwrap();
            // SAFETY: non-zero layout; the block is written within its size, then freed once
            // with its layout.
            unsafe {
                let p = a.alloc_zeroed(layout);
                assert!(!p.is_null());
                assert_eq!(*p.add(size - 1), 0, "zeroed");
                std::ptr::write_bytes(p, 7, size);
                let q = a.realloc(p, layout, size * 2);
                assert!(!q.is_null());
                assert_eq!(*q.add(size - 1), 7, "realloc keeps the contents");
                a.dealloc(q, Layout::from_size_align(size * 2, 64).unwrap());
            }
        }
    }
}

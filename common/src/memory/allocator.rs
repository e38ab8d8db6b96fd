//! The counting allocator: live bytes, their peak, and live bytes per tag.
//!
//! Every block carries a small header in front of it holding the tag that was current when it
//! was allocated (see [`super::scope`]), so that freeing it is charged to the same tag, whatever
//! thread frees it and whenever. Blocks are the system allocator's; on glibc the allocator is
//! first told to keep freed memory in the process (mmap threshold 32 MiB, trim threshold
//! 1 GiB), so that the activation buffers of one step are reused by the next instead of being
//! returned to the kernel and faulted in again, zeroed, page by page (measured: about 5% of a
//! ResNet-50 step on this machine's CPU); and to serve every thread from one arena. A
//! checkpointed segment is recomputed on a helper thread of its own, which glibc would give an
//! arena of its own: the recomputation's activations came from fresh pages while the memory
//! the main thread had freed sat in another arena (measured on ResNet-50, batch 4, 224 px, 2
//! cores, `examples/checkpoint_memory.rs` with 12 interleaved steps, run twice: checkpointing's
//! time ratio 1.28 and 1.30 with per-thread arenas, 1.23 and 1.25 with one).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU32, AtomicUsize, Ordering};

pub(super) static CURRENT: AtomicUsize = AtomicUsize::new(0);
pub(super) static PEAK: AtomicUsize = AtomicUsize::new(0);
/// The most live bytes since the last [`take_window_peak`]: a timeline's sampler reads it, so
/// that a peak between two samples is not lost.
pub(super) static WINDOW_PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Tags: 0 is "untagged". Live bytes per tag (signed: a block may be freed under another).
pub(super) const TAGS: usize = 4096;
#[allow(clippy::declare_interior_mutable_const)]
const ZERO: AtomicIsize = AtomicIsize::new(0);
pub(super) static TAG_LIVE: [AtomicIsize; TAGS] = [ZERO; TAGS];
/// The tag new blocks get.
pub(super) static CURRENT_TAG: AtomicU32 = AtomicU32::new(0);

/// The header in front of each block: its tag (at 8 bytes before the user's pointer) and its
/// slot (at 4).
const HEADER: usize = 16;

/// Slots: blocks allocated by the threads of one in-process data-parallel peer (its training
/// thread and the helpers it starts) are charged to its slot, whichever thread frees them, so
/// that each peer has a meter of its own ([`SlotMeter`]) though all share the process's heap.
/// Slot 0: no peer.
pub const SLOTS: usize = 64;
/// Per slot: live bytes, their peak since [`SlotMeter::reset_peak`] and since the last window;
/// and the next slot [`fresh_slot`] hands out.
struct Slots {
    live: [AtomicUsize; SLOTS],
    peak: [AtomicUsize; SLOTS],
    window: [AtomicUsize; SLOTS],
    next: AtomicU32,
}

#[allow(clippy::declare_interior_mutable_const)]
const UZERO: AtomicUsize = AtomicUsize::new(0);
static SLOTS_OF: Slots = Slots {
    live: [UZERO; SLOTS],
    peak: [UZERO; SLOTS],
    window: [UZERO; SLOTS],
    next: AtomicU32::new(0),
};

thread_local! {
    /// The slot this thread's blocks are charged to (a const initialiser, no destructor: read
    /// by the allocator itself).
    static SLOT: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// A slot no thread took lately (they are handed out in turn, 1 to `SLOTS - 1`), for a new
/// peer: bytes a peer of an earlier group left live are not counted as the new one's.
pub fn fresh_slot() -> u32 {
    SLOTS_OF.next.fetch_add(1, Ordering::Relaxed) % (SLOTS as u32 - 1) + 1
}

/// The calling thread's slot (0: none).
pub fn thread_slot() -> u32 {
    SLOT.try_with(|slot| slot.get()).unwrap_or(0)
}

/// Charges the blocks the calling thread allocates from now on to `slot` (below [`SLOTS`]; 0:
/// none); returns the slot it had.
pub fn set_thread_slot(slot: u32) -> u32 {
    let slot = if (slot as usize) < SLOTS { slot } else { 0 };
    SLOT.try_with(|current| current.replace(slot)).unwrap_or(0)
}

/// The live bytes charged to `slot`, and their peak since `reset_peak`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotMeter(pub u32);

impl super::Meter for SlotMeter {
    fn live(&self) -> u64 {
        SLOTS_OF.live[self.0 as usize % SLOTS].load(Ordering::Relaxed) as u64
    }

    fn reset_peak(&self) -> u64 {
        let slot = self.0 as usize % SLOTS;
        let now = SLOTS_OF.live[slot].load(Ordering::Relaxed);
        SLOTS_OF.peak[slot].store(now, Ordering::Relaxed);
        now as u64
    }

    fn peak(&self) -> u64 {
        SLOTS_OF.peak[self.0 as usize % SLOTS].load(Ordering::Relaxed) as u64
    }

    fn window_peak(&self) -> u64 {
        let slot = self.0 as usize % SLOTS;
        let now = SLOTS_OF.live[slot].load(Ordering::Relaxed);
        SLOTS_OF.window[slot].swap(now, Ordering::Relaxed).max(now) as u64
    }
}

/// The system allocator, counting live bytes, their peak, and live bytes per tag.
pub struct CountingAllocator;

/// Live bytes per tag at the last peak (tags below [`SNAPSHOT_TAGS`]), kept when
/// [`super::snapshot_peaks`] is on.
pub(super) const SNAPSHOT_TAGS: usize = 256;
pub(super) static TAG_AT_PEAK: [AtomicIsize; SNAPSHOT_TAGS] = [ZERO; SNAPSHOT_TAGS];
pub(super) static SNAPSHOT: AtomicBool = AtomicBool::new(false);
static SNAPSHOTTING: AtomicBool = AtomicBool::new(false);

impl CountingAllocator {
    fn grew(size: usize, tag: u32, slot: u32) {
        if slot != 0 {
            let slot = slot as usize % SLOTS;
            let now = SLOTS_OF.live[slot].fetch_add(size, Ordering::Relaxed) + size;
            SLOTS_OF.peak[slot].fetch_max(now, Ordering::Relaxed);
            SLOTS_OF.window[slot].fetch_max(now, Ordering::Relaxed);
        }
        TAG_LIVE[tag as usize].fetch_add(size as isize, Ordering::Relaxed);
        let now = CURRENT.fetch_add(size, Ordering::Relaxed) + size;
        WINDOW_PEAK.fetch_max(now, Ordering::Relaxed);
        let before = PEAK.fetch_max(now, Ordering::Relaxed);
        if now > before && SNAPSHOT.load(Ordering::Relaxed) {
            // A new peak: copy the per-tag counters (one thread at a time; a peak reached
            // while another thread copies is caught by the next allocation).
            if !SNAPSHOTTING.swap(true, Ordering::Acquire) {
                for (at_peak, live) in TAG_AT_PEAK.iter().zip(&TAG_LIVE) {
                    at_peak.store(live.load(Ordering::Relaxed), Ordering::Relaxed);
                }
                SNAPSHOTTING.store(false, Ordering::Release);
            }
        }
    }

    fn shrank(size: usize, tag: u32, slot: u32) {
        if slot != 0 {
            SLOTS_OF.live[slot as usize % SLOTS].fetch_sub(size, Ordering::Relaxed);
        }
        CURRENT.fetch_sub(size, Ordering::Relaxed);
        TAG_LIVE[tag as usize].fetch_sub(size as isize, Ordering::Relaxed);
    }

    /// The offset of the user's block in the system's, and the system's layout.
    fn outer(layout: Layout) -> Option<(usize, Layout)> {
        let offset = layout.align().max(HEADER);
        let size = layout.size().checked_add(offset)?;
        Some((offset, Layout::from_size_align(size, offset).ok()?))
    }
}

/// On glibc: keep freed memory in the process, one arena for all threads (see the module
/// docs). Once.
fn tune_system_allocator() {
    static TUNED: AtomicBool = AtomicBool::new(false);
    if TUNED.swap(true, Ordering::Relaxed) {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets glibc's parameters; it neither allocates through Rust nor
    // touches memory of ours.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Says, before the process aborts on a failed allocation, how big it was and what to change
/// (Rust aborts on allocation failure; nothing can be returned to the caller). Writes to stderr
/// from a stack buffer: allocating here could fail again.
fn report_failed_allocation(size: usize) {
    use std::io::Write;
    struct Buffer {
        bytes: [u8; 512],
        len: usize,
    }
    impl std::fmt::Write for Buffer {
        fn write_str(&mut self, text: &str) -> std::fmt::Result {
            let room = self.bytes.len() - self.len;
            let n = text.len().min(room);
            self.bytes[self.len..self.len + n].copy_from_slice(&text.as_bytes()[..n]);
            self.len += n;
            Ok(())
        }
    }
    let mut buffer = Buffer {
        bytes: [0; 512],
        len: 0,
    };
    let gib = size as f64 / (1024.0 * 1024.0 * 1024.0);
    let live = CURRENT.load(Ordering::Relaxed) as f64 / (1024.0 * 1024.0 * 1024.0);
    let _ = std::fmt::write(
        &mut buffer,
        format_args!(
            "memsave: error: out of memory: a buffer of {size} bytes ({gib:.1} GiB) could not be \\
             allocated, with {live:.1} GiB already in use. Lower the batch size or the image \\
             size, or save memory with a strategy: mixed precision, gradient accumulation over \\
             smaller batches, gradient checkpointing.\\n"
        ),
    );
    let _ = std::io::stderr().write_all(&buffer.bytes[..buffer.len]);
}

// SAFETY: every block is the system allocator's, `offset` bytes further in than the system's
// pointer, with the tag and the slot written in the `HEADER` bytes just before the user's
// pointer; `outer`
// gives the same layout for the same user layout on allocation and deallocation. Counters are
// updated around the calls; nothing here allocates (the failure report writes from the stack).
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        unsafe { self.allocate(layout, false) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        unsafe { self.allocate(layout, true) }
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        let (offset, outer) = Self::outer(layout).expect("the layout was allocated");
        let tag = unsafe { (pointer.sub(8) as *const u32).read() };
        let slot = unsafe { (pointer.sub(4) as *const u32).read() };
        unsafe { System.dealloc(pointer.sub(offset), outer) };
        Self::shrank(layout.size(), tag, slot);
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (offset, outer) = Self::outer(layout).expect("the layout was allocated");
        let Some(new_outer_size) = new_size.checked_add(offset) else {
            report_failed_allocation(new_size);
            return std::ptr::null_mut();
        };
        let tag = unsafe { (pointer.sub(8) as *const u32).read() };
        let slot = unsafe { (pointer.sub(4) as *const u32).read() };
        let base = unsafe { System.realloc(pointer.sub(offset), outer, new_outer_size) };
        if base.is_null() {
            report_failed_allocation(new_size);
            return base;
        }
        // The header moved with the block.
        if new_size >= layout.size() {
            Self::grew(new_size - layout.size(), tag, slot);
        } else {
            Self::shrank(layout.size() - new_size, tag, slot);
        }
        unsafe { base.add(offset) }
    }
}

impl CountingAllocator {
    unsafe fn allocate(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        tune_system_allocator();
        let Some((offset, outer)) = Self::outer(layout) else {
            report_failed_allocation(layout.size());
            return std::ptr::null_mut();
        };
        let base = unsafe {
            if zeroed {
                System.alloc_zeroed(outer)
            } else {
                System.alloc(outer)
            }
        };
        if base.is_null() {
            report_failed_allocation(layout.size());
            return base;
        }
        INSTALLED.store(true, Ordering::Relaxed);
        let tag = CURRENT_TAG.load(Ordering::Relaxed);
        let pointer = unsafe { base.add(offset) };
        let slot = thread_slot();
        unsafe { (pointer.sub(8) as *mut u32).write(tag) };
        unsafe { (pointer.sub(4) as *mut u32).write(slot) };
        Self::grew(layout.size(), tag, slot);
        pointer
    }
}

/// Whether a [`CountingAllocator`] is this program's global allocator.
pub fn is_counting() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Live heap bytes now.
pub fn current_bytes() -> usize {
    CURRENT.load(Ordering::Relaxed)
}

/// The most live heap bytes since the last [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// The most live bytes since the previous call (or since the start), and a new window from the
/// live bytes now.
pub fn take_window_peak() -> usize {
    let now = CURRENT.load(Ordering::Relaxed);
    WINDOW_PEAK.swap(now, Ordering::Relaxed).max(now)
}

/// Starts a new peak at the current live bytes, and returns them (the baseline).
pub fn reset_peak() -> usize {
    let now = CURRENT.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    for (at_peak, live) in TAG_AT_PEAK.iter().zip(&TAG_LIVE) {
        at_peak.store(live.load(Ordering::Relaxed), Ordering::Relaxed);
    }
    now
}

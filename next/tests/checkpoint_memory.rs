//! Checkpointing saves memory on Burn 0.22.1 (Flex): a stack of wide blocks, its step's peak
//! above the step's start (the model and input made) with every block checkpointed against the
//! plain run, measured by a counting allocator (the tests of this binary take turns through the
//! watchdog: nothing else allocates while one runs); and a hundred and fifty checkpointed steps leave
//! nothing behind.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::prelude::*;
use memsave_next::checkpoint::checkpoint;

#[path = "suite/common/mod.rs"]
mod common;
use common::watchdog;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let pointer = unsafe { System.alloc(layout) };
        if !pointer.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        unsafe { System.dealloc(pointer, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[derive(Module, Debug)]
struct Block {
    expand: Linear,
    reduce: Linear,
}

impl Block {
    /// `[batch, 64]` to `[batch, 64]`, through `[batch, 512]`.
    fn plain(&self, x: Tensor<2>) -> Tensor<2> {
        let h = burn::tensor::activation::relu(self.expand.forward(x.clone()));
        self.reduce.forward(h).tanh() + x
    }
}

/// Six blocks 64-512-64 and an input of `batch` rows.
fn model_and_input(device: &Device, batch: usize) -> (Vec<Block>, Tensor<2>) {
    let blocks: Vec<Block> = (0..6)
        .map(|_| Block {
            expand: LinearConfig::new(64, 512).init(device),
            reduce: LinearConfig::new(512, 64).init(device),
        })
        .collect();
    let values: Vec<f32> = (0..batch * 64)
        .map(|i| (i % 97) as f32 / 97.0 - 0.5)
        .collect();
    let x = Tensor::<2>::from_data(TensorData::new(values, [batch, 64]), device).require_grad();
    (blocks, x)
}

/// The step's peak above its start, in bytes, and the loss.
fn step_peak(blocks: &[Block], x: &Tensor<2>, checkpointed: bool) -> (usize, f32) {
    let start = LIVE.load(Ordering::Relaxed);
    PEAK.store(start, Ordering::Relaxed);
    let mut y = x.clone();
    for block in blocks {
        y = if checkpointed {
            checkpoint(block, y, |block: &Block, x| block.plain(x))
        } else {
            block.plain(y)
        };
    }
    let loss = y.powi_scalar(2).mean();
    let value = loss.clone().into_scalar::<f32>();
    let grads = loss.backward();
    drop(grads);
    (PEAK.load(Ordering::Relaxed) - start, value)
}

#[test]
fn every_block_checkpointed_keeps_less_than_half_the_plain_steps_peak() {
    watchdog(120, || {
        let device = Device::flex().autodiff();
        let (blocks, x) = model_and_input(&device, 512);
        // A first step of each, for the allocator's and Flex's first-use costs.
        let _ = step_peak(&blocks, &x, false);
        let _ = step_peak(&blocks, &x, true);
        let (plain, plain_loss) = step_peak(&blocks, &x, false);
        let (checkpointed, checkpointed_loss) = step_peak(&blocks, &x, true);
        let mib = |bytes: usize| bytes as f64 / (1024.0 * 1024.0);
        println!(
            "peak above the step's start: plain {:.2} MiB, checkpointed {:.2} MiB ({:.2}x)",
            mib(plain),
            mib(checkpointed),
            checkpointed as f64 / plain as f64
        );
        assert_eq!(plain_loss.to_bits(), checkpointed_loss.to_bits());
        assert!(
            (checkpointed as f64) < 0.5 * plain as f64,
            "plain {plain} B, checkpointed {checkpointed} B"
        );
    });
}

#[test]
fn many_checkpointed_steps_leave_nothing_behind() {
    watchdog(300, || {
        let device = Device::flex().autodiff();
        let (blocks, x) = model_and_input(&device, 64);
        for _ in 0..10 {
            let _ = step_peak(&blocks, &x, true);
        }
        let start = LIVE.load(Ordering::Relaxed);
        for _ in 0..150 {
            let _ = step_peak(&blocks, &x, true);
        }
        let grown = LIVE.load(Ordering::Relaxed) as isize - start as isize;
        println!("live bytes after 150 more checkpointed steps: {grown:+} B");
        // One step's activations are 6 x 64 x 512 floats (768 KiB): a tensor kept per step would
        // be tens of MiB. What may grow: the set of segment outputs' node ids (900 more ids,
        // bounded at 65,536).
        assert!(grown < 256 * 1024, "{grown} B more after 150 steps");
    });
}

/// This binary's allocator is its own, not memsave's: the CPU's memory cannot be read through
/// memsave, and profiling a step says what to install.
#[test]
fn without_memsaves_allocator_a_profile_is_an_error_saying_what_to_install() {
    let device = Device::flex().autodiff();
    assert!(memsave_next::memory::meter_for(&device).is_none());
    struct NoSegments;
    impl memsave_next::checkpoint::CheckpointModule for NoSegments {
        type Mark = ();
        fn set_with_cp(self, _on: bool) -> Self {
            self
        }
    }
    let error = match memsave_next::planner::Profiler::start(&NoSegments, &device) {
        Ok(_) => panic!("a profile without a meter"),
        Err(error) => error.to_string(),
    };
    assert!(
        error.contains("Flex") && error.contains("CountingAllocator"),
        "{error}"
    );
}

/// The same for `"dynamic"`: it reads the memory at every segment's entry.
#[test]
fn without_memsaves_allocator_dynamic_is_an_error_naming_the_device() {
    let device = Device::flex().autodiff();
    let error = match memsave_next::planner::Dynamic::new(
        memsave_next::planner::Budget::Fraction(0.7),
        &device,
    ) {
        Ok(_) => panic!("\"dynamic\" without a meter"),
        Err(error) => error.to_string(),
    };
    assert!(
        error.contains("Flex") && error.contains("CountingAllocator"),
        "{error}"
    );
}

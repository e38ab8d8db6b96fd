//! One run's context on Burn 0.22 (memsave-common's `RunContext`, the one memsave on Burn 0.21
//! uses): the segments of a `#[with_cp]` model record into the run they train in; the planner's
//! recorder measures each segment's forward and recomputation with the counting allocator; a
//! `"dynamic"` chooser decides at each segment's entry whether it keeps its activations, and any
//! mix of choices trains the plain run's gradients bit for bit.

use std::sync::{Arc, Mutex};

use burn::module::Module;
use burn::prelude::*;
use burn::tensor::Distribution;
use memsave_macros::{model, with_cp};
use memsave_next::checkpoint::dynamic::{set_chooser, Choice, Chooser};
use memsave_next::checkpoint::profile::{self, Boundary, Event};
use memsave_next::checkpoint::{reached, set_with_cp, SegmentId};
use memsave_next::memory::{self, phase};
use memsave_next::RunContext;

use crate::common;
use common::blocks::{Block, NARROW, WIDE};
use common::{assert_same_bits, device, grad_bits, initialized, watchdog};

const BATCH: usize = 128;

#[model]
#[derive(Module, Debug)]
struct Net {
    #[with_cp]
    blocks: Vec<Block>,
}

impl Net {
    fn new(device: &Device, blocks: usize) -> Self {
        Net {
            blocks: common::blocks::blocks(device, blocks),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.blocks.iter().fold(x, |x, block| block.forward(x))
    }

    fn ids(&self) -> Vec<SegmentId> {
        self.blocks.iter().map(SegmentId::of).collect()
    }

    /// One step from the stream `seed`, its forward and backward as the runner's phases: the
    /// gradients as bits and how many times a block's forward ran.
    fn step(&self, device: &Device, seed: u64) -> (Vec<Option<Vec<u32>>>, usize) {
        device.seed(seed);
        common::blocks::reset_runs();
        // Tracked, so that the first block is checkpointed too (MMCV's guard).
        let x = Tensor::<2>::random([BATCH, NARROW], Distribution::Default, device).require_grad();
        let loss = memory::in_phase(phase::FORWARD, || self.forward(x).powi_scalar(2).mean());
        let grads = memory::in_phase(phase::BACKWARD, || memsave_next::checkpoint::backward(loss));
        (grad_bits(self, &grads), common::blocks::runs())
    }
}

/// The events of one step of `net`, recorded with the counting allocator.
fn recorded(net: &Net, device: &Device) -> Vec<Event> {
    profile::start(memory::meter_for(device).expect("the counting allocator is installed"));
    profile::boundary(Boundary::Start);
    net.step(device, 7);
    profile::boundary(Boundary::End);
    profile::stop()
}

#[test]
fn a_flex_device_is_metered_by_the_counting_allocator_autodiff_or_not() {
    let _turn = common::one_at_a_time();
    for device in [Device::flex(), Device::flex().autodiff()] {
        let meter = memory::meter_for(&device).expect("the allocator is installed");
        let baseline = meter.reset_peak();
        let x = Tensor::<2>::ones([256, 256], &device);
        let live = meter.live();
        drop(x);
        assert!(meter.peak() >= baseline + 256 * 256 * 4, "{device:?}");
        assert!(live >= 256 * 256 * 4, "{device:?}");
        assert!(memory::device_peak_bytes(&device).is_some());
    }
}

#[test]
fn a_step_on_burn_0_22_is_recorded_segment_by_segment() {
    watchdog(120, || {
        let device = device();
        let plain = initialized(Net::new(&device, 3));
        plain.step(&device, 1);
        let ids = plain.ids();
        let checkpointed = set_with_cp(plain.clone(), true);
        assert_eq!(checkpointed.ids().len(), 3);

        // Checkpointed: each block's forward, then each recomputation, last block first.
        let events = recorded(&checkpointed, &device);
        let forwards: Vec<(SegmentId, u64, bool)> = events
            .iter()
            .filter_map(|event| match event {
                Event::Forward {
                    id,
                    before,
                    after,
                    checkpointed,
                    ..
                } => Some((*id, after.saturating_sub(*before), *checkpointed)),
                _ => None,
            })
            .collect();
        let kept: Vec<SegmentId> = forwards.iter().map(|(id, ..)| *id).collect();
        assert_eq!(kept, checkpointed.ids());
        assert!(forwards.iter().all(|(_, _, on)| *on), "{forwards:?}");
        let recomputed: Vec<(SegmentId, u64)> = events
            .iter()
            .filter_map(|event| match event {
                Event::Recompute {
                    id, before, after, ..
                } => Some((*id, after.saturating_sub(*before))),
                _ => None,
            })
            .collect();
        let mut backwards = checkpointed.ids();
        backwards.reverse();
        assert_eq!(
            recomputed.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            backwards
        );
        let boundaries: Vec<Boundary> = events
            .iter()
            .filter_map(|event| match event {
                Event::Boundary { at, .. } => Some(*at),
                _ => None,
            })
            .collect();
        assert_eq!(
            boundaries,
            [
                Boundary::Start,
                Boundary::ForwardEnd,
                Boundary::BackwardEnd,
                Boundary::End
            ]
        );
        // A recomputation makes the activations live that the forward did not keep: the block's
        // wide hidden layer (and its dropout's mask) at least.
        let hidden = (BATCH * WIDE * 4) as u64;
        for (id, bytes) in &recomputed {
            assert!(*bytes >= hidden, "{id:?} recomputed {bytes} bytes");
        }
        for (id, bytes, _) in &forwards {
            assert!(*bytes < hidden, "{id:?} kept {bytes} bytes");
        }

        // Plain: the forwards keep the activations, nothing is recomputed.
        let events = recorded(&plain, &device);
        let plain_forwards: Vec<(u64, bool)> = events
            .iter()
            .filter_map(|event| match event {
                Event::Forward {
                    before,
                    after,
                    checkpointed,
                    ..
                } => Some((after.saturating_sub(*before), *checkpointed)),
                _ => None,
            })
            .collect();
        assert_eq!(plain_forwards.len(), 3);
        assert!(
            plain_forwards
                .iter()
                .all(|(bytes, on)| !on && *bytes >= hidden),
            "{plain_forwards:?}"
        );
        assert!(!events
            .iter()
            .any(|event| matches!(event, Event::Recompute { .. })));
        assert_eq!(ids, plain.ids());
    });
}

/// Keeps the activations of the segments at even positions of each step, recomputes the
/// others; notes what it was asked.
#[derive(Default)]
struct EveryOther {
    asked: Vec<(SegmentId, Vec<usize>, u64)>,
}

impl Chooser for EveryOther {
    fn choose(&mut self, id: SegmentId, shape: &[usize], bytes: u64) -> Option<Choice> {
        self.asked.push((id, shape.to_vec(), bytes));
        Some(if self.asked.len() % 2 == 1 {
            Choice::Keep
        } else {
            Choice::Recompute
        })
    }
}

#[test]
fn a_chooser_decides_at_each_entry_and_any_mix_is_the_plain_runs_gradients() {
    watchdog(120, || {
        let device = device();
        let plain = initialized(Net::new(&device, 4));
        let (expected, plain_runs) = plain.step(&device, 11);
        assert_eq!(plain_runs, 4);

        let switched = set_with_cp(plain.clone(), true);
        let chooser = Arc::new(Mutex::new(EveryOther::default()));
        set_chooser(Some(chooser.clone()));
        let (mixed, runs) = switched.step(&device, 11);
        set_chooser(None);
        assert_same_bits(&expected, &mixed, "blocks 0 and 2 kept, 1 and 3 recomputed");
        // Two of the four recomputed: the chooser was heeded.
        assert_eq!(runs, 6);
        // Asked once per block, at its entry (never in a recomputation), with its input's shape
        // and bytes.
        let asked = std::mem::take(&mut chooser.lock().unwrap().asked);
        assert_eq!(
            asked.iter().map(|(id, ..)| *id).collect::<Vec<_>>(),
            switched.ids()
        );
        for (_, shape, bytes) in &asked {
            assert_eq!(shape, &[BATCH, NARROW]);
            assert_eq!(*bytes, (BATCH * NARROW * 4) as u64);
        }

        // Without a chooser every block switched on is recomputed; the same gradients again.
        let (all, runs) = switched.step(&device, 11);
        assert_same_bits(&expected, &all, "every block recomputed");
        assert_eq!(runs, 8);

        // A chooser is the run's: another run on this thread does not see it.
        set_chooser(Some(chooser.clone()));
        let (_, runs) = RunContext::named("other")
            .scope(|| switched.step(&device, 11))
            .unwrap();
        assert_eq!(runs, 8);
        assert!(chooser.lock().unwrap().asked.is_empty());
        let (_, runs) = switched.step(&device, 11);
        set_chooser(None);
        assert_eq!(runs, 6);
    });
}

#[test]
fn the_segments_that_ran_are_the_runs_they_ran_in() {
    watchdog(120, || {
        let device = device();
        let net = set_with_cp(initialized(Net::new(&device, 2)), true);
        let id = net.ids()[0];
        let trained = RunContext::named("trained");
        let idle = RunContext::named("idle");
        trained.scope(|| net.step(&device, 3)).unwrap();
        assert!(trained.scope(|| reached(id)).unwrap());
        assert!(!idle.scope(|| reached(id)).unwrap());
        let missing = idle
            .scope(|| memsave_next::check::switched_on_without_segment(&net))
            .unwrap();
        assert_eq!(missing, ["Block"]);
        assert!(trained
            .scope(|| memsave_next::check::switched_on_without_segment(&net))
            .unwrap()
            .is_empty());
        // Two runs cannot share a thread at once: the error names both.
        let error = trained
            .scope(|| idle.enter().map(drop).unwrap_err())
            .unwrap();
        let text = error.to_string();
        assert!(text.contains("trained") && text.contains("idle"), "{text}");
    });
}

#[test]
fn a_plan_made_on_burn_0_22_keeps_its_budget_and_the_plain_gradients() {
    watchdog(300, || {
        use memsave_next::checkpoint::set_with_cp_paths;
        use memsave_next::planner::{plan, Profiler};
        let device = device();
        let plain = initialized(Net::new(&device, 6));
        let (expected, _) = plain.step(&device, 5);

        // The profile: one step with every block checkpointed.
        let all = set_with_cp(plain.clone(), true);
        let profiler = Profiler::start(&all, &device).unwrap();
        all.step(&device, 5);
        let profile = profiler.finish(&all);
        let paths: Vec<&str> = profile.segments.iter().map(|s| s.path.as_str()).collect();
        assert_eq!(
            paths,
            ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4", "blocks.5"]
        );
        assert!(profile
            .segments
            .iter()
            .all(|s| s.kept_bytes >= (BATCH * WIDE * 4) as u64 && s.recompute_seconds > 0.0));
        assert!(profile.unplannable.is_empty(), "{:?}", profile.unplannable);

        // Half way from checkpointing everything to nothing.
        let (floor, unplanned) = (profile.floor(), profile.unplanned_peak());
        assert!(floor < unplanned, "floor {floor}, unplanned {unplanned}");
        let budget = floor + (unplanned - floor) / 2;
        let chosen = plan(&profile, budget).unwrap();
        assert!(chosen.peak <= budget, "{chosen:?}");
        assert!(
            !chosen.paths.is_empty() && chosen.paths.len() < 6,
            "{chosen:?}"
        );
        let error = plan(&profile, floor / 2).unwrap_err();
        assert!(error.to_string().contains("below the floor"), "{error}");

        // Applied: the measured peak within the budget, near the prediction, and the plain
        // run's gradients.
        let planned = set_with_cp_paths(plain.clone(), &chosen.paths).unwrap();
        let meter = memory::meter_for(&device).unwrap();
        for _ in 0..2 {
            meter.reset_peak();
            let (grads, runs) = planned.step(&device, 5);
            let measured = meter.peak();
            assert!(
                measured <= budget,
                "measured {measured} over the budget {budget} (predicted {})",
                chosen.peak
            );
            let error = (chosen.peak as f64 - measured as f64).abs() / measured as f64;
            println!(
                "floor {floor}, unplanned {unplanned}, budget {budget}: {} of 6 checkpointed, \
                 predicted {}, measured {measured} bytes",
                chosen.paths.len(),
                chosen.peak
            );
            assert!(error < 0.1, "predicted {} measured {measured}", chosen.peak);
            assert_same_bits(&expected, &grads, "the planned model");
            assert_eq!(runs, 6 + chosen.paths.len());
        }
        // Unplanned, the same step goes over the budget: the plan is what keeps it.
        meter.reset_peak();
        plain.step(&device, 5);
        println!("plain: measured {} bytes", meter.peak());
        assert!(
            meter.peak() > budget,
            "plain {} budget {budget}",
            meter.peak()
        );
    });
}

/// A block of blocks: its recomputation enters its inner blocks again.
#[model]
#[derive(Module, Debug)]
struct Outer {
    #[with_cp]
    inner: Vec<Block>,
    with_cp: bool,
}

impl Outer {
    #[with_cp]
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.inner.iter().fold(x, |x, block| block.forward(x))
    }
}

/// Notes what it was asked; keeps every segment but `recompute`'s type.
struct Noting {
    asked: Vec<SegmentId>,
    recompute: &'static str,
}

impl Chooser for Noting {
    fn choose(&mut self, id: SegmentId, _shape: &[usize], _bytes: u64) -> Option<Choice> {
        self.asked.push(id);
        Some(match id.type_name() == self.recompute {
            true => Choice::Recompute,
            false => Choice::Keep,
        })
    }
}

#[test]
fn a_chooser_is_not_asked_inside_a_recomputation() {
    watchdog(120, || {
        let device = device();
        let net = Net::new(&device, 2);
        let plain = initialized(Outer {
            inner: net.blocks,
            with_cp: false,
        });
        let run = |outer: &Outer| {
            device.seed(3);
            let x =
                Tensor::<2>::random([BATCH, NARROW], Distribution::Default, &device).require_grad();
            let grads = memsave_next::checkpoint::backward(outer.forward(x).powi_scalar(2).mean());
            grad_bits(outer, &grads)
        };
        let expected = run(&plain);
        let switched = set_with_cp(plain.clone(), true);
        let chooser = Arc::new(Mutex::new(Noting {
            asked: Vec::new(),
            recompute: "Outer",
        }));
        set_chooser(Some(chooser.clone()));
        let grads = run(&switched);
        set_chooser(None);
        assert_same_bits(&expected, &grads, "the outer block recomputed");
        // The outer block at its entry; its inner blocks ran untracked in its forward and, in its
        // recomputation, as their flags say, unasked.
        assert_eq!(chooser.lock().unwrap().asked, [SegmentId::of(&switched)]);
    });
}

/// `steps` of SGD on `start`, each on a batch of its size drawn from its own seed; under
/// `"dynamic"` at `budget` where given. The model, each step's measured peak (the counting
/// allocator), and the engine's figures.
fn train_at_sizes(
    start: &Net,
    device: &Device,
    sizes: &[usize],
    budget: Option<memsave_next::planner::Budget>,
) -> (
    Net,
    Vec<u64>,
    Option<memsave_next::planner::IntervalFigures>,
) {
    use burn::optim::{GradientsParams, SgdConfig};
    let mut optimizer = SgdConfig::new().init();
    let meter = memory::meter_for(device).unwrap();
    let mut dynamic =
        budget.map(|budget| memsave_next::planner::Dynamic::new(budget, device).unwrap());
    let mut model = start.clone();
    if let Some(dynamic) = dynamic.as_mut() {
        model = dynamic.start(model);
    }
    let mut peaks = Vec::new();
    for (step, &batch) in sizes.iter().enumerate() {
        device.seed(100 + step as u64);
        if let Some(dynamic) = dynamic.as_mut() {
            dynamic.begin_step(&model);
        }
        meter.reset_peak();
        let x = Tensor::<2>::random([batch, NARROW], Distribution::Default, device).require_grad();
        let loss = memory::in_phase(phase::FORWARD, || model.forward(x).powi_scalar(2).mean());
        let grads = memory::in_phase(phase::BACKWARD, || memsave_next::checkpoint::backward(loss));
        let grads = GradientsParams::from_grads(grads, &model);
        model = optimizer.step(0.01, model, grads);
        peaks.push(meter.peak());
        if let Some(dynamic) = dynamic.as_mut() {
            dynamic.end_step(&model, false).unwrap();
        }
    }
    let figures = dynamic.as_ref().map(|dynamic| dynamic.figures());
    (model, peaks, figures)
}

#[test]
fn dynamic_keeps_its_budget_at_every_batch_size_of_a_users_loop_and_trains_as_plain() {
    watchdog(300, || {
        let device = device();
        let start = initialized(Net::new(&device, 6));
        // Profiled at the largest; the others within and beyond the span of one profile.
        let sizes = [192, 128, 160, 96, 192, 128, 64, 160];
        let (plain, plain_peaks, _) = train_at_sizes(&start, &device, &sizes, None);
        let share = memsave_next::planner::Budget::Fraction(0.8);
        let (dynamic, peaks, figures) = train_at_sizes(&start, &device, &sizes, Some(share));
        let figures = figures.unwrap();
        println!("plain peaks {plain_peaks:?}\ndynamic peaks {peaks:?}\n{figures:?}");
        assert_eq!(
            figures.steps,
            sizes.len() - 1,
            "every step after the profile"
        );
        assert!(
            figures.highest_peak <= figures.budget,
            "a step peaked at {} over the budget {}",
            figures.highest_peak,
            figures.budget
        );
        // Measured apart from the engine too: every step, the profiled one included.
        for (step, peak) in peaks.iter().enumerate() {
            assert!(
                *peak <= figures.budget,
                "step {step}: {peak} over {}",
                figures.budget
            );
        }
        // The budget binds: plain goes over it at the largest batch.
        assert!(
            plain_peaks[4] > figures.budget,
            "{plain_peaks:?} {figures:?}"
        );
        // It chose: some segments kept, some recomputed, not alike at every size.
        assert!(figures.kept > 0 && figures.recomputed > 0, "{figures:?}");
        let shares: Vec<f64> = figures
            .by_size
            .values()
            .map(|(_, kept, recomputed)| *kept as f64 / (kept + recomputed) as f64)
            .collect();
        assert!(
            shares.iter().any(|share| *share != shares[0]),
            "the same choice at every size: {figures:?}"
        );
        // Exact: every weight bit-identical to the plain run's.
        assert_eq!(
            common::param_bits(&plain),
            common::param_bits(&dynamic),
            "weights after {} steps",
            sizes.len()
        );
    });
}

#[test]
fn a_budget_below_the_least_a_step_takes_is_an_error_after_the_profile() {
    watchdog(120, || {
        let device = device();
        let start = initialized(Net::new(&device, 3));
        let mut dynamic = memsave_next::planner::Dynamic::new(
            memsave_next::planner::Budget::Fraction(0.2),
            &device,
        )
        .unwrap();
        let model = dynamic.start(start);
        dynamic.begin_step(&model);
        let x = Tensor::<2>::random([BATCH, NARROW], Distribution::Default, &device).require_grad();
        let loss = memory::in_phase(phase::FORWARD, || model.forward(x).powi_scalar(2).mean());
        drop(memory::in_phase(phase::BACKWARD, || {
            memsave_next::checkpoint::backward(loss)
        }));
        let error = dynamic.end_step(&model, false).unwrap_err().to_string();
        assert!(
            error.contains("every one of the 3 segments checkpointed")
                && error.contains("memory budget `20% of the unplanned peak`"),
            "{error}"
        );
    });
}

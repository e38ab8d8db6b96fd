//! The ResNet on Burn 0.22: its shapes, and every block checkpointed giving the plain
//! network's gradients and running statistics bit for bit under both of Burn's checkpointing
//! strategies.

use burn::module::{Module, ModuleVisitor, Param};
use burn::prelude::*;
use burn::tensor::{Distribution, Gradients};
use memsave_models_next::resnet::{ResNet, ResNetConfig};
use memsave_next::checkpoint::set_with_cp;

/// One test at a time: Flex's random generator is one for the process, and the tests seed it.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn devices() -> [(&'static str, Device); 2] {
    [
        ("Burn's checkpointing off", Device::flex().autodiff()),
        (
            "Burn's Balanced checkpointing",
            Device::flex().autodiff().gradient_checkpointing(),
        ),
    ]
}

fn bits<const D: usize>(t: Tensor<D>) -> Vec<u32> {
    t.into_data().iter::<f32>().map(f32::to_bits).collect()
}

/// Every float's gradient (`None` without one) and every value (running statistics among
/// them, read from `valid()`, which merges their last update: a visit alone reads a running
/// state without it), as bits, in visiting order.
fn state(model: &ResNet, grads: &Gradients) -> (Vec<Option<Vec<u32>>>, Vec<Vec<u32>>) {
    struct Grads<'a>(&'a Gradients, Vec<Option<Vec<u32>>>);
    impl ModuleVisitor for Grads<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.1.push(param.val().grad(self.0).map(bits));
        }
    }
    struct Values(Vec<Vec<u32>>);
    impl ModuleVisitor for Values {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(bits(param.val()));
        }
    }
    let mut grads = Grads(grads, Vec::new());
    model.visit(&mut grads);
    let mut values = Values(Vec::new());
    model.valid().visit(&mut values);
    (grads.1, values.0)
}

/// A small network of `depth` (8 base channels, the last stage's features), as built on
/// `device` from seed 1.
fn small(depth: usize, device: &Device) -> ResNet {
    device.seed(1);
    ResNetConfig::new(depth)
        .with_base_channels(8)
        .init(device)
        .unwrap()
}

fn step(model: &ResNet, device: &Device) -> (Vec<Option<Vec<u32>>>, Vec<Vec<u32>>) {
    device.seed(2);
    let images = Tensor::<4>::random([2, 3, 32, 32], Distribution::Default, device).require_grad();
    let features = model.forward(images);
    let loss = features
        .into_iter()
        .map(|f| f.powi_scalar(2).mean())
        .reduce(|a, b| a + b)
        .unwrap();
    let grads = loss.backward();
    state(model, &grads)
}

#[test]
fn shapes_follow_the_stages() {
    let _one = one_at_a_time();
    let device = Device::flex().autodiff();
    for (depth, blocks, expansion) in [(18, [2, 2, 2, 2], 1), (50, [3, 4, 6, 3], 4)] {
        let images = Tensor::<4>::zeros([1, 3, 64, 64], &device);
        let model = ResNetConfig::new(depth)
            .with_base_channels(8)
            .with_out_indices(vec![1, 3])
            .init(&device)
            .unwrap();
        assert_eq!(model.blocks(), blocks);
        let dims: Vec<[usize; 4]> = model.forward(images).iter().map(Tensor::dims).collect();
        assert_eq!(
            dims,
            [[1, 16 * expansion, 8, 8], [1, 64 * expansion, 2, 2]],
            "ResNet-{depth}"
        );
    }
    let error = ResNetConfig::new(20)
        .init(&device)
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("`depth`") && error.contains("20"), "{error}");
}

#[test]
fn every_block_checkpointed_trains_as_plain_bit_for_bit() {
    let _one = one_at_a_time();
    for depth in [18, 50] {
        for (name, device) in devices() {
            // A model each: running statistics are shared by a module's clones.
            let (plain_grads, plain_values) = step(&small(depth, &device), &device);
            let checkpointed = set_with_cp(small(depth, &device), true);
            let (grads, values) = step(&checkpointed, &device);
            assert!(plain_grads.iter().filter(|g| g.is_some()).count() > 10);
            let first = plain_grads.iter().zip(&grads).position(|(a, b)| a != b);
            assert_eq!(
                first, None,
                "ResNet-{depth}, {name}: the first parameter whose gradient differs"
            );
            let first = plain_values.iter().zip(&values).position(|(a, b)| a != b);
            assert_eq!(
                first, None,
                "ResNet-{depth}, {name}: the first value that differs"
            );
        }
    }
}

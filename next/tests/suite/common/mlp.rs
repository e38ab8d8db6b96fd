//! A two-layer perceptron with the fp16 flag, and its data: the model of the optimizer and
//! mixed-precision tests.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::prelude::*;
use memsave_macros::{auto_fp16, model};
use memsave_next::fp16::Fp16;

#[model]
#[derive(Module, Debug)]
pub struct Mlp {
    pub fc1: Linear,
    pub relu: Relu,
    pub fc2: Linear,
    pub fp16_enabled: Fp16,
}

impl Mlp {
    /// `input` -> `hidden` -> `output` features.
    pub fn new(device: &Device, [input, hidden, output]: [usize; 3]) -> Self {
        Mlp {
            fc1: LinearConfig::new(input, hidden).init(device),
            relu: Relu::new(),
            fc2: LinearConfig::new(hidden, output).init(device),
            fp16_enabled: Fp16::Off,
        }
    }

    #[auto_fp16(out_fp32 = true)]
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(self.relu.forward(self.fc1.forward(x)))
    }

    /// The mean squared error of the forward on `x` against `y`, in fp32.
    pub fn loss(&self, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
        (self.forward(x) - y).powi_scalar(2).mean()
    }
}

/// The model of the runner's tests: a batch is an input and its target.
impl memsave_next::train::TrainModel for Mlp {
    type Batch = (Tensor<2>, Tensor<2>);

    fn loss(&self, (x, y): Self::Batch) -> Tensor<1> {
        Mlp::loss(self, x, y)
    }
}

/// `rows` inputs (`input` features) and targets (`output`) of a fixed pattern (the `salt`s shift
/// it), in `[-scale, scale] / 2`. Drawn from no random stream.
pub fn batch(
    device: &Device,
    rows: usize,
    [input, output]: [usize; 2],
    [x_salt, y_salt]: [usize; 2],
    scale: f32,
) -> (Tensor<2>, Tensor<2>) {
    let values = |n: usize, salt: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i + salt) * 37 % 29) as f32 / 29.0 - 0.5) * scale)
            .collect()
    };
    let x = Tensor::from_data(
        TensorData::new(values(rows * input, x_salt), [rows, input]),
        device,
    );
    let y = Tensor::from_data(
        TensorData::new(values(rows * output, y_salt), [rows, output]),
        device,
    );
    (x, y)
}

/// The loss of step `step`: 32 rows of the pattern, the inputs shifted by `step % 3`.
pub fn loss_at(model: &Mlp, step: usize) -> Tensor<1> {
    let [input, _] = model.fc1.weight.val().dims();
    let [_, output] = model.fc2.weight.val().dims();
    let device = model.fc1.weight.val().device();
    let (x, y) = batch(&device, 32, [input, output], [step % 3, 11], 2.0);
    model.loss(x, y)
}

/// `steps` of `optimizer` at `lr` on [`loss_at`]: the model, and the last step's loss.
pub fn train(
    mut model: Mlp,
    optimizer: &mut ModuleOptimizer,
    lr: f64,
    steps: std::ops::Range<usize>,
) -> (Mlp, f32) {
    let mut last = 0.0;
    for step in steps {
        let loss = loss_at(&model, step);
        last = loss.clone().into_scalar::<f32>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(lr, model, grads);
    }
    (model, last)
}

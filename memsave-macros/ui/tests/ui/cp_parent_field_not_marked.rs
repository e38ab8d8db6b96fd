use burn::nn::Linear;
use burn::prelude::*;
use memsave::checkpoint::set_with_cp;
use memsave::with_cp;

#[memsave::model]
#[derive(Module, Debug)]
struct Block<B: Backend> {
    linear: Linear<B>,
    with_cp: bool,
}

impl<B: memsave::Backend> Block<B> {
    #[with_cp]
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.linear.forward(x)
    }
}

// The blocks' field is not marked `#[with_cp]`: nothing can switch them on.
#[memsave::model]
#[derive(Module, Debug)]
struct Net<B: Backend> {
    stem: Linear<B>,
    blocks: Vec<Block<B>>,
    head: Linear<B>,
}

fn checkpointed<B: memsave::Backend>(net: Net<B>) -> Net<B> {
    set_with_cp(net, true)
}

fn main() {}

"""PyTorch's figures for the step of `cargo run --release --example checkpoint_memory`.

ResNet-50 (torchvision), batch 4, 3x224x224, cross-entropy over 1000 classes, SGD with
momentum; plain, and with torch.utils.checkpoint (non-reentrant) on every Bottleneck. Memory is
measured as memsave measures it: the peak of live allocator bytes above the step's start, with
the model and the optimizer state resident (the profiler's memory events, summed in order).

Runs where torch is installed (never in CI; not a dependency of memsave):

    python3 -m venv v && v/bin/pip install torch torchvision
    v/bin/python scripts/torch_resnet.py [--depth 50] [--batch 4] [--size 224] [--steps 3]

Prints a Markdown table and, last, `checkpoint: memory_ratio=<x> time_ratio=<y>`.
"""

import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.utils.checkpoint as cp
import torchvision


def checkpoint_blocks(model, on):
    """Wraps every Bottleneck/BasicBlock's forward in a non-reentrant checkpoint."""
    for layer in [model.layer1, model.layer2, model.layer3, model.layer4]:
        for block in layer:
            if not hasattr(block, "_plain_forward"):
                block._plain_forward = block.forward
            if on:
                plain = block._plain_forward
                block.forward = lambda x, plain=plain: cp.checkpoint(plain, x, use_reentrant=False)
            else:
                block.forward = block._plain_forward


def peak_above_start(step):
    """Runs `step` under the profiler and returns the peak of live bytes above its start: the
    allocator's every allocation and free during the step (the profiler's memory timeline), in
    order, transient buffers included."""
    from torch.profiler._memory_profiler import Action, MemoryProfileTimeline

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=True,
        with_stack=True,
    ) as prof:
        step()
    timeline = MemoryProfileTimeline(prof._memory_profile()).timeline
    live, peak = 0, 0
    for _, action, (key, _version), size in sorted(timeline, key=lambda event: event[0]):
        if key.device.type != "cpu":
            continue
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = getattr(torchvision.models, f"resnet{args.depth}")(num_classes=1000)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(args.batch, 3, args.size, args.size)
    labels = torch.tensor([i * 37 % 1000 for i in range(args.batch)])
    criterion = nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()

    # Warm-up: the momentum buffers exist, gradients are dropped before each measured step.
    for on in [False, True]:
        checkpoint_blocks(model, on)
        step()
    optimizer.zero_grad(set_to_none=True)

    results = {False: ([], []), True: ([], [])}
    for round_ in range(args.steps):
        for on in ([False, True] if round_ % 2 == 0 else [True, False]):
            checkpoint_blocks(model, on)
            optimizer.zero_grad(set_to_none=True)
            peak = peak_above_start(step)
            optimizer.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step()
            seconds = time.perf_counter() - start
            results[on][0].append(peak)
            results[on][1].append(seconds)
            print(f"  step {round_ + 1} {'checkpointed' if on else 'plain':>12}: "
                  f"peak {peak / 2**20:8.1f} MiB above start, {seconds:6.2f} s", flush=True)

    plain_peak, plain_time = (statistics.median(v) for v in results[False])
    cp_peak, cp_time = (statistics.median(v) for v in results[True])
    print(f"| ResNet-{args.depth}, batch {args.batch}, 3x{args.size}x{args.size}, PyTorch "
          f"{torch.__version__}, {torch.get_num_threads()} threads | peak above the step's start "
          f"(median) | step time (median) |")
    print("|---|---|---|")
    print(f"| plain | {plain_peak / 2**20:.1f} MiB | {plain_time:.2f} s |")
    print(f"| every block checkpointed | {cp_peak / 2**20:.1f} MiB | {cp_time:.2f} s |")
    print(f"checkpoint: memory_ratio={cp_peak / plain_peak:.2f} "
          f"time_ratio={cp_time / plain_time:.2f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The PyTorch side of `memsave bench`: torchvision's RetinaNet R50-FPN trained for a few steps
under the same configurations (base, amp, accumulation, checkpoint, all, step_in_backward,
int8_state, lean), each in a
process of its own, measured the same way, printing the same table and writing the same
`bench.json` schema, so that `memsave bench --compare torch.json` shows both side by side.

    python3 scripts/torch_reference.py --out torch.json            # 320x320, batch 2, CPU
    python3 scripts/torch_reference.py --image-size 1000x600 --device cuda --out torch.json

The model is MMDetection's retinanet_r50_fpn as memsave builds it: ResNet-50 with the stem and
first stage frozen (frozen_stages=1) and BatchNorm in eval mode with trainable weight and bias
elsewhere (norm_eval; not torchvision's FrozenBatchNorm2d, whose affine parameters do not train
and whose backward keeps nothing), FPN P3-P7 with
the extra levels on C5 ("on_input"), RetinaHead with 4 convs of 256 channels, focal and L1
losses, images kept at the given size (GeneralizedRCNNTransform's min and max size set to
it). SGD with momentum 0.9, weight decay 1e-4, gradient clipping at 35. Random weights: no
download. The configurations: `amp` is autocast (bf16 on the CPU, fp16 with a static loss
scale of 512 on CUDA, as MMCV's `fp16 = dict(loss_scale=512.)`); `accumulation` two
micro-batches of half the batch, the loss halved; `checkpoint` torch.utils.checkpoint
(non-reentrant) on every Bottleneck whose input requires grad (MMCV's `with_cp` guard);
`all` the three together; `step_in_backward` PyTorch's optimizer hooks in backward (its
tutorial's `register_post_accumulate_grad_hook`, one SGD per parameter, the gradient freed at
once), which cannot clip (its tutorial and torchtune refuse global-norm clipping there: this
configuration runs unclipped, and `all` keeps the ordinary step, since the hooks refuse
accumulation and loss scaling too); `lean` checkpointing with the hooks in backward;
`int8_state` needs bitsandbytes or torchao, not installed here: it is left absent (memsave's
`lean` adds 8-bit state, PyTorch's does not). CPU staging (`--device cuda` only, in
OFFLOAD_CONFIGS): `offload_activations` is `checkpoint` with the forward under
`torch.autograd.graph.save_on_cpu(pin_memory=True)` (what the checkpointed blocks keep goes to
pinned host memory); `offload_optimizer` keeps the optimizer's state and fp32 masters on the host, hand-written
(`HostSGD`: each gradient copied to pinned host memory after backward, unscaled and clipped there,
SGD stepped on the masters, the new weights copied up; torchao's `CPUOffloadOptimizer` would not
take the loss scale); `all_offload` is `all` with both, its loss scale static (512) as `amp`'s.

Memory: the peak of live bytes during one step above the step's start, from the profiler's
allocator events (`profile_memory=True`: the running sum of every allocation and free in its
event tree); on CUDA,
`torch.cuda.max_memory_allocated` above the step's start. The whole-step peak
(`whole_step_peak_bytes`: weights, optimizer state, gradients, activations) is
`torch.cuda.max_memory_allocated` itself on CUDA, and the profiler's memory timeline's total at
its peak on the CPU. Where the memory goes at that peak
comes from the profiler's memory timeline (its categories: parameters, optimizer state,
activations, gradients and autograd detail, the rest), and so does the timeline. Time: the
median of the measured steps, run without the profiler; the memory comes from one more step
run under it. Not run in CI: torch is not a dependency of memsave.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = [
    "base", "amp", "accumulation", "checkpoint", "all", "step_in_backward", "int8_state", "lean",
]
# CPU staging, on CUDA (memsave runs the same three by default on a device).
OFFLOAD_CONFIGS = ["offload_activations", "offload_optimizer", "all_offload"]
# Configurations that need a library not installed here (bitsandbytes, torchao).
ABSENT = {"int8_state": "8-bit optimizer state needs bitsandbytes or torchao, not installed"}


def parse_size(text):
    if "x" in text:
        w, h = text.split("x")
        return int(h), int(w)
    return int(text), int(text)


def build_model(height, width, num_classes, checkpoint):
    import torch
    import torch.utils.checkpoint
    from torchvision.models import resnet50
    from torchvision.models.detection import RetinaNet
    from torchvision.models.detection.backbone_utils import _resnet_fpn_extractor
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7
    from torchvision.models.resnet import Bottleneck

    # MMDetection's ResNet: BatchNorm whose statistics are frozen (`norm_eval`, see `train`
    # below) and whose weight and bias still train outside the frozen stages.
    backbone = resnet50(weights=None)
    if checkpoint:
        original = Bottleneck.forward

        def forward(self, x):
            if x.requires_grad:
                return torch.utils.checkpoint.checkpoint(original, self, x, use_reentrant=False)
            return original(self, x)

        Bottleneck.forward = forward
    # Trainable: layer2..layer4 (MMDetection's frozen_stages=1); P6 from C5 (2048 channels).
    backbone = _resnet_fpn_extractor(
        backbone, 3, returned_layers=[2, 3, 4], extra_blocks=LastLevelP6P7(2048, 256)
    )
    return RetinaNet(
        backbone,
        num_classes=num_classes,
        min_size=min(height, width),
        max_size=max(height, width),
    )


class HostSGD:
    """SGD with momentum and weight decay whose state and fp32 masters live in pinned host
    memory: each gradient is copied down, stepped on the host, and the new weights copied up
    (ZeRO-Offload's shape, without DeepSpeed)."""

    def __init__(self, params, lr, momentum, weight_decay):
        import torch

        self.params = params
        self.masters = [p.detach().to("cpu", torch.float32).pin_memory() for p in params]
        for m in self.masters:
            m.requires_grad_(True)
        self.host = torch.optim.SGD(
            self.masters, lr=lr, momentum=momentum, weight_decay=weight_decay
        )

    # MMCV's static `loss_scale=512.` under `amp`.
    LOSS_SCALE = 512.0

    def step(self, scale, max_norm):
        import torch

        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad = None
                continue
            m.grad = p.grad.to("cpu", torch.float32, non_blocking=True)
            p.grad = None
        torch.cuda.synchronize()
        stepped = [m for m in self.masters if m.grad is not None]
        for m in stepped:
            m.grad.div_(scale)
        torch.nn.utils.clip_grad_norm_(stepped, max_norm)
        self.host.step()
        for p, m in zip(self.params, self.masters):
            p.data.copy_(m.detach(), non_blocking=True)
            m.grad = None


def make_batches(count, batch, height, width, num_classes, device, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(count):
        images, targets = [], []
        for _ in range(batch):
            images.append(torch.rand(3, height, width, generator=g).to(device))
            n = int(torch.randint(1, 4, (1,), generator=g))
            xy = torch.rand(n, 2, generator=g) * torch.tensor([width * 0.6, height * 0.6])
            wh = 16 + torch.rand(n, 2, generator=g) * torch.tensor([width * 0.3, height * 0.3])
            boxes = torch.cat([xy, xy + wh], dim=1)
            labels = torch.randint(0, num_classes, (n,), generator=g)
            targets.append({"boxes": boxes.to(device), "labels": labels.to(device)})
        steps.append((images, targets))
    return steps


def worker(args):
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = args.worker
    amp = name in ("amp", "all", "all_offload")
    micro = 2 if name in ("accumulation", "all", "all_offload") else 1
    height, width = args.image_size
    in_backward = name in ("step_in_backward", "lean")
    offload_activations = name in ("offload_activations", "all_offload")
    offload_optimizer = name in ("offload_optimizer", "all_offload")
    if (offload_activations or offload_optimizer) and device.type != "cuda":
        raise SystemExit(f"{name}: CPU staging needs --device cuda")
    checkpointed = ("checkpoint", "all", "lean", "offload_activations", "all_offload")
    model = build_model(height, width, 20, name in checkpointed).to(device)
    model.train()
    for module in model.backbone.body.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.eval()  # norm_eval
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1e-5, momentum=0.9, weight_decay=1e-4)
    if in_backward:
        # PyTorch's tutorial: one optimizer per parameter, stepped by a hook as soon as the
        # parameter's gradient is accumulated, the gradient freed at once.
        per_param = {p: torch.optim.SGD([p], lr=1e-5, momentum=0.9, weight_decay=1e-4)
                     for p in params}

        def hook(p):
            per_param[p].step()
            per_param[p].zero_grad(set_to_none=True)

        for p in params:
            p.register_post_accumulate_grad_hook(hook)
    host_optimizer = None
    if offload_optimizer:
        host_optimizer = HostSGD(params, lr=1e-5, momentum=0.9, weight_decay=1e-4)
    scaler = None
    if amp and device.type == "cuda" and host_optimizer is None:
        scaler = torch.amp.GradScaler("cuda", init_scale=512.0, growth_interval=10**9)
    dtype = torch.bfloat16 if device.type == "cpu" else torch.float16
    batches = make_batches(2, args.batch, height, width, 20, device)

    def step(index):
        images, targets = batches[index % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        per = len(images) // micro
        total = 0.0
        for m in range(micro):
            part_images = images[m * per:(m + 1) * per]
            part_targets = targets[m * per:(m + 1) * per]
            staging = (
                torch.autograd.graph.save_on_cpu(pin_memory=True)
                if offload_activations
                else contextlib.nullcontext()
            )
            with staging, torch.autocast(device.type, dtype=dtype, enabled=amp):
                losses = model(part_images, part_targets)
                loss = sum(losses.values()) / micro
            if scaler is not None:
                scaler.scale(loss).backward()
            elif host_optimizer is not None and amp:
                (loss * HostSGD.LOSS_SCALE).backward()
            else:
                loss.backward()
            total += float(loss.detach()) * micro
            del losses, loss
        if in_backward:
            return total / micro  # stepped in backward, unclipped
        if host_optimizer is not None:
            host_optimizer.step(HostSGD.LOSS_SCALE if amp else 1.0, 35.0)
            return total / micro
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 35.0)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total / micro

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for i in range(args.warmup):
        step(i)
        print(f"step {i + 1} {args.warmup + args.iters + 1}", flush=True)
    times, losses = [], []
    for i in range(args.iters):
        sync()
        start = time.perf_counter()
        losses.append(step(args.warmup + i))
        sync()
        times.append(time.perf_counter() - start)
        print(f"step {args.warmup + i + 1} {args.warmup + args.iters + 1}", flush=True)

    # One more step for memory, under the profiler.
    breakdown, timeline, phases, whole = {}, [], [], 0
    if device.type == "cuda":
        sync()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        losses.append(step(args.warmup + args.iters))
        sync()
        whole = torch.cuda.max_memory_allocated()
        peak = whole - start
        breakdown["baseline"] = start
    else:
        from torch.profiler import ProfilerActivity, profile
        from torch._C._profiler import _EventType
        from torch.profiler._memory_profiler import MemoryProfileTimeline

        with profile(
            activities=[ProfilerActivity.CPU],
            profile_memory=True,
            record_shapes=True,
            with_stack=True,
        ) as prof:
            losses.append(step(args.warmup + args.iters))
        # Every allocation and free the profiler saw, in time order (the allocator's events).
        allocations = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                allocations.append((node.start_time_ns, node.extra_fields.alloc_size))
        live, peak = 0, 0
        for _, size in sorted(allocations):
            live += size
            peak = max(peak, live)
        try:
            mem = MemoryProfileTimeline(prof._memory_profile())
            times_us, sizes = mem._coalesce_timeline("cpu")
            totals = [sum(s) for s in sizes]
            at = max(range(len(totals)), key=totals.__getitem__)
            s = sizes[at]
            # Index 0 unused; then PARAMETER, OPTIMIZER_STATE, INPUT, TEMPORARY, ACTIVATION,
            # GRADIENT, AUTOGRAD_DETAIL, unknown.
            breakdown = {
                "parameters": s[1],
                "optimizer_state": s[2],
                "activations": s[5],
                "gradients": s[6] + s[7],
                "other": s[3] + s[4] + s[8],
                "total": totals[at],
                "baseline": totals[0],
            }
            whole = totals[at]
            # At most 1500 points, each the highest of its run (a peak is never smoothed away).
            t0 = times_us[0]
            run = max(1, -(-len(times_us) // 1500))
            for i in range(0, len(times_us), run):
                j = max(range(i, min(i + run, len(totals))), key=totals.__getitem__)
                timeline.append([(times_us[j] - t0) / 1e6, max(0, totals[j] - totals[0])])
        except Exception as error:  # the memory timeline is private API: keep the peak
            print(f"memory timeline unavailable: {error}", file=sys.stderr)
    print(f"step {args.warmup + args.iters + 1} {args.warmup + args.iters + 1}", flush=True)
    result = {
        "name": name,
        "peak_bytes": int(peak),
        "whole_step_peak_bytes": int(whole),
        "median_iter_s": statistics.median(times),
        "final_loss": losses[-2] if len(losses) > 1 else losses[-1],
        "breakdown": {k: int(v) for k, v in breakdown.items()},
        "iter_s": times,
        "timeline": timeline,
        "timeline_phase": phases,
    }
    with open(args.result, "w") as f:
        json.dump(result, f)


def mib(b):
    return b / (1024 * 1024)


def table(report):
    base = next((c for c in report["configs"] if c["name"] == "base"), None)
    lines = [
        f"{report['framework']}: {report['model']}, {report['batch']} images of "
        f"{report['image_size'][1]}x{report['image_size'][0]} per step, {report['iters']} "
        f"measured steps, SGD on {report['device']}",
        "",
        "| config | peak MiB | memory vs base | whole-step peak MiB | s/step | time vs base "
        "| final loss | parameters | optimizer state | activations | gradients "
        "| other (MiB at the peak) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["configs"]:
        mem = f"{c['peak_bytes'] / base['peak_bytes']:.2f}x" if base and base["peak_bytes"] else "-"
        tim = f"{c['median_iter_s'] / base['median_iter_s']:.2f}x" if base else "-"
        part = lambda k: f"{mib(c['breakdown'][k]):.1f}" if k in c["breakdown"] else "-"
        whole = f"{mib(c['whole_step_peak_bytes']):.1f}" if c.get("whole_step_peak_bytes") else "-"
        lines.append(
            f"| {c['name']} | {mib(c['peak_bytes']):.1f} | {mem} | {whole} | "
            f"{c['median_iter_s']:.2f} | "
            f"{tim} | {c['final_loss']:.4f} | {part('parameters')} | {part('optimizer_state')} "
            f"| {part('activations')} | {part('gradients')} | {part('other')} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image-size", type=parse_size, default=(320, 320))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--only", default=",".join(CONFIGS))
    parser.add_argument("--out", default="torch.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    import torch
    import torchvision

    configs = []
    with tempfile.TemporaryDirectory() as temp:
        for name in args.only.split(","):
            if name in ABSENT:
                print(f"{name}: absent ({ABSENT[name]})", file=sys.stderr, flush=True)
                continue
            result = os.path.join(temp, f"{name}.json")
            h, w = args.image_size
            command = [
                sys.executable, __file__, "--worker", name, "--result", result,
                "--image-size", f"{w}x{h}", "--batch", str(args.batch),
                "--iters", str(args.iters), "--warmup", str(args.warmup),
                "--device", args.device, "--threads", str(args.threads),
            ]
            print(f"{name}: running", file=sys.stderr, flush=True)
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            with open(result) as f:
                c = json.load(f)
            print(
                f"{name}: peak {mib(c['peak_bytes']):.1f} MiB, {c['median_iter_s']:.2f} s/step",
                file=sys.stderr,
                flush=True,
            )
            configs.append(c)
    device = (
        f"CPU, {args.threads} threads"
        if args.device == "cpu"
        else f"{torch.cuda.get_device_name(0)} (CUDA)"
    )
    report = {
        "device": device,
        "model": "RetinaNet R50-FPN (torchvision)",
        "image_size": list(args.image_size),
        "batch": args.batch,
        "iters": args.iters,
        "framework": f"PyTorch {torch.__version__.split('+')[0]}",
        "optimizer": "SGD",
        "configs": configs,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(table(report))


if __name__ == "__main__":
    main()

"""Makes the torchvision-layout ResNet fixtures that models/tests/suite/weights.rs loads.

Two narrow ResNets built from torchvision's own blocks and `_make_layer` (so their state-dict
keys and their arithmetic are torchvision's), random weights and random BN statistics, and
torchvision's feature maps (C2..C5, eval mode) for a fixed input:

  resnet18_w16.pth                 BasicBlock [2, 2, 2, 2], base width 16 (torch.save state dict)
  resnet50_w8.safetensors          Bottleneck [3, 4, 6, 3], base width 8
  <name>_features.safetensors      "input" [2, 3, 64, 96] and "c2".."c5"

Run where PyTorch is installed (never in CI):  v/bin/python scripts/make_resnet_fixtures.py
"""

import pathlib

import torch
from safetensors.torch import save_file
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

OUT = pathlib.Path(__file__).resolve().parent.parent / "models" / "tests" / "fixtures"


class NarrowResNet(ResNet):
    """torchvision's ResNet with a stem and first stage `base` wide instead of 64."""

    def __init__(self, block, layers, base):
        nn.Module.__init__(self)
        self._norm_layer = nn.BatchNorm2d
        self.inplanes = base
        self.dilation = 1
        self.groups = 1
        self.base_width = 64
        self.conv1 = nn.Conv2d(3, base, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(base)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, base, layers[0])
        self.layer2 = self._make_layer(block, base * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, base * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, base * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(base * 8 * block.expansion, 10)

    def stages(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        out = []
        for layer in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = layer(x)
            out.append(x)
        return out


def randomise_norms(model, generator):
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            c = module.num_features
            module.weight.data = 0.5 + torch.rand(c, generator=generator)
            module.bias.data = 0.2 * torch.randn(c, generator=generator)
            module.running_mean.data = 0.2 * torch.randn(c, generator=generator)
            module.running_var.data = 0.5 + torch.rand(c, generator=generator)


def make(name, block, layers, base, save):
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = NarrowResNet(block, layers, base)
    randomise_norms(model, generator)
    model.eval()
    index = torch.arange(2 * 3 * 64 * 96, dtype=torch.float32).reshape(2, 3, 64, 96)
    x = torch.sin(index * 0.01) + 0.1 * torch.cos(index * 0.37)
    with torch.no_grad():
        c2, c3, c4, c5 = model.stages(x)
    save(model.state_dict())
    save_file(
        {"input": x, "c2": c2, "c3": c3, "c4": c4, "c5": c5},
        str(OUT / f"{name}_features.safetensors"),
    )
    params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {params} parameters")


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    make(
        "resnet18_w16",
        BasicBlock,
        [2, 2, 2, 2],
        16,
        lambda sd: torch.save(sd, OUT / "resnet18_w16.pth"),
    )
    make(
        "resnet50_w8",
        Bottleneck,
        [3, 4, 6, 3],
        8,
        lambda sd: save_file({k: v.contiguous() for k, v in sd.items()}, str(OUT / "resnet50_w8.safetensors")),
    )


if __name__ == "__main__":
    main()

"""Parameter shapes of well-known models, for tests that need realistic gradient sets without the
models (a module of its own: a test module imported by another would register its shared-launch
bodies twice)."""

from __future__ import annotations


def resnet18_shapes():
    """The 62 parameter shapes of torchvision's ResNet-18 (11,689,512 parameters)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inp = 64
    for width in (64, 128, 256, 512):
        for b in range(2):
            shapes += [(width, inp, 3, 3), (width,), (width,), (width, width, 3, 3), (width,), (width,)]
            if b == 0 and inp != width:
                shapes += [(width, inp, 1, 1), (width,), (width,)]
            inp = width
    return shapes + [(1000, 512), (1000,)]

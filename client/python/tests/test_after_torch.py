#!/usr/bin/python3
"""The `mainstay` module loads into a process that has already imported torch (which brings its
own protobuf and other libraries), and works there. Exit 77 (skipped) when torch is missing."""
import sys

try:
    import torch
except ImportError:
    print("torch is not installed (Debian: python3-torch): skipped")
    sys.exit(77)

import mainstay  # noqa: E402  (after torch on purpose)

spec = '{"name": "t", "recipe": "bf16_with_nvfp4_mixed", "data_parallel_size": 2, ' \
       '"tensors": [{"name": "layers.0.mlp.fc1.weight", "shape": [64, 32]}]}'
layout = mainstay.compute_layout(spec, 0)
assert len(layout.buckets) == 1, layout.buckets
weight = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) / 100
flat = layout.flatten(0, {"layers.0.mlp.fc1.weight": weight.numpy()})
back = layout.unflatten(0, flat)["layers.0.mlp.fc1.weight"]
assert torch.equal(torch.from_numpy(back), weight)
print("ok: torch %s, then mainstay; layout and buffers work" % torch.__version__)

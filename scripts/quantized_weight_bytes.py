# SPDX-License-Identifier: Apache-2.0
"""Bytes per parameter of the weights a quantized checkpoint keeps in memory.

    python -m scripts.quantized_weight_bytes --model-path CKPT [--quantization auto]

Loads the target model as the engine would (`--quantization`, fp32 compute dtype) and
sums, over every layer holding checkpoint codes, the bytes of its codes and scales,
divided by the parameters they encode (two per MXFP4 byte), per format; then the bytes of
all the model's parameters and buffers against `--quantization none`.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def quantized_bytes(model) -> dict[str, dict[str, float]]:
    """Per format: parameters encoded, bytes held (codes + scales), bytes per parameter."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for _, module in model.named_modules():
        for name, (fmt, _) in getattr(module, "quantized_weights", {}).items():
            codes = getattr(module, name)
            scales = getattr(module, f"{name}_scale_inv" if fmt == "fp8" else f"{name}_scale")
            kind = f"{fmt} {'experts' if codes.dim() == 3 else 'linear'}"
            totals[kind][0] += codes.numel() * (2 if fmt == "mxfp4" else 1)
            totals[kind][1] += codes.nbytes + scales.nbytes
    return {
        k: {"params": p, "bytes": b, "bytes_per_param": round(b / p, 4)}
        for k, (p, b) in totals.items()
    }


def model_bytes(model) -> int:
    return sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))


def main(argv: list[str] | None = None) -> dict:
    from runtime.configs.model_config import ModelConfig
    from runtime.model_loader.build import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    report = {}
    for mode in (args.quantization, "none"):
        config = ModelConfig.from_path(args.model_path, args.dtype, quantization=mode)
        model = load_model(config, progress=False)
        report[mode] = {"model_bytes": model_bytes(model), "quantized": quantized_bytes(model)}
        del model
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

"""How much each format's grid alone perturbs a model's weights: round to nearest, no calibration.

    python bench/weight_error.py [--model smollm2-135m] [--formats fp8,int8,int8-g32,...] [--json]

For every decoder Linear, the format's RTN quantization; the table gives the relative weight
MSE Σ(ŵ − w)² / Σw² over all of them, and its ratio to the first format listed. It is the floor
a calibrated method starts from: GPTQ and AWQ move the error around, the grid sets its size
(docs/benchmarks.md, "Findings behind the defaults": why fp8 cannot reach Q8_0).
"""

from __future__ import annotations

import argparse
import json

import torch

DEFAULT_FORMATS = "fp8,int8,int8-g32,int4-g32,nf4,nvfp4"


def weight_errors(model: str, formats: list[str]) -> list[dict]:
    from safetensors import safe_open

    from lowbit.formats.resolve import resolve_model
    from lowbit.quant.registry import as_spec, get_format
    from lowbit.formats.hf_files import weight_files

    files = weight_files(resolve_model(model))
    sums = {f: [0.0, 0.0] for f in formats}
    specs = {f: as_spec(f) for f in formats}
    for path in files:
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                if ".layers." not in name or not name.endswith("proj.weight"):
                    continue
                w = handle.get_tensor(name).float()
                for f, spec in specs.items():
                    q = get_format(spec).quantize(w, spec).dequantize(torch.float32)
                    sums[f][0] += float(((q - w) ** 2).sum(dtype=torch.float64))
                    sums[f][1] += float((w * w).sum(dtype=torch.float64))
    first = sums[formats[0]][0] / sums[formats[0]][1]
    return [{"format": f, "relative_mse": e / n, "vs_first": (e / n) / first} for f, (e, n) in sums.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--formats", default=DEFAULT_FORMATS, help="comma-separated format labels; ratios are to the first")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    formats = args.formats.split(",")
    rows = weight_errors(args.model, formats)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{args.model}: RTN weight error of every decoder Linear")
    print(f"| format | Σ(ŵ − w)² / Σw² | × {formats[0]} |")
    print("| --- | --- | --- |")
    for r in rows:
        print(f"| {r['format']} | {r['relative_mse']:.3g} | {r['vs_first']:.3f} |")


if __name__ == "__main__":
    main()

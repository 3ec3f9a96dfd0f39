"""Plot a benchmarks/kernels.py result: decode attention time against context, quantize speed-up against N.

    python benchmarks/investigations/plot_kernels.py benchmarks/results/kernels/2026-11-30-h200.json   # writes the .png beside it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METHODS = ["affine4", "turboquant4", "turboquant3", "turboquant2", "turboquant_rvq21", "turboquant_rvq22"]


def main(path: str) -> Path:
    data = json.loads(Path(path).read_text())
    meta, rows = data["meta"], data["decode"]
    T = [r["T"] for r in rows]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    ax.plot(T, [r["fp16_sdpa_ms"] for r in rows], "k-o", lw=2, label="fp16 mx.fast.scaled_dot_product_attention")
    ax.plot(T, [r.get("mlx_lm_affine4_ms") for r in rows], "k--s", label="mlx-lm quantized SDPA, affine 4-bit")
    for i, m in enumerate(METHODS):
        color = f"C{i}"
        ax.plot(T, [r[f"{m}_kernel_ms"] for r in rows], "-o", color=color, label=f"kvq {m} (kernel)")
        ax.plot(T, [r[f"{m}_pure_ms"] for r in rows], ":", color=color, alpha=0.6)
    ax.set(xscale="log", yscale="log", xlabel="context tokens T", ylabel="ms per decode attention call",
           title=f"Decode attention, B=1 Hq=32 Hkv=8 D=128 ({meta['device']}, MLX {meta['mlx']})")
    ax.legend(fontsize=7)
    q = data["quantize"]
    for bits in sorted({r["bits"] for r in q}):
        sel = [r for r in q if r["bits"] == bits]
        bx.plot([r["N"] for r in sel], [r["speedup"] for r in sel], "-o", label=f"turboquant {bits}-bit quantize")
        bx.plot([r["N"] for r in sel], [r["dequant_pure_ms"] / r["dequant_kernel_ms"] for r in sel], "--o",
                label=f"turboquant {bits}-bit dequantize")
    bx.axhline(10, color="gray", lw=0.8)
    bx.set(xscale="log", yscale="log", xlabel="vectors N (head_dim 128)", ylabel="pure MLX time / kernel time",
           title=f"Fused encode/decode speed-up (kernel sources {meta['kernel_sources_sha256_16']})")
    bx.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main(sys.argv[1]))

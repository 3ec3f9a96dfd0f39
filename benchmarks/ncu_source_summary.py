"""Summarise Nsight Compute's SASS source counters of one profiled kernel: where its warps' stall samples fall.

Input: ``ncu --import REPORT --page source --csv --print-source sass > sass.csv`` of a report that holds one kernel
launch (profile with ``-k regex:NAME --launch-skip 1 --launch-count 1 --set full``). Prints the samples and executed
instructions per opcode, the samples between the block's barriers, fences and exits (the prologue, main loop, merge
and tail of a kernel show up as segments), and the hottest instructions with their two largest stall reasons.

    python benchmarks/ncu_source_summary.py sass.csv [--top 40]

Samples are taken per SM sub-partition at a fixed interval, so a segment's samples measure time times the SMs that
run it: divide by the SMs that run a phase (all of them for the main loop, one per row for a merging block) to
compare phases' durations. Used for ``benchmarks/results/kernels/2026-12-04-h200-ncu-*``.
"""

from __future__ import annotations

import argparse
import collections
import csv

SEGMENT_MARKS = ("BAR.SYNC", "MEMBAR", "ATOMG", "EXIT")


def number(text: str) -> float:
    """A counter's value (thousands separators removed); 0 for an empty or non-numeric cell."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: str) -> tuple[list[str], list[list[str]]]:
    """``(header, rows)`` of the source page: the header is the first row with a ``Source`` column.

    :raises ValueError: no such row (not a ``--page source --csv`` export).
    """
    with open(path, errors="replace") as f:
        rows = list(csv.reader(f))
    for i, r in enumerate(rows):
        if "Source" in r:
            return r, [x for x in rows[i + 1:] if len(x) == len(r)]
    raise ValueError(f"{path}: no header row with a 'Source' column (export with --page source --csv)")


def opcode(source: str) -> str:
    """The instruction's opcode without its predicate and modifiers (``@!P0 IMAD.WIDE.U32 ...`` -> ``IMAD``)."""
    parts = source.split()
    if not parts:
        return "?"
    return (parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]).split(".")[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40, help="hottest instructions listed")
    args = ap.parse_args()
    head, rows = read(args.csv)
    src, samples = head.index("Source"), head.index("Warp Stall Sampling (All Samples)")
    executed = head.index("Instructions Executed")
    stalls = [i for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(number(r[samples]) for r in rows)
    print(f"{len(rows)} instructions, {total:.0f} samples, {sum(number(r[executed]) for r in rows):.0f} executed")
    by_op, exec_op = collections.Counter(), collections.Counter()
    for r in rows:
        by_op[opcode(r[src])] += number(r[samples])
        exec_op[opcode(r[src])] += number(r[executed])
    print("samples by opcode:", by_op.most_common(20))
    print("executed by opcode:", exec_op.most_common(20))
    print("segments (samples since the previous mark):")
    cum = last = 0.0
    for i, r in enumerate(rows):
        cum += number(r[samples])
        if any(m in r[src] for m in SEGMENT_MARKS):
            print(f"  {i:5d} {r[src].strip()[:48]:48s} {cum - last:7.0f} ({cum / total * 100:5.1f}% so far), "
                  f"executed {number(r[executed]):.0f}")
            last = cum
    print(f"hottest {args.top}:")
    for i in sorted(sorted(range(len(rows)), key=lambda j: -number(rows[j][samples]))[:args.top]):
        r = rows[i]
        why = sorted(((number(r[j]), head[j][6:]) for j in stalls), reverse=True)[:2]
        print(f"  {i:5d} {r[src].strip()[:60]:60s} {number(r[samples]):5.0f}", [(w, int(v)) for v, w in why if v])


if __name__ == "__main__":
    main()

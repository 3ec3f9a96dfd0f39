"""fp16 perplexity of a model on kvq eval's windows with and without the BOS token in front (issue #53).

    python benchmarks/investigations/bos_windows.py [--model gemma-3-270m] [--context 2048] [--windows 2]

Both runs use the same window offsets and scored tokens; "without" is kvq eval before it put the BOS in front.
"""

from __future__ import annotations

import argparse

import kvq.evaluation.harness as harness
from kvq.evaluation import EvalSettings, Evaluation, parse_method
from kvq.models import load
from kvq.textdata import encode_text, language_reference


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=2)
    args = ap.parse_args()
    model, tokenizer = load(args.model, progress=False)
    ids = encode_text(tokenizer, language_reference())
    with_bos = harness.bos_ids
    for label, bos in (("without BOS", lambda tokenizer: []), ("with BOS", with_bos)):
        harness.bos_ids = bos
        settings = EvalSettings(args.context, windows=args.windows, needle_depths=(), progress=False)
        evaluation = Evaluation(model, tokenizer, ids, settings)
        row = evaluation.run([parse_method("fp16")])[0]
        print(f"{label}: offsets {evaluation.offsets}, first ids {evaluation.windows[0][:3].tolist()}, "
              f"PPL {row['ppl']:.3f}, per window {', '.join(f'{p:.3f}' for p in row['ppl_per_window'])}")
    harness.bos_ids = with_bos


if __name__ == "__main__":
    main()

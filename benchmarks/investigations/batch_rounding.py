"""How far apart identical rows of one batch end up with mlx-lm's KVCache and with kvq caches (docs/usage.md,
"Batches and float rounding"): the model's batched matmuls round each row slightly differently, and a quantized
cache amplifies that wherever a value lies near a code boundary.

One chat prompt (``--prompt-file``, else the demo's first question about its document) is run three times in one batch and
once alone through the default model (or ``--model``), with each cache; printed per cache: the largest difference
of the last position's logits between the batch's rows, between row 0 and the run alone, and each row's greedy
token. On the CPU, set ``LD_PRELOAD`` to OpenBLAS as the README says.

    python benchmarks/investigations/batch_rounding.py [--model NAME] [--prompt-file F]
"""

from __future__ import annotations

import argparse

import mlx.core as mx


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="kvq.models.load's name or path (default: the default model)")
    ap.add_argument("--prompt-file", default=None, help="a text file: the user's message")
    args = ap.parse_args(argv)
    import kvq
    import kvq.models
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = kvq.models.load(args.model) if args.model else kvq.models.load()
    if args.prompt_file:
        text = open(args.prompt_file).read()
    else:
        from kvq.cli.demo_cmd import demo_prompt

        text = demo_prompt()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    print(f"prompt of {len(prompt)} tokens, three rows in one batch against one alone")

    def last_logits(cache, rows: int) -> mx.array:
        out = model(mx.array([prompt] * rows), cache=cache)[:, -1, :].astype(mx.float32)
        mx.eval(out)
        return out

    caches = [("kvcache", lambda: make_prompt_cache(model)),
              ("turboquant:4", lambda: kvq.make_prompt_cache(model, "turboquant", bits=4)),
              ("turboquant:4 window 16 flush 16",
               lambda: kvq.make_prompt_cache(model, "turboquant", bits=4, window=16, flush=16)),
              ("affine:4 window 16 flush 16",
               lambda: kvq.make_prompt_cache(model, "affine", bits=4, window=16, flush=16))]
    for label, make in caches:
        batch, alone = last_logits(make(), 3), last_logits(make(), 1)
        rows = max(float(mx.abs(batch[0] - batch[i]).max()) for i in (1, 2))
        print(f"{label:32s} rows {rows:.2g}   row 0 vs alone {float(mx.abs(batch[0] - alone[0]).max()):.2g}   "
              f"greedy {[int(mx.argmax(batch[i])) for i in range(3)]} alone {int(mx.argmax(alone[0]))}")


if __name__ == "__main__":
    main()

"""``kvq eval``: quality and memory of KV-cache methods on a real model, against the reference, mlx-lm's KVCache in the model's dtype.

Perplexity and its change, KL divergence and top-1 agreement of next-token distributions, attention-output
error per layer, needle retrieval, bits per coordinate and measured cache memory, per method string
(:mod:`kvq.evaluation.spec`), under the protocol of REFERENCE_VALUES.md (:mod:`kvq.evaluation.perplexity`).
"""

from .harness import EvalSettings, Evaluation
from .spec import MethodSpec, parse_method, parse_methods

__all__ = ["EvalSettings", "Evaluation", "MethodSpec", "parse_method", "parse_methods"]

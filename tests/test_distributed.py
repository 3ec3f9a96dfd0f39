"""kvq under MLX distributed (issue #10): 2 local processes started by ``mlx.launch`` over the ring back end.

Each launch runs ``tests/distributed_worker.py`` (or ``python -m kvq.cli``) on 2 ranks. ``mlx.launch`` exits 0 even
when a rank fails, so every rank writes its own result file and :func:`rank_results` checks each one. Set
``KVQ_TEST_DISTRIBUTED_BACKEND=nccl`` to run the same tests over NCCL on a machine with 2 NVIDIA GPUs.

Numerics: pipeline parallelism runs every layer exactly as one process does, so tokens, log-probabilities and the
stored caches are bit-identical. Tensor parallelism sums the partial products of ``o_proj`` and ``down_proj`` across
ranks (``all_sum``), and a BLAS may block a sharded projection differently, so keys and values differ from one
process in the last float32 bits. kvq's dense buffers (sinks, residual window) hold float32 inputs as float16, so
such a difference now and then crosses a float16 rounding boundary and moves that element by one float16 ulp
(2^-11 relative): measured on the 2-core CI machine, the largest log-probability difference over the vocabulary is
about 1.5e-3 with OpenBLAS preloaded (as ``.ci/run`` does) and 7e-6 with MLX's bundled BLAS, against 2e-6 for
mlx-lm's float32 ``KVCache``. The tests require identical greedy tokens over the short horizon and
log-probabilities within 1e-2 at every step, a tenth of what 4-bit compression itself moves them (0.09-0.10
against the float32 cache): a head given another head's keys, codebook or rotation would not stay within it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np
import pytest
from distributed_worker import GENERATE, METHODS, NEW_TOKENS, matrix_hashes, save_tiny_folder
from test_models import write_tiny_gguf

from kvq import models

WORKER = Path(__file__).with_name("distributed_worker.py")
RANKS = 2
BACKEND = os.environ.get("KVQ_TEST_DISTRIBUTED_BACKEND", "ring")
#: Pipeline parallelism needs send/recv, which MLX 0.32's CUDA back end does not implement ("Send has no CUDA
#: implementation", seen on 2 H200s over NCCL): mlx-lm's pipelined models fail there on their own, so the pipeline
#: part runs on the ring back end only.
PIPELINE = BACKEND != "nccl"
#: mlx-lm's server under ``mlx.launch`` on NCCL: its generation thread cannot use the NCCL group made in the main
#: thread ("There is no Stream(gpu, N) in current thread" from ``mlx_lm.utils.sharded_load``), the same for
#: ``mlx_lm.server`` with its own caches as for ``kvq serve``: 2 H200s, MLX 0.32.4, mlx-lm 0.32.2
#: (benchmarks/results/distributed/2026-11-30-h200x2-nccl-serve-diagnosis.log).
SERVE_LAUNCHED = BACKEND != "nccl"
#: Seconds a launch may take (the one of every part: about 25 s on a busy 2-core CPU). A pipeline run that lost
#: its send would hang until then.
LAUNCH_TIMEOUT = 120
LOGPROB_TOLERANCE = 1e-2


# -- launching ----------------------------------------------------------------------------------------------------

def launcher() -> list[str]:
    """``mlx.launch`` run by this interpreter (the console script's entry point, wherever the venv put it)."""
    (entry,) = entry_points(group="console_scripts", name="mlx.launch")
    module, function = entry.value.split(":")
    return [sys.executable, "-c", f"import sys; from {module} import {function}; sys.exit({function}())"]


def free_port(count: int = 1) -> int:
    """A port ``p`` such that ``p .. p + count - 1`` can be bound now (the ring uses one port per rank)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        try:
            for offset in range(count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


def launch_command(*args: str) -> list[str]:
    """``<python> -m mlx.launch --backend ring -n 2 --starting-port P -- <python> ARGS``."""
    return [*launcher(), "--backend", BACKEND, "-n", str(RANKS), "--starting-port", str(free_port(RANKS)), "--",
            sys.executable, *args]


def start(command: list[str], cwd: Path) -> subprocess.Popen:
    """Start ``command`` in its own process group (so that it and every rank can be stopped together)."""
    return subprocess.Popen(command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def stop(process: subprocess.Popen) -> tuple[str, str]:
    """Stop the process group that :func:`start` made; returns its output."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            return process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    return process.communicate()


def run_launch(*args: str, cwd: Path, timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess:
    """Run ``args`` on every rank under ``mlx.launch``; its output (any exit code: it says little)."""
    process = start(launch_command(*args), cwd)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = stop(process)
        pytest.fail(f"mlx.launch of {args} ran over {timeout} s\nstdout:\n{out}\nstderr:\n{err[-4000:]}")
    return subprocess.CompletedProcess(args, process.returncode, out, err)


class RankFailed(AssertionError):
    """A rank wrote no result file, or one whose status is not "ok"."""


def rank_results(out: Path, launched: subprocess.CompletedProcess) -> list[dict]:
    """Every rank's result file, each checked: raises :class:`RankFailed` naming every rank that failed, with its
    traceback and the launcher's output."""
    results, problems = [], []
    for rank in range(RANKS):
        path = out / f"rank{rank}.json"
        result = json.loads(path.read_text()) if path.exists() else {"status": "missing"}
        if result["status"] != "ok":
            problems.append(f"rank {rank}: {result['status']}\n{result.get('traceback', '')}")
        results.append(result)
    if problems:
        raise RankFailed("\n".join(problems) + f"\nmlx.launch exit code {launched.returncode}; stdout:\n"
                         f"{launched.stdout[-2000:]}\nstderr:\n{launched.stderr[-4000:]}")
    return results


def worker(modes: str, out: Path, *args: str) -> list[dict]:
    out.mkdir()
    return rank_results(out, run_launch(str(WORKER), modes, str(out), *args, cwd=WORKER.parent))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A random llama (head_dim 64, 2 KV heads) saved as an mlx-lm folder with the tiny GGUF's byte-level tokenizer."""
    base = tmp_path_factory.mktemp("tiny")
    gguf = base / "tiny.gguf"
    write_tiny_gguf(gguf)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVQ_CACHE_DIR", str(base / "cache"))  # the conversion goes to a cache of its own
        tokenizer_folder = models.resolve_model(gguf, progress=False)
    return save_tiny_folder(base / "model", tokenizer_folder)


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_folder) -> list[dict]:
    """One launch runs every part (tensor, pipeline, kvq generate): each launch costs seconds of imports."""
    parts = "tensor,pipeline,generate" if PIPELINE else "tensor,generate"
    return worker(parts, tmp_path_factory.mktemp("launch") / "out", str(tiny_folder))


@pytest.fixture(scope="module")
def tensor_run(launched) -> list[dict]:
    return [r["tensor"] for r in launched]


@pytest.fixture(scope="module")
def pipeline_run(launched) -> list[dict]:
    """Each rank's pipeline-parallel result (empty on NCCL: see :data:`PIPELINE`)."""
    return [r["pipeline"] for r in launched] if PIPELINE else []


def max_logprob_difference(entry: dict) -> float:
    return float(np.abs(np.array(entry["logprobs"]) - np.array(entry["single_logprobs"])).max())


# -- tensor and pipeline parallel: the same tokens as one process --------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("method", [*METHODS, "vecinfer"])
def test_tensor_parallel_matches_single_process(tensor_run, method):
    """A random llama (4 heads, 2 KV heads) split over 2 ranks: each rank's caches hold 1 KV head (rank r: head r,
    with VecInfer's per-head codebooks and smoothing of head r), and generate the single-process run's tokens."""
    for rank, result in enumerate(tensor_run):
        entry = result["methods"][method]
        assert result["kv_head_range"] == [rank, rank + 1] and result["kv_layout"] == [1, 64, 64]
        assert entry["caches"] == {"layers": 2, "kv_heads": [1, 1]}
        assert 2 * entry["nbytes"] == entry["single_nbytes"] > 0  # half the KV bytes per rank
        assert len(entry["tokens"]) == NEW_TOKENS
        assert entry["tokens"] == entry["single_tokens"], f"rank {rank}"
        assert max_logprob_difference(entry) < LOGPROB_TOLERANCE, f"rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_pipeline_parallel_matches_single_process_exactly(pipeline_run, method):
    """A random qwen2 (4 layers) split over 2 ranks (rank 0 runs layers 2-3, rank 1 layers 0-1, as mlx-lm splits):
    each rank holds caches for its 2 layers only, equal bit for bit to the single-process run's caches of those
    layers, and the tokens and log-probabilities are identical. mlx-lm prefills in chunks and evaluates only the
    caches' state, so the run would hang if ``cache[-1].keys = mx.depends(...)`` lost the send."""
    if not PIPELINE:
        pytest.skip("MLX 0.32's CUDA back end has no send/recv: pipeline parallelism over NCCL fails in MLX itself")
    assert [r["first_layer"] for r in pipeline_run] == [2, 0]
    for rank, result in enumerate(pipeline_run):
        entry = result["methods"][method]
        assert result["kv_head_range"] is None and result["kv_layout"] == [2, 64, 64]
        assert entry["caches"] == {"layers": 2, "kv_heads": [2, 2]}
        assert entry["layers_equal"] == [True, True], f"rank {rank}"
        assert entry["nbytes"] == entry["single_nbytes"] > 0
        assert entry["tokens"] == entry["single_tokens"], f"rank {rank}"
        assert max_logprob_difference(entry) == 0.0, f"rank {rank}"


@pytest.mark.slow
def test_seeded_matrices_are_the_same_on_every_rank(tensor_run, pipeline_run):
    """TurboQuant's rotations and sketch and QJL's sketch depend on the seed only: every rank (each with its global
    MLX and numpy generators seeded differently) and this process build bit-identical matrices."""
    mx.random.seed(12345)
    np.random.seed(12345)
    here = matrix_hashes()
    assert len(here) == 4
    for rank, result in enumerate(tensor_run + pipeline_run):
        assert result["hashes"] == here, f"rank {rank % RANKS}"


@pytest.mark.slow
def test_too_few_kv_heads_is_a_clear_error(tensor_run):
    """1 KV head over 2 ranks: kvq refuses to shard, and refuses to make caches for a model that mlx-lm sharded,
    naming num_kv_heads and the group size; mlx-lm's own forward fails with a reshape error."""
    for result in tensor_run:
        found = result["too_few_kv_heads"]
        for where in ("shard", "make_prompt_cache"):
            assert "num_kv_heads=1" in found[where] and "group size 2" in found[where], found
        assert "reshape" in found["mlx_lm"], found


@pytest.mark.slow
def test_a_failing_rank_is_reported(tmp_path):
    """``mlx.launch`` does not say that a rank failed; the result files do."""
    with pytest.raises(RankFailed, match=r"(?s)rank 1: error.*ValueError: rank 1 fails on purpose"):
        worker("fail", tmp_path / "out")


# -- kvq generate and kvq serve under mlx.launch ------------------------------------------------------------------

def generated_text(stdout: str) -> str:
    """The streamed text of ``kvq generate``: between the cache's header line and the summary table."""
    header = "--- turboquant bits=4 (window 16) ---\n"
    start = stdout.index(header) + len(header)
    return stdout[start : stdout.index("\n\ncache ", start)]


@pytest.mark.slow
def test_generate_under_mlx_launch_prints_once_from_rank_0(launched, tiny_folder, capsys):
    """``kvq generate`` on 2 tensor-parallel ranks (each rank runs ``kvq.cli.main``): rank 0 prints one report with
    the text of the single-process run, rank 1 prints nothing."""
    from kvq.cli import main

    assert main([*GENERATE, "--model", str(tiny_folder)]) == 0
    single = capsys.readouterr().out
    rank0, rank1 = (r["generate"] for r in launched)
    assert rank0["exit_code"] == rank1["exit_code"] == 0
    assert rank1["stdout"] == ""
    out = rank0["stdout"]
    assert out.count("--- turboquant bits=4 (window 16) ---") == 1 and out.count("generation tokens/s") == 1, out
    assert len(generated_text(single)) > 0 and generated_text(out) == generated_text(single)


def completion_ids(port: int, prompt: str, timeout: float = 90) -> tuple[list[int], dict]:
    """Greedy token ids of ``/v1/completions`` (with ``logprobs``), waiting for the server; and the usage block."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    body = json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    try:
        reply = json.loads(urllib.request.urlopen(request, timeout=timeout).read())
    except urllib.error.HTTPError as exc:  # mlx-lm's server answers a failed generation with 404 and the error
        raise AssertionError(f"/v1/completions answered {exc.code}: {exc.read()[:2000]!r}") from exc
    return [t["id"] for t in reply["choices"][0]["logprobs"]["content"]], reply["usage"]


#: A cache whose greedy tokens differ from fp16's on this model, so the completion shows which cache served it
#: (flush given explicitly: kvq serve's default is 32, the library's 1, and a chunk sees what token-by-token decoding
#: with that flush sees, so the in-process reference must use the server's)
SERVE_CACHE = {"method": "turboquant", "bits": 2, "sinks": 0, "window": 0, "flush": 32}
SERVE_PROMPT = "the the the hello world " * 6


def in_process_ids(folder: Path, options: dict) -> list[int]:
    """8 greedy tokens of ``SERVE_PROMPT`` from mlx-lm with a kvq cache, in this process."""
    import mlx_lm
    from mlx_lm.generate import generate_step

    import kvq

    model, tokenizer = mlx_lm.load(str(folder))
    cache = kvq.make_prompt_cache(model, **options)
    steps = generate_step(mx.array(tokenizer.encode(SERVE_PROMPT)), model, max_tokens=8, prompt_cache=cache,
                          sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(token) for token, _ in steps]


@pytest.fixture(scope="module")
def served_ids(tiny_folder) -> list[int]:
    """The tokens a server with :data:`SERVE_CACHE` must answer; checked to differ from an fp16 cache's."""
    expected = in_process_ids(tiny_folder, SERVE_CACHE)
    assert expected != in_process_ids(tiny_folder, {"method": "fp16", "sinks": 0, "window": 0})
    return expected


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_serve_answers_with_kvq_caches(tiny_folder, served_ids, ranks):
    """``kvq serve`` (mlx-lm's server) alone and under ``mlx.launch`` (tensor parallel, rank 0 serves): the
    completion's tokens are those of mlx-lm with the same kvq cache in this process, and not fp16's."""
    if ranks > 1 and not SERVE_LAUNCHED:
        pytest.skip("mlx-lm's server under mlx.launch fails on NCCL in MLX itself (see SERVE_LAUNCHED)")
    port = free_port()
    serve = ["-m", "kvq.cli", "serve", "--model", str(tiny_folder), "--port", str(port),
             *[f"--{k}={v}" for k, v in SERVE_CACHE.items()]]
    process = start(launch_command(*serve) if ranks > 1 else [sys.executable, *serve], tiny_folder)
    try:
        ids, usage = completion_ids(port, SERVE_PROMPT)
    except AssertionError as exc:
        _, err = stop(process)
        raise AssertionError(f"{exc}\nserver stderr:\n{err[-4000:]}") from None
    except BaseException:
        stop(process)
        raise
    else:
        _, err = stop(process)
    assert ids == served_ids, err[-4000:]
    assert usage["completion_tokens"] == 8
    assert err.count("kvq serve: kvq caches of turboquant bits=2 (sinks 0, window 0, flush 32) for every request") \
        == ranks, err[-4000:]
    assert "a conversation compresses from 32 tokens on" in err, err[-4000:]


# -- in one process: the keys attribute, the KV-head check, VecInfer's head slices ---------------------------------

def filled_cache(sinks: int, window: int, tokens: int = 10):
    """An affine 4-bit KVQCache (tokens leave the window one at a time) holding ``tokens`` random tokens of
    ``[1, 2, T, 64]``."""
    from kvq.cache import KVQCache, make_config

    cache = KVQCache(make_config("affine", bits=4, sinks=sinks, window=window, step=8, flush=1))
    cache.update_and_fetch(mx.random.normal((1, 2, tokens, 64)), mx.random.normal((1, 2, tokens, 64)))
    return cache


@pytest.mark.parametrize("sinks, window, tokens, holder", [(2, 4, 10, "window"), (0, 0, 10, "compressed"),
                                                           (4, 4, 3, "sinks")])
def test_keys_and_values_can_be_reassigned_through_mx_depends(sinks, window, tokens, holder):
    """``cache.keys = mx.depends(cache.keys, h)`` (mlx-lm's pipelined models) replaces the newest stored array by
    an equal one that depends on ``h``, and the cache's ``state`` (all that generate_step evaluates) then depends on
    ``h`` too, also where attention had already viewed the compressed store; the cache keeps working and returns
    the same attention."""
    import io

    from mlx.utils import tree_flatten

    cache = filled_cache(sinks, window, tokens)
    stored = {"window": lambda: cache.window.keys, "compressed": lambda: cache.compressed_keys.data["biases"],
              "sinks": lambda: cache.sinks.keys}[holder]()  # the newest part holding tokens
    assert cache.keys is stored
    before = [np.array(v) for _, v in tree_flatten(cache.state) if isinstance(v, mx.array)]
    queries = mx.random.normal((1, 4, 1, 64))
    out = cache.attend(queries, 0.125)
    sent = mx.ones((3,))
    for side in ("keys", "values"):
        depending = mx.depends(getattr(cache, side), sent)
        setattr(cache, side, depending)
        assert getattr(cache, side) is depending
    graph = io.StringIO()
    mx.export_to_dot(graph, *[v for _, v in tree_flatten(cache.state) if isinstance(v, mx.array)])
    assert graph.getvalue().count('label ="Depends"') == 2  # keys and values: the send runs with the state
    after = [np.array(v) for _, v in tree_flatten(cache.state) if isinstance(v, mx.array)]
    assert len(after) == len(before) and all(np.array_equal(a, b) for a, b in zip(after, before))
    assert mx.array_equal(cache.attend(queries, 0.125), out)
    cache.update_and_fetch(mx.random.normal((1, 2, 5, 64)), mx.random.normal((1, 2, 5, 64)))
    assert cache.offset == tokens + 5


def test_keys_assignment_refuses_other_arrays():
    from kvq.cache import KVQCache, make_config

    cache = filled_cache(2, 4)
    with pytest.raises(ValueError, match=r"keys: .*shape \(1, 2, 4, 64\) and dtype mlx.core.float16"):
        cache.keys = mx.zeros((1, 2, 5, 64), mx.float16)
    with pytest.raises(ValueError, match="values: .*float16.*got array .*float32"):
        cache.values = mx.zeros((1, 2, 4, 64))
    empty = KVQCache(make_config("affine", bits=4))
    assert empty.keys is None and empty.values is None
    empty.keys = None  # what mlx-lm's own empty caches accept
    with pytest.raises(ValueError, match=r"keys: .*None \(the cache is empty\)"):
        empty.keys = mx.zeros((1, 2, 4, 64))


def test_batch_cache_keys_are_the_last_filled_row():
    from kvq.cache import BatchKVQCache, KVQCache, make_config

    rows = [filled_cache(2, 4), filled_cache(2, 4), KVQCache(make_config("affine", bits=4))]
    batch = BatchKVQCache(rows)
    assert batch.keys is rows[1].keys and batch.values is rows[1].values
    depending = mx.depends(batch.keys, mx.ones((2,)))
    batch.keys = depending
    assert rows[1].keys is depending and rows[0].keys is not depending
    with pytest.raises(ValueError, match="no row of this batch holds tokens"):
        BatchKVQCache([KVQCache(make_config("affine", bits=4))]).keys = mx.zeros((1,))


@pytest.mark.parametrize("kv_heads, heads, num_ranks, allowed", [(1, 4, 2, "1"), (6, 12, 4, "1, 2, 3 or 6"),
                                                                  (8, 12, 8, "1, 2 or 4")])
def test_tensor_parallel_check_names_kv_heads_and_group_size(kv_heads, heads, num_ranks, allowed):
    from kvq.distributed import check_tensor_parallel

    with pytest.raises(ValueError, match=rf"num_kv_heads={kv_heads} \(num_attention_heads={heads}\).*group size "
                                         rf"{num_ranks}.*Use a group size \(mlx.launch -n\) of {allowed}, or pipeline"):
        check_tensor_parallel(kv_heads, heads, num_ranks)
    check_tensor_parallel(8, 32, 4)
    check_tensor_parallel(8, 32, 8)


def test_unsharded_model_gets_caches_bound_to_its_layers():
    """On one process kvq.make_prompt_cache binds layers 0, 1, ... and cuts no KV heads."""
    import kvq
    import kvq.distributed
    from distributed_worker import tiny_model

    from kvq.cache import make_config

    model = tiny_model("llama")
    caches = kvq.make_prompt_cache(model, "turboquant", bits=4)
    assert [c.config for c in caches] == [make_config("turboquant", bits=4).for_layer(i) for i in range(2)]
    assert kvq.distributed.kv_head_range(model) is None and kvq.distributed.first_layer(model) == 0


@pytest.fixture
def vecinfer_data(tmp_path, monkeypatch):
    from kvq_backends_vecinfer import storage

    monkeypatch.setenv("KVQ_DATA_DIR", str(tmp_path / "kvq-data"))
    storage.forget()
    yield
    storage.forget()


@pytest.mark.parametrize("per_head", [True, False])
def test_vecinfer_head_slice_encodes_like_those_heads_of_the_whole(vecinfer_data, per_head):
    """A tensor-parallel rank holding KV heads 2:4 of 4 encodes them exactly as the whole-model cache encodes
    heads 2:4: its smoothing factors (keys) and per-head codebooks are those heads' (VecInfer, arXiv 2510.06175)."""
    from kvq_backends_vecinfer.calibrate import Options, calibrate
    from kvq_backends_vecinfer.collect import Recording
    from kvq_backends_vecinfer.impl import VecInferMLX
    from kvq_backends_vecinfer.params import VecInferParams

    rng = np.random.default_rng(0)
    scale = rng.uniform(0.5, 8.0, (4, 1, 64))  # heads with different channel scales: smoothing differs per head
    data = [mx.array((rng.standard_normal((4, 512, 64)) * scale).astype(np.float32)) for _ in range(2)]
    settings = [VecInferParams(role=r, sub_dim=4, code_bits=5, per_head=per_head) for r in ("keys", "values")]
    calibrate(Recording(data, data, (0,)), "toy", settings, Options(iterations=4, points_per_centroid=16),
              progress=False)
    impl, x = VecInferMLX(), data[0][None, :, :24]
    for setting in settings:
        whole = attrs.evolve(setting, model_id="toy", layer=0)
        part = whole.for_heads(2, 4)
        assert part.heads == (2, 4)
        codes = impl.kvq_quantize(x[:, 2:4], part).data["codes"]
        assert mx.array_equal(codes, impl.kvq_quantize(x, whole).data["codes"][:, 2:4])
        if setting.role == "keys" or per_head:  # what differs per head: the rank must not use heads 0:2
            assert not mx.array_equal(codes, impl.kvq_quantize(x[:, 2:4], whole.for_heads(0, 2)).data["codes"])


def test_vecinfer_heads_are_checked_and_survive_prompt_cache_files(vecinfer_data):
    from kvq.cache.state import config_from_json, config_to_json
    from kvq_backends_vecinfer.params import VecInferParams

    import kvq

    for bad in [(2, 2), (-1, 1), 3, (0, 1, 2), (0.0, 1)]:
        with pytest.raises(ValueError, match=r"heads must be None or \(start, stop\) with 0 <= start < stop"):
            VecInferParams(heads=bad)
    config = kvq.cache.make_config("vecinfer", key_params={"heads": (1, 2), "layer": 3},
                                   value_params={"role": "values", "heads": [1, 2]})
    loaded, _ = config_from_json(config_to_json(config, None))
    assert loaded.key_params.heads == loaded.value_params.heads == (1, 2) and loaded == config


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_patched_model_makes_kvq_caches_with_or_without_its_own_make_cache(kind):
    """qwen2 (mlx-lm's pipelined models) has no ``make_cache``: the patch must not call itself."""
    from distributed_worker import tiny_model
    from kvq.cache import KVQCache, patch_model, unpatch_model

    model = patch_model(tiny_model(kind), "affine", bits=4)
    try:
        caches = model.make_cache()
        assert len(caches) == len(model.layers) and all(isinstance(c, KVQCache) for c in caches)
        assert [c.config.key_params.bits for c in caches] == [4] * len(model.layers)
    finally:
        unpatch_model(model)
    assert not hasattr(model, "_kvq_original_make_cache")


class FakeGroup:
    """Rank ``rank`` of ``size``, for mlx-lm's ``pipeline``/``shard`` bookkeeping in one process (no collective is
    ever run: only the layer split and the weight slicing are used)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


VECINFER_STRUCTURE = {"key_params": {"code_bits": 6}, "value_params": {"code_bits": 6, "role": "values"}}


@pytest.mark.parametrize("rank, layers", [(0, [2, 3]), (1, [0, 1])])
def test_pipeline_rank_binds_its_layers_to_their_index_in_the_model(rank, layers, monkeypatch):
    """mlx-lm gives pipeline rank 0 the last layers: per-layer calibration must follow the model's layer index."""
    import kvq.distributed
    from kvq_backends_vecinfer.params import VecInferParams

    monkeypatch.setattr(VecInferParams, "check_ready", lambda self: None)  # the binding only: no calibration
    from distributed_worker import tiny_model

    model = tiny_model("qwen2")
    model.model.pipeline(FakeGroup(rank, 2))
    caches = kvq.make_prompt_cache(model, "vecinfer", **VECINFER_STRUCTURE)
    assert kvq.distributed.first_layer(model) == layers[0]
    assert [(c.config.key_params.layer, c.config.value_params.layer) for c in caches] == list(zip(layers, layers))


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_rank_binds_its_kv_heads(rank, monkeypatch):
    import kvq.distributed
    from kvq.cache import make_config
    from kvq_backends_vecinfer.params import VecInferParams

    monkeypatch.setattr(VecInferParams, "check_ready", lambda self: None)  # the binding only: no calibration
    from distributed_worker import tiny_model

    model = tiny_model("llama")
    model.shard(FakeGroup(rank, 2))
    assert kvq.distributed.kv_head_range(model) == (rank, rank + 1)
    caches = kvq.make_prompt_cache(model, "vecinfer", **VECINFER_STRUCTURE)
    assert {(c.config.key_params.heads, c.config.value_params.heads) for c in caches} == {((rank, rank + 1),) * 2}
    affine = kvq.make_prompt_cache(model, "affine", bits=4)  # no per-head state: the configuration unchanged
    assert {c.config for c in affine} == {make_config("affine", bits=4)}

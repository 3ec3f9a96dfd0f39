"""Packed rows (kvq.cache.packed): a batch of sequences of different lengths decodes in one call per layer, with
the same stored codes and the same attention as its rows decoding one by one (issue #22: batched decode in one
launch)."""

import io

import attrs
import mlx.core as mx
import pytest

from mlx_lm.generate import generate_step

from kvq.cache import BatchKVQCache, KVQCache, make_config, make_prompt_cache, patch_model, unpatch_model
from kvq.cache.packable import packable
from kvq.cache import packed as packed_module
from kvq.cache.packed import PackedRows

from conftest import batch_greedy


#: Packed rows against the rows alone. On a GPU a row that has compressed nothing attends in pure MLX alone but
#: through the fused ragged kernel in the pack, whose float32 outputs differ by kernel precision (H100 and H200: up
#: to 4.2e-4 absolute at outputs of magnitude 1-2.4, in the steps before every row has compressed; 0.0 after, when
#: both sides run kernels): atol 1e-3 there, 2e-5 elsewhere.
TOL = {"atol": 1e-3 if mx.default_device() == mx.gpu else 2e-5, "rtol": 1e-4}


def config(method, window=4):
    bits = {"affine": {"bits": 4}, "turboquant": {"bits": 3}, "fp16": {}}[method]
    return attrs.evolve(make_config(method, sinks=2, window=window, **bits), flush=4, step=16)


def greedy(model, cache, prompt, n, prefill_step_size):
    gen = generate_step(prompt, model, max_tokens=n, prompt_cache=cache, sampler=lambda x: mx.argmax(x, -1),
                        prefill_step_size=prefill_step_size)
    return [int(t) for t, _ in gen]


def batch_pair(cfg, lengths, seed=0, offset=0.0, offsets=None, outlier=None):
    """Two batches over the same rows (prefilled with ``lengths`` random tokens): one that packs, one that does
    not (``offset``, or ``offsets[i]`` for row i, added to every key: a centred layer; row ``outlier``'s keys get
    one channel 30 times the others: an outlier layer)."""
    packed, plain = [], []
    for i, n in enumerate(lengths):
        k = mx.random.normal((1, 2, n, 64), key=mx.random.key(seed + i)) + (offset if offsets is None else offsets[i])
        if i == outlier:
            k = k * mx.concatenate([mx.array([30.0]), mx.ones((63,))])
        v = mx.random.normal((1, 2, n, 64), key=mx.random.key(100 + seed + i))
        for rows in (packed, plain):
            row = KVQCache(cfg)
            row.update_and_fetch(k, v)
            row.release_chunk()
            rows.append(row)
    a, b = BatchKVQCache(packed), BatchKVQCache(plain)
    b.pack = False
    return a, b


def decode(batches, steps, seed=7, B=3):
    outs = []
    for t in range(steps):
        k = mx.random.normal((B, 2, 1, 64), key=mx.random.key(seed + 3 * t))
        v = mx.random.normal((B, 2, 1, 64), key=mx.random.key(seed + 3 * t + 1))
        q = mx.random.normal((B, 4, 1, 64), key=mx.random.key(seed + 3 * t + 2))
        step = []
        for batch in batches:
            batch.update_and_fetch(k, v)
            step.append(batch.attend(q, 0.125))
        outs.append(step)
    return outs


def codes(batch):
    return [[{k: v[:, :, : s.length] for k, v in s.data.items()} for s in (r.compressed_keys, r.compressed_values)]
            for r in batch.rows]


@pytest.mark.parametrize("method", ["affine", "turboquant", "fp16"])
@pytest.mark.parametrize("lengths", [(9, 14, 22), (14, 14, 14), (13, 14, 17)])
def test_packed_decode_matches_rows_alone(method, lengths):
    """Rows of different lengths (different windows and compressed counts: flushes at different steps), of one
    length (every row flushes at the same step and count) and two of three flushing together: every step's
    attention equals the unpacked batch's, and the stored codes are identical after 13 steps."""
    packed, plain = batch_pair(config(method), lengths)
    for got, want in decode((packed, plain), 13):
        assert mx.allclose(got, want, **TOL).item()
    assert packed.packed
    assert packed.offset.tolist() == plain.offset.tolist() == [n + 13 for n in lengths]
    for ours, theirs in zip(codes(packed), codes(plain)):
        for side_ours, side_theirs in zip(ours, theirs):
            assert all(mx.array_equal(side_ours[k], side_theirs[k]).item() for k in side_theirs)
    assert not packed.packed  # reading its rows unpacked it


@pytest.mark.parametrize("method", ["affine", "turboquant"])
@pytest.mark.parametrize("lengths", [(9, 14, 22), (13, 14, 17)])
def test_flushes_written_by_scatter_match_rows_alone(method, lengths, monkeypatch):
    """The scatter writes of flushing rows (taken where more than ``SLICED_ROWS`` rows flush in one step; forced
    here) give what the per-row slice updates and the rows alone give: every step's attention and the codes."""
    monkeypatch.setattr(packed_module, "SLICED_ROWS", 0)
    packed, plain = batch_pair(config(method), lengths)
    for got, want in decode((packed, plain), 13):
        assert mx.allclose(got, want, **TOL).item()
    for ours, theirs in zip(codes(packed), codes(plain)):
        for side_ours, side_theirs in zip(ours, theirs):
            assert all(mx.array_equal(side_ours[k], side_theirs[k]).item() for k in side_theirs)


def test_packed_centred_layer_matches_rows():
    """Keys with a large constant offset make the guard centre the layer (a key mean per row): the packed batch
    centres every row with its own mean."""
    cfg = config("turboquant", window=12)  # a first block of 16 tokens: what the guard needs to decide
    packed, plain = batch_pair(cfg, (19, 25, 33), offset=40.0)
    assert all(r.key_mean is not None for r in plain.rows)
    for got, want in decode((packed, plain), 9):
        assert mx.allclose(got, want, **TOL).item()


def test_filter_while_packed_keeps_the_chosen_rows():
    packed, plain = batch_pair(config("affine"), (9, 14, 22))
    decode((packed, plain), 3)
    packed.filter([2, 0])
    plain.filter([2, 0])
    assert packed.packed and packed.offset.tolist() == [25, 12]
    for got, want in decode((packed, plain), 6, B=2):
        assert mx.allclose(got, want, **TOL).item()


def test_pack_unpack_round_trip_keeps_every_row():
    """Unpacked rows hold what the rows held (state equal), packed bytes are the rows' bytes padded to one capacity,
    and a new prefill chunk unpacks the batch and is stored per row."""
    packed, plain = batch_pair(config("affine"), (9, 14, 22))
    decode((packed, plain), 2)
    assert packed.packed and packed.nbytes > 0
    for ours, theirs in zip(packed.rows, plain.rows):
        a, b = ours.state, theirs.state
        assert set(a) == set(b)
        assert ours.offset == theirs.offset and ours.window.length == theirs.window.length
        assert mx.array_equal(ours.window.keys[:, :, : ours.window.length],
                              theirs.window.keys[:, :, : theirs.window.length]).item()
    chunk = mx.random.normal((3, 2, 5, 64), key=mx.random.key(3))
    packed.update_and_fetch(chunk, chunk)
    assert not packed.packed and packed.offset.tolist() == [16, 21, 29]


def test_packable_refuses_what_it_cannot_pack():
    cfg = config("affine")
    fresh = [KVQCache(cfg) for _ in range(2)]
    assert not packable(fresh)  # nothing stored yet
    packed, _ = batch_pair(cfg, (13, 14))  # both past the first flush (9 tokens would not be)
    rows = packed.rows
    assert packable(rows) and not packable(rows[:1])
    other = KVQCache(attrs.evolve(cfg, window=5))
    k = mx.random.normal((1, 2, 12, 64))
    other.update_and_fetch(k, k)
    other.release_chunk()
    assert not packable([rows[0], other])  # two configurations
    assert PackedRows.pack([rows[0], other]) is None
    with pytest.raises(ValueError, match="one token per row"):
        PackedRows.pack(rows).append(mx.zeros((2, 2, 2, 64)), mx.zeros((2, 2, 2, 64)))


def test_batch_generator_with_packing_matches_single_sequences(llama_model):
    """mlx-lm's BatchGenerator (the server's path) over prompts of different lengths, with windows that flush
    during decode: the packed batch gives each prompt's greedy tokens alone."""
    prompts = [[(7 * i + 3) % 256 for i in range(n)] for n in (30, 19, 44)]
    kw = dict(window=4, flush=4, sinks=2)
    singles = [greedy(llama_model, make_prompt_cache(llama_model, "affine", bits=8, **kw), mx.array(p), n=8,
                      prefill_step_size=16) for p in prompts]
    model = patch_model(llama_model, "affine", bits=8, **kw)
    try:
        got = batch_greedy(model, prompts, 8)
    finally:
        unpatch_model(llama_model)
    assert got == singles


def test_extract_and_extend_keep_the_rows_packed():
    """mlx-lm's BatchGenerator extracts a finished sequence's cache and extends the batch with new ones: packed
    rows answer both without unpacking, and decoding on matches the unpacked batch."""
    packed, plain = batch_pair(config("affine"), (13, 14, 17))
    decode((packed, plain), 3)
    one, ref = packed.extract(1), plain.extract(1)
    assert packed.packed and one.offset == ref.offset == 17
    assert one.state.keys() == ref.state.keys()
    assert mx.array_equal(one.window.keys[:, :, : one.window.length], ref.window.keys[:, :, : ref.window.length]).item()
    more, more_plain = batch_pair(config("affine"), (30, 21), seed=9)
    packed.extend(more)
    plain.extend(more_plain)
    assert packed.packed and packed.offset.tolist() == [16, 17, 20, 30, 21]
    for got, want in decode((packed, plain), 9, seed=40, B=5):
        assert mx.allclose(got, want, **TOL).item()


@pytest.mark.parametrize("method", ["affine", "turboquant"])
def test_rows_that_have_compressed_nothing_pack_and_compress_as_alone(method):
    """Rows of 6 and 9 tokens (nothing compressed yet: the 9-token row's window is full, its first compression
    comes at the first step, fitting its parameters) pack with a row of 30 tokens; decoding matches the rows
    alone, codes included, and the batch stays packed."""
    packed, plain = batch_pair(config(method), (30, 6, 9))
    assert [r.compressed_keys.length for r in plain.rows] == [24, 0, 0]
    for got, want in decode((packed, plain), 13):
        assert mx.allclose(got, want, **TOL).item()
    assert packed.packed
    for ours, theirs in zip(codes(packed), codes(plain)):
        for side_ours, side_theirs in zip(ours, theirs):
            assert all(mx.array_equal(side_ours[k], side_theirs[k]).item() for k in side_theirs)


def test_centred_and_plain_rows_pack_together():
    """A centred row (keys with a large offset) and a row that is not: the pack holds a zero mean for the plain
    row, which changes none of its scores."""
    packed, plain = batch_pair(config("turboquant", window=12), (19, 25, 33), offsets=[40.0, 0.0, 40.0])
    assert [r.key_mean is not None for r in plain.rows] == [True, False, True]
    for got, want in decode((packed, plain), 9):
        assert mx.allclose(got, want, **TOL).item()
    assert packed.packed and [r.key_mean is not None for r in packed.rows] == [True, False, True]


def test_a_first_compression_that_differs_unpacks_the_rows():
    """A row whose first compression finds an outlier layer (stored with affine 8-bit, kvq.cache.guard) cannot
    share the pack of rows stored with turboquant: the step unpacks the batch, every row keeps its token, and
    decoding goes on as the rows alone."""
    import warnings

    from kvq.cache.guard import OutlierLayerWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutlierLayerWarning)
        packed, plain = batch_pair(config("turboquant", window=12), (40, 16, 30), outlier=1)
        assert [r.compressed_keys.length for r in plain.rows] == [24, 0, 16]
        first = decode((packed, plain), 1)
        assert packed.packed  # the 16-token row's window fills with this token: it compresses at the next
        steps = decode((packed, plain), 6, seed=50)
    assert not packed.packed
    assert [r.config.key_params.method for r in packed.rows] == ["turboquant", "affine", "turboquant"]
    for got, want in first + steps:
        assert mx.allclose(got, want, **TOL).item()
    assert packed.offset.tolist() == plain.offset.tolist() == [47, 23, 37]


def test_a_copy_of_a_packed_batch_is_independent():
    """``copy.deepcopy`` of a packed batch: the copy holds the rows unpacked (the original stays packed), and the
    two decode on independently, each as the rows alone."""
    import copy

    packed, plain = batch_pair(config("affine"), (13, 14, 17))
    decode((packed, plain), 2)
    twin, plain_twin = copy.deepcopy(packed), copy.deepcopy(plain)
    assert packed.packed and not twin.packed and twin.offset.tolist() == packed.offset.tolist() == [15, 16, 19]
    for got, want in decode((packed, plain), 3):
        assert mx.allclose(got, want, **TOL).item()
    for got, want in decode((twin, plain_twin), 5, seed=70):
        assert mx.allclose(got, want, **TOL).item()
    assert packed.offset.tolist() == [18, 19, 22] and twin.offset.tolist() == [20, 21, 24]


def reading_binding(impl, binds: list, in_place: bool = True):
    """A ``bind_ragged_dense`` for ``impl`` (pure MLX) that behaves as a kernel's bound step: each call reads the
    compressed-token arrays it was bound with, as they are then, up to each row's counts in ``lengths`` (as the
    ragged kernel does), and says so (``reads_in_place``) where ``in_place``; ``binds`` gets each binding's
    capacity (compressed tokens per row)."""
    from kvq.attention import dense_attend, merge_parts
    from kvq.encoded import Encoded

    def bind(queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values):
        binds.append(keys.num_tokens)

        def row(encoded, b, n):
            return Encoded(encoded.params, {k: v[b : b + 1, :, :n] for k, v in encoded.data.items()}, encoded.head_dim)

        def step(q, wk, wv, lengths):
            outs = []
            for b, (c, w) in enumerate(lengths.tolist()):
                qb = q[b : b + 1]
                parts = [dense_attend(qb, wk[b : b + 1, :, :w], wv[b : b + 1, :, :w], scale)]
                if c:
                    parts.append(impl.kvq_attend(qb, row(keys, b, c), row(values, b, c), scale, None))
                if sink_keys is not None:
                    parts.append(dense_attend(qb, sink_keys[b : b + 1], sink_values[b : b + 1], scale))
                outs.append(merge_parts(parts)[0])
            return mx.concatenate(outs).astype(q.dtype)

        step.reads_in_place = in_place
        return step

    return bind


@pytest.mark.parametrize("method", ["affine", "turboquant"])
@pytest.mark.parametrize("lengths", [(9, 14, 22), (14, 14, 14)])
@pytest.mark.parametrize("in_place", [True, False])
def test_the_ragged_step_stays_bound_across_flushes(method, lengths, in_place, monkeypatch):
    """Issue #52: a flush writes the flushed rows' codes into the packed arrays in place, so a bound ragged step
    that reads those arrays at each call (``reads_in_place``, as kvq_metal's) is kept: the rows bind again only
    where the arrays are replaced (the capacity grows). A step that does not say so is bound again after every
    flush. Rows of different lengths flush at different steps (most steps have one), rows of one length all at
    once; every step's attention equals the unpacked batch's."""
    from kvq.plugins import registry

    binds = []
    impl = registry().implementations[(method, "mlx")]
    monkeypatch.setattr(impl, "bind_ragged_dense", reading_binding(impl, binds, in_place), raising=False)
    # kernels off: the stand-in is the pure-MLX implementation's, which a GPU would otherwise not pick (the suite on
    # an H100 failed all four variants it reached: no binds counted)
    packed, plain = batch_pair(attrs.evolve(config(method), kernels="off"), lengths)
    compressed, capacities, rebinds = [], [], 0
    for t in range(24):
        before = list(packed._packed.compressed) if packed.packed else None
        [(got, want)] = decode((packed, plain), 1, seed=7 + 3 * t)
        assert mx.allclose(got, want, **TOL).item(), t
        compressed.append(list(packed._packed.compressed))
        capacities.append(packed._packed.capacity)
        grew = len(capacities) > 1 and capacities[-1] != capacities[-2]
        rebinds += before is None or grew or (not in_place and before != compressed[-1])
    flushes = sum(a != b for before, after in zip(compressed, compressed[1:]) for a, b in zip(before, after))
    assert flushes >= 12 and len(set(capacities)) >= 2  # flushes at most steps, and at least one growth of the arrays
    assert len(binds) == rebinds
    if in_place:
        assert binds == sorted(set(capacities))  # bound at the first step, then once per growth: never for a flush


@pytest.mark.parametrize("lengths", [(9, 14, 22), (14, 14, 14)])
def test_packed_layers_grow_on_steps_of_their_own(lengths, monkeypatch):
    """Issue #52: four layers of packed rows (the rows of each sequence made layer after layer, as
    make_prompt_cache makes them) grow their arrays ahead of the flush that needs the room, on different steps;
    every step's attention equals the unpacked batch's."""
    cfg = attrs.evolve(config("affine", window=8), flush=8)
    layers = 4
    packed_rows, plain_rows = [[] for _ in range(layers)], [[] for _ in range(layers)]
    for rows in (packed_rows, plain_rows):
        for i, n in enumerate(lengths):
            for layer in range(layers):
                row = KVQCache(cfg)
                row._slot = layers * i + layer  # as make_prompt_cache per sequence, whatever ran before
                row.update_and_fetch(mx.random.normal((1, 2, n, 64), key=mx.random.key(10 * layer + i)),
                                     mx.random.normal((1, 2, n, 64), key=mx.random.key(100 + 10 * layer + i)))
                row.release_chunk()
                rows[layer].append(row)
    pairs = []
    for layer in range(layers):
        a, b = BatchKVQCache(packed_rows[layer]), BatchKVQCache(plain_rows[layer])
        b.pack = False
        pairs.append((a, b))
    growths = 0
    for t in range(40):
        before = [a._packed.capacity if a.packed else None for a, _ in pairs]
        [step] = decode([x for pair in pairs for x in pair], 1, seed=11 + 3 * t)
        for got, want in zip(step[0::2], step[1::2]):
            assert mx.allclose(got, want, **TOL).item(), t
        grew = [i for i, (a, _) in enumerate(pairs) if a.packed and before[i] is not None
                and a._packed.capacity != before[i]]
        assert len(grew) <= 1, (t, grew)
        growths += len(grew)
    assert growths >= layers  # every layer grew (16-token steps, 8 tokens a flush, 40 steps)


def graph_nodes(*arrays) -> int:
    """Operations and inputs in the unevaluated graph of ``arrays`` (MLX's DOT export, one labelled line each)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return sum("label" in line for line in dot.getvalue().splitlines())


def test_a_ragged_window_write_costs_what_an_even_one_does():
    """Issue #52: rows whose windows hold different counts (mlx-lm's BatchGenerator admits prompts in waves, so rows
    end a few tokens apart) write a decode token with one scatter a side, as rows of one count write it with one
    slice update: the graph of a ragged append is at most a few nodes larger than an even one's (2 and 6 nodes
    here; the advanced-index assignment it replaced built 29), and writes each row's token at its own count."""
    nodes = {}
    for lengths in ((14, 14, 14), (9, 14, 22)):
        packed, _ = batch_pair(config("turboquant"), lengths)
        decode((packed,), 1)  # packs the rows
        rows = packed._packed
        before = list(rows.window_lengths)
        mx.eval(rows.window_keys, rows.window_values, rows.lengths())
        dtype = rows.window_keys.dtype
        k = mx.random.normal((3, 2, 1, 64), key=mx.random.key(3)).astype(dtype)
        v = mx.random.normal((3, 2, 1, 64), key=mx.random.key(4)).astype(dtype)
        mx.eval(k, v)
        packed.update_and_fetch(k, v)
        nodes[lengths] = graph_nodes(rows.window_keys, rows.window_values)
        for b, n in enumerate(before):
            assert mx.array_equal(rows.window_keys[b, :, n], k[b, :, 0]).item()
            assert mx.array_equal(rows.window_values[b, :, n], v[b, :, 0]).item()
        assert rows.window_lengths == [n + 1 for n in before]
    assert nodes[(9, 14, 22)] <= nodes[(14, 14, 14)] + 6, nodes

"""Every installed implementation, parameter class and entry-point module against :mod:`kvq.contract`.

Registration checks only the required members (:mod:`kvq.plugins`); these tests also check the optional ones:
each member an object defines must be callable with the signature its Protocol documents (parameter names and
kinds, compared with ``inspect.signature``), so a plugin cannot drift from the one place the contract is written.
"""

from __future__ import annotations

import inspect

import mlx.core as mx
import pytest

import kvq
from kvq import contract
from kvq.plugins import OP_HOOKS, implemented_ops


def _parameters(function) -> list[inspect.Parameter]:
    """The parameters, without a leading ``self`` (a Protocol's members are plain functions)."""
    params = list(inspect.signature(function).parameters.values())
    return params[1:] if params and params[0].name == "self" else params


def _check_member(obj, protocol, name: str) -> None:
    """``obj.name`` takes the documented parameters (same names, same kinds, same order); any parameter after
    them has a default (or is ``*args``/``**kwargs``), so the documented call works."""
    member, spec = getattr(obj, name), vars(protocol)[name]
    assert callable(member), f"{obj!r}.{name} is not callable"
    want = [(p.name, p.kind) for p in _parameters(spec.__func__ if isinstance(spec, staticmethod) else spec)]
    got = _parameters(member)
    extra = got[len(want):]
    assert [(p.name, p.kind) for p in got[: len(want)]] == want and all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in extra), \
        f"{obj!r}.{name}{inspect.signature(member)}: the contract (kvq.contract.{protocol.__name__}) says {want}"


IMPLEMENTATIONS = sorted(kvq.registry().implementations.items())
PARAMS_CLASSES = sorted((name, m.params_class) for name, m in kvq.registry().methods.items())
ENTRY_POINTS = sorted((n, p) for n, p in kvq.plugin_manager().list_name_plugin() if n.startswith("entry-point:"))


@pytest.mark.parametrize("key, impl", IMPLEMENTATIONS, ids=[f"{m}:{b}" for (m, b), _ in IMPLEMENTATIONS])
def test_implementation_has_the_required_members_and_the_hooks_of_its_ops(key, impl):
    assert isinstance(impl, contract.Implementation) and (impl.method, impl.backend) == key
    _check_member(impl, contract.Implementation, "supports")
    _check_member(impl, contract.Implementation, "cost")
    assert implemented_ops(impl), f"{impl!r} serves no op"
    for op in implemented_ops(impl):
        protocol = contract.OP_PROTOCOLS[op]
        assert isinstance(impl, protocol)
        for hook in OP_HOOKS[op]:
            _check_member(impl, protocol, hook)


@pytest.mark.parametrize("key, impl", IMPLEMENTATIONS, ids=[f"{m}:{b}" for (m, b), _ in IMPLEMENTATIONS])
def test_implementation_optional_members_have_the_documented_signatures(key, impl):
    for protocol in contract.IMPLEMENTATION_OPTIONS:
        name = contract.member_name(protocol)
        if hasattr(impl, name):
            assert contract.optional_hook(impl, protocol) is not None
            _check_member(impl, protocol, name)
        else:
            assert contract.optional_hook(impl, protocol) is None


@pytest.mark.parametrize("name, params_class", PARAMS_CLASSES, ids=[n for n, _ in PARAMS_CLASSES])
def test_params_class_meets_the_contract(name, params_class):
    params = kvq.make_params(name)  # every field has a default
    assert isinstance(params, contract.Params) and params_class.method == name
    hash(params)
    for member in ("accounting", "check_head_dim"):
        _check_member(params, contract.Params, member)
    for protocol in contract.PARAMS_OPTIONS:
        member = contract.member_name(protocol)
        # side_defaults is read from the class (kvq.cache.make_config), the others from an instance
        holder = params_class if protocol is contract.SideDefaults else params
        if hasattr(holder, member):
            _check_member(holder, protocol, member)


@pytest.mark.parametrize("name, module", ENTRY_POINTS, ids=[n for n, _ in ENTRY_POINTS])
def test_entry_point_modules_meet_the_contract(name, module):
    assert isinstance(module, contract.EntryPoint)
    _check_member(module, contract.EntryPoint, "kvq_register")
    if hasattr(module, "sources_hash"):
        _check_member(module, contract.ReportsSources, "sources_hash")


def test_the_installed_plugins_are_all_checked():
    """The parametrisations above are not empty: the built-in methods and their implementations are there."""
    assert {"affine", "fp16", "turboquant", "qjl", "vecinfer"} <= {n for n, _ in PARAMS_CLASSES}
    assert {("affine", "mlx"), ("*", "mlx")} <= {k for k, _ in IMPLEMENTATIONS}
    assert "entry-point:baselines" in {n for n, _ in ENTRY_POINTS}


def test_optional_hook_reads_one_member_and_refuses_other_protocols():
    class Layered:
        def for_layer(self, layer):
            return layer

    assert contract.optional_hook(Layered(), contract.ForLayer)(3) == 3
    assert contract.optional_hook(Layered(), contract.ForHeads) is None
    assert contract.member_name(contract.SideDefaults) == "side_defaults"
    with pytest.raises(KeyError):
        contract.optional_hook(Layered(), contract.Params)


def test_plugin_manager_is_the_registry_s_and_broadcasts_a_hook():
    """``kvq.plugin_manager()`` (cited by kvq.hookspecs): a broadcast call returns one result per implementation."""
    pm = kvq.plugin_manager()
    assert pm is kvq.registry().pm
    codes = mx.array([[1, 2, 3, 0, 7]], dtype=mx.uint32)
    packed = pm.hook.kvq_pack(codes=codes, bits=3)
    packers = [i for i in kvq.all_implementations() if "pack" in implemented_ops(i)]
    assert len(packed) == len(packers) >= 1
    for words in packed:
        assert mx.array_equal(kvq.select("affine", (1, 1, 16, 64), op="pack").unpack(words, 3, 5), codes)


def test_a_member_with_other_parameters_is_caught():
    class Drifted:
        def scores(self, q, keys, begin, end):
            return q

        def for_heads(self, start, stop, step=1):  # an extra parameter with a default: still callable as documented
            return self

    with pytest.raises(AssertionError, match=r"kvq.contract.ScoresKeys"):
        _check_member(Drifted(), contract.ScoresKeys, "scores")
    _check_member(Drifted(), contract.ForHeads, "for_heads")

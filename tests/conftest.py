"""Shared fixtures: a random generator, the tiny random llama, and registering fake plugins."""

from __future__ import annotations

import mlx.core as mx
import pytest

import kvq


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)


@pytest.fixture
def registered():
    """Register objects for one test: ``registered(obj, ...)``; they are unregistered afterwards."""
    added = []

    def add(*objs):
        for obj in objs:
            added.append(kvq.register(obj))
        return objs[0] if len(objs) == 1 else objs

    yield add
    for obj in reversed(added):
        kvq.unregister(obj)


def has_gpu() -> bool:
    return mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())

"""``kvq serve``'s ``GET /v1/models`` on a machine without a Hugging Face hub folder: a JSON list holding the
served model, no traceback (mlx-lm's handler scans the hub cache and raised ``CacheNotFound`` there)."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
from mlx_lm import server

from kvq.cli.serve_cmd import scan_or_empty


def _models_reply(monkeypatch, hub: str, model: str) -> dict:
    """Run mlx-lm's /v1/models handler with kvq serve's scan and ``HF_HUB_CACHE=hub``; its JSON reply."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", hub)
    monkeypatch.setattr(server, "scan_cache_dir", scan_or_empty(server.scan_cache_dir))
    out = io.BytesIO()
    handler = SimpleNamespace(path="/v1/models", created=0, wfile=out, end_headers=lambda: None,
                              _set_completion_headers=lambda code: None,
                              response_generator=SimpleNamespace(cli_args=SimpleNamespace(model=model)))
    server.APIHandler.handle_models_request(handler)
    return json.loads(out.getvalue())


def test_models_without_hub_folder_lists_the_served_model(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    reply = _models_reply(monkeypatch, str(tmp_path / "no-hub-here"), str(model))
    assert reply["object"] == "list"
    assert [m["id"] for m in reply["data"]] == [str(model.resolve())]


def test_without_kvqs_scan_mlx_lm_raises_there(tmp_path, monkeypatch):
    """The fault the wrapper exists for: mlx-lm's own scan raises on a missing hub folder."""
    from huggingface_hub import constants, scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "no-hub-here"))
    with pytest.raises(CacheNotFound):
        scan_cache_dir()

"""Tiny checkpoints shared by the test modules of one pytest process (each xdist worker builds its
own): a module that sets `CKPT = {"seed": ..., **make_llama overrides}` gets that checkpoint as
its `ckpt` fixture, built once per session whichever modules ask for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.tiny_models import make_deepseek, make_llama


class TinyCheckpoints:
    """make_llama (and make_deepseek) checkpoints by their arguments, each made once (same
    arguments, same bytes).
    Every one is a directory named `tiny` (the served model name tests expect)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, Path] = {}

    def llama(self, **kw: Any) -> Path:
        key = json.dumps(kw, sort_keys=True)
        if key not in self.made:
            self.made[key] = make_llama(self.root / f"llama{len(self.made)}" / "tiny", **kw)
        return self.made[key]

    def deepseek(self, **kw: Any) -> Path:
        """make_deepseek(**kw), made once (a DeepseekV3 MLA checkpoint)."""
        key = "deepseek" + json.dumps(kw, sort_keys=True)
        if key not in self.made:
            self.made[key] = make_deepseek(self.root / f"deepseek{len(self.made)}" / "tiny", **kw)
        return self.made[key]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    return TinyCheckpoints(tmp_path_factory.mktemp("tiny-checkpoints"))


@pytest.fixture(scope="module")
def ckpt(request: pytest.FixtureRequest, tiny_checkpoints: TinyCheckpoints) -> Path:
    """The module's tiny Llama: make_llama(**CKPT) of the test module."""
    kw = getattr(request.module, "CKPT", None)
    if kw is None:
        raise ValueError(f"{request.module.__name__} uses `ckpt` but sets no CKPT dict")
    return tiny_checkpoints.llama(**kw)


@pytest.fixture(scope="module")
def mla_ckpt(request: pytest.FixtureRequest, tiny_checkpoints: TinyCheckpoints) -> Path:
    """The module's tiny DeepseekV3 (MLA + MoE): make_deepseek(**MLA_CKPT) of the test module."""
    kw = getattr(request.module, "MLA_CKPT", None)
    if kw is None:
        raise ValueError(f"{request.module.__name__} uses `mla_ckpt` but sets no MLA_CKPT dict")
    return tiny_checkpoints.deepseek(**kw)

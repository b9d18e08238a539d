"""Preconditions on third-party layouts, checked in the test process before any rank starts.

A test that builds on an upstream's internals (a Hugging Face TP plan, a model class's parameter layout, a
torchtitan or Lightning class) asks here which layout the installed release gives. A layout the test knows is
returned by name and the test follows it; an unknown one fails the test with one line naming the package, its
version and what changed, instead of an ``AttributeError`` deep inside a rank.
"""

from __future__ import annotations

import importlib.metadata

import pytest

__all__ = ["upstream_changed", "qwen3_moe_expert_layout"]


def upstream_changed(package: str, what: str) -> None:
    """Fail the calling test with one line: ``upstream changed: <package> <version>: <what>``."""
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = "(not installed)"
    pytest.fail(f"upstream changed: {package} {version}: {what}", pytrace=False)


def qwen3_moe_expert_layout() -> str:
    """How Hugging Face's stock Qwen3-MoE TP plan places the fused experts ``gate_up_proj`` ``(E, 2I, H)`` and
    ``down_proj`` ``(E, H, I)``.

    Returns:
        ``"strided"``: ``packed_colwise`` / ``rowwise`` rules, i.e. ``_StridedShard(1, split_factor=2)`` and
        ``Shard(2)`` (transformers 5.0 to 5.24); ``"replicated"``: the TP plan has no expert rule, so every TP rank
        holds every expert whole (transformers 5.25 moved them to ``base_model_ep_plan``).

    Fails the test (one line) on any other layout.
    """
    from transformers import Qwen3MoeConfig

    plan = dict(Qwen3MoeConfig.base_model_tp_plan or {})
    rules = {k: v for k, v in plan.items() if ".mlp.experts" in k}
    if rules.get("layers.*.mlp.experts.gate_up_proj") == "packed_colwise" and \
            rules.get("layers.*.mlp.experts.down_proj") == "rowwise":
        return "strided"
    if not rules:
        return "replicated"
    upstream_changed("transformers", f"Qwen3-MoE's TP plan gives the fused experts {rules}, a layout this test does "
                                     "not know (5.24: packed_colwise/rowwise; 5.25: none, experts replicated)")
    raise AssertionError("unreachable")  # pragma: no cover

"""Which params go to Muon and which to AdamW (and to which AdamW group), and the table rank 0 logs of it.

[Note: the default split] Muon is for the hidden layers' matrices. By default a param is a Muon matrix when it is
the 2-D weight of an ``nn.Linear`` or of a Hugging Face ``Conv1D`` (GPT-2's linears, stored ``(in, out)``), and
it is neither

* an embedding: the weight of an ``nn.Embedding`` (or of HF's ``get_input_embeddings()``), including any linear
  whose weight is tied to it (an output head sharing the embedding matrix is the same tensor), nor
* the output head: HF's ``get_output_embeddings()``, or a ``nn.Linear`` child of the root module named
  ``lm_head`` (HF, nanoGPT), ``output`` (torchtitan), ``output_layer`` (Megatron-Core) or ``head``.

Those go to AdamW, with the 1-D params (norms, biases). Source: Keller Jordan, "Muon: An optimizer for hidden layers
in neural networks" (2024), which says Muon is meant for the hidden weight layers only and that the input embedding
and the final output layer (like gains and biases) should use a standard optimizer such as AdamW; Megatron-Core's
Muon support makes the same split (as issue 16 reports). A ``muon_filter`` replaces this rule entirely.

A pruned or parametrized weight is judged by the param that stores it (``weight_orig``,
``parametrizations.weight.original``: :func:`stored_weight`), which is what ``torch.optim.Muon`` steps.

HF ``Conv1D`` is detected without importing transformers: a module whose class is named ``Conv1D`` and which has
the ``nf`` attribute (its output width) of HF's ``transformers.pytorch_utils.Conv1D``.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import Tensor, nn

__all__ = ["HEAD_NAMES", "conv1d_weights", "default_muon_ids", "expert_selector", "name_matches", "sort_params", "adamw_param_groups", "split_table"]

HEAD_NAMES = ("lm_head", "output", "output_layer", "head")
"""Names of a root's ``nn.Linear`` child taken as the output head (HF/nanoGPT, torchtitan, Megatron-Core, timm)."""


def stored_weight(m: nn.Module) -> Any:
    """The param that stores ``m``'s weight: ``m.weight``, or the original of a pruned one (``torch.nn.utils.prune``
    registers it as ``weight_orig`` and computes ``weight`` from it in a forward pre-hook) or of a parametrized one
    (``torch.nn.utils.parametrize``: ``parametrizations.weight.original``); ``None`` without one."""
    from torch.nn.utils import parametrize

    if parametrize.is_parametrized(m, "weight"):
        return getattr(m.parametrizations.weight, "original", None)
    own = dict(m.named_parameters(recurse=False))
    if "weight" not in own and "weight_orig" in own:
        return own["weight_orig"]
    return getattr(m, "weight", None)


def _is_conv1d(m: nn.Module) -> bool:
    w = stored_weight(m)
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and isinstance(w, Tensor) and w.ndim == 2


def conv1d_weights(model: nn.Module) -> set[int]:
    """``id`` of every HF ``Conv1D`` weight in ``model`` (stored ``(in, out)``, used as ``x @ W + b``)."""
    return {id(stored_weight(m)) for m in model.modules() if _is_conv1d(m)}


def _hf_module(model: nn.Module, getter: str) -> Any:
    fn = getattr(model, getter, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except (NotImplementedError, AttributeError, TypeError):
        return None


def default_muon_ids(model: nn.Module) -> set[int]:
    """``id`` of the params the default rule ([Note: the default split]) gives to Muon."""
    weights = {m: stored_weight(m) for m in model.modules()}
    mats = {id(w) for m, w in weights.items()
            if (isinstance(m, nn.Linear) or _is_conv1d(m)) and isinstance(w, Tensor) and w.ndim == 2}
    excluded = {id(w) for m, w in weights.items() if isinstance(m, nn.Embedding)}
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        mod = _hf_module(model, getter)
        if isinstance(mod, nn.Module) and isinstance(stored_weight(mod), Tensor):
            excluded.add(id(stored_weight(mod)))
    for name, child in model.named_children():
        if name in HEAD_NAMES and isinstance(child, nn.Linear):
            excluded.add(id(stored_weight(child)))
    return mats - excluded


def sort_params(
    model: nn.Module, muon_filter: Callable[[str, Tensor], bool] | None, experts: Any
) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]], set[int], list[str]]:
    """Sort ``model``'s params into Muon and AdamW ones ([Note: the default split]; ``experts=`` selects expert
    params, which are Muon params too: ``muon_filter``, when given, must pick them).

    Returns:
        ``(muon_named, adamw_named, expert_ids, errors)``: ``(name, param)`` lists in registration order (a tied
        param once), the ``id`` of every expert param, and one message per param that cannot be a Muon param.

    Raises:
        TypeError: ``experts`` is not a pattern, a list of them or a callable.
    """
    default_muon = default_muon_ids(model) if muon_filter is None else set()
    is_expert = expert_selector(experts)
    muon_named, adamw_named, errors, expert_ids = [], [], [], set()
    named = list(model.named_parameters())  # remove_duplicate=True: a tied param appears once
    if isinstance(experts, (str, list, tuple)):
        pats = [experts] if isinstance(experts, str) else list(experts)
        unused = [x for x in pats if not any(name_matches(n, x) for n, _ in named)]
        errors += [f"experts patterns {unused} match no param of the model"] if unused else []
    for name, p in named:
        expert = is_expert(name, p)
        if expert and "bias" in name.rsplit(".", 1)[-1]:
            errors.append(f"experts= selects {name!r} (shape {tuple(p.shape)}), a bias: biases are not Muon matrices; "
                          "narrow the pattern to the expert weights (e.g. '*.experts.*weight*' or '*.experts.w*')")
            expert = False
        pick = muon_filter(name, p) if muon_filter is not None else id(p) in default_muon or expert
        if expert and not pick:
            errors.append(f"expert param {name!r} is selected by experts= but not by muon_filter")
        if not pick:
            adamw_named.append((name, p))
        elif p.ndim != (3 if expert and p.ndim == 3 else 2) or p.is_complex():
            hint = (" or, for an expert param, a 3-D (E, P, Q) stack of them" if expert else
                    " (a 3-D (E, P, Q) stack of expert matrices: select it with experts=)" if p.ndim == 3 else "")
            errors.append(f"Muon param {name!r} has shape {tuple(p.shape)} and dtype {p.dtype}; Muon needs a "
                          f"real 2-D matrix{hint}")
        else:
            muon_named.append((name, p))
            expert_ids |= {id(p)} if expert else set()
    return muon_named, adamw_named, expert_ids, errors


def name_matches(name: str, pattern: str) -> bool:
    """``pattern`` names ``name``: the name itself (so ``"moe.w[0]"`` names one matrix of a grouped expert weight,
    brackets and all), or an ``fnmatch`` pattern matching it."""
    return name == pattern or fnmatch.fnmatchcase(name, pattern)


def expert_selector(experts: Any) -> Callable[[str, Tensor], bool]:
    """``experts=`` as a ``(name, param) -> bool``: a callable as is, an ``fnmatch`` pattern or an iterable of
    them (matched against ``named_parameters()`` names), ``None`` selecting nothing.

    Raises:
        TypeError: anything else.
    """
    if experts is None:
        return lambda n, p: False
    if callable(experts):
        return experts
    pats = [experts] if isinstance(experts, str) else list(experts) if isinstance(experts, Iterable) else None
    if pats is None or not all(isinstance(x, str) for x in pats):
        raise TypeError(f"experts must be a (name, param) -> bool callable, an fnmatch pattern or a list of them, "
                        f"got {experts!r}")
    return lambda n, p: any(name_matches(n, x) for x in pats)


def adamw_param_groups(
    named: Sequence[tuple[str, Tensor]], specs: Sequence[dict[str, Any]] | None, muon_names: set[str],
    all_names: dict[str, Tensor],
) -> list[dict[str, Any]]:
    """The inner AdamW's param groups: one per ``specs`` entry (in order), then one for the params left over.

    Args:
        named: the AdamW params ``(name, param)``, in registration order.
        specs: ``adamw_groups``: dicts whose ``"params"`` selects params by a ``(name, param) -> bool`` callable,
            or by an iterable of param names or of the params themselves; every other key (``lr``,
            ``weight_decay``, ``betas``, ...) overrides ``adamw_kwargs`` for that group. A param goes to the first
            group that selects it; the params no group selects form a last group with ``adamw_kwargs``.
        muon_names: names of the Muon params (selecting one by name is an error).
        all_names: every param of the model by each of its names (tied params under every name).

    Returns:
        Group dicts for ``torch.optim.AdamW`` (a group may be empty when its callable selects nothing; the
        leftover group is omitted when empty).

    Raises:
        TypeError: a spec is not a dict with a ``"params"`` entry.
        ValueError: a spec names a param the model does not have, or a Muon param.
    """
    if not specs:
        return [{"params": [p for _, p in named]}] if named else []
    taken: set[int] = set()
    muon_ids = {id(all_names[n]) for n in muon_names if n in all_names}
    by_id_name = {id(p): n for n, p in all_names.items()}
    groups = []
    for k, spec in enumerate(specs):
        if not isinstance(spec, dict) or "params" not in spec:
            raise TypeError(f"adamw_groups[{k}] must be a dict with a 'params' entry, got {spec!r}")
        sel = spec["params"]
        if callable(sel):
            pick: Callable[[str, Tensor], bool] = sel
        else:
            items = [sel] if isinstance(sel, (str, Tensor)) else list(sel)
            wanted: set[int] = set()
            for it in items:
                n = it if isinstance(it, str) else by_id_name.get(id(it))
                if n is None or n not in all_names:
                    raise ValueError(f"adamw_groups[{k}] selects {it if isinstance(it, str) else 'a tensor'!r}, "
                                     "which is not a param of the model")
                if n in muon_names or id(all_names[n]) in muon_ids:
                    raise ValueError(f"adamw_groups[{k}] selects {n!r}, a Muon param; adamw_groups place AdamW params "
                                     "only (use muon_filter to move a param to AdamW)")
                wanted.add(id(all_names[n]))
            pick = lambda n, p, wanted=wanted: id(p) in wanted  # noqa: E731
        params = [p for n, p in named if id(p) not in taken and pick(n, p)]
        taken |= {id(p) for p in params}
        groups.append({**{key: v for key, v in spec.items() if key != "params"}, "params": params})
    rest = [p for _, p in named if id(p) not in taken]
    return groups + ([{"params": rest}] if rest else [])


def _pattern(name: str) -> str:
    return re.sub(r"(?<=\.)\d+(?=\.)", "*", name)


def split_table(
    muon: Iterable[tuple[str, tuple[int, ...], bool]], adamw: Iterable[tuple[str, tuple[int, ...], int]],
    nbytes: tuple[int, int],
) -> tuple[str, str]:
    """``(table, summary)``: which params went where, for rank 0's log at construction.

    Args:
        muon: ``(name, full shape, transposed)`` of each Muon matrix.
        adamw: ``(name, full shape, AdamW group index)`` of each AdamW param.
        nbytes: bytes of the Muon params and of the AdamW params (full logical sizes, param dtype).

    Returns:
        A table with one row per name pattern (layer indices folded into ``*``, with a count) and shape, and a
        one-line summary with counts and bytes.
    """
    rows: dict[tuple[str, str, str], int] = {}
    n_muon = n_adamw = 0
    for name, shape, tr in muon:
        n_muon += 1
        key = ("muon", _pattern(name), f"{tuple(shape)}{' (in, out): NS on its transpose' if tr else ''}")
        rows[key] = rows.get(key, 0) + 1
    for name, shape, gi in adamw:
        n_adamw += 1
        key = (f"adamw[{gi}]", _pattern(name), str(tuple(shape)))
        rows[key] = rows.get(key, 0) + 1
    w = max([len(k[1]) for k in rows] + [4])
    lines = [f"  {alg:<9} {pat:<{w}} x{cnt:<4} {shape}" for (alg, pat, shape), cnt in rows.items()]
    summary = (f"OverlapMuon params: {n_muon} Muon matrices ({_mib(nbytes[0])}), {n_adamw} AdamW params "
               f"({_mib(nbytes[1])})")
    return "OverlapMuon param split (algorithm, name, count, full shape):\n" + "\n".join(lines), summary


def _mib(n: int) -> str:
    return f"{n} B" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"

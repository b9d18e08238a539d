"""Fused weights orthogonalized as their parts: split QKV, fused gate/up, per-head blocks.

A fused attention weight ``[Q; K; V]`` (or a SwiGLU ``[gate; up]``) is one ``nn.Linear`` for speed, but Muon on the
fused matrix is a different optimizer from Muon on Q, K and V each (Megatron-Core offers the latter as
``muon_split_qkv``). A :class:`RowSplit` names the row sets of the full ``(P, Q)`` matrix that are separate
matrices: the NS home assembles the fused matrix as usual, orthogonalizes each part (parts of one shape batched
together), and puts the results back in place; the learning-rate ratio of every row is its part's. The result
equals ``torch.optim.Muon`` applied to each part as its own parameter, bit for bit (``tests/test_split.py``).
Momentum, Nesterov and weight decay are elementwise, so the split changes nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from ._layout import block
from ._sorting import name_matches

__all__ = ["RowSplit", "QKVSplit", "GateUpSplit", "HeadSplit", "resolve_split", "strided_parts", "apply_runs"]


class RowSplit:
    """Base class: ``parts(full_shape)`` is a list of row-index lists that partition ``range(P)``; part ``k`` is
    the matrix ``full[parts[k]]`` (rows in that order)."""

    def parts(self, full_shape: tuple[int, int]) -> list[list[int]]:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass(frozen=True)
class QKVSplit(RowSplit):
    """Q, K and V of a fused attention input projection as three matrices.

    Args:
        n_heads: query heads ``h``.
        n_kv_heads: key/value heads ``g`` (``h % g == 0``; ``g == h`` is multi-head attention).
        head_dim: rows per head.
        layout: ``"blocked"``: rows ``[Q (h*hd); K (g*hd); V (g*hd)]``; ``"grouped"``: for each of the ``g``
            groups, its ``h/g`` query heads, then one key and one value head (the grouped-query interleaving; with
            ``g == h`` it is ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``, this project's ``model.py`` layout).
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    layout: str = "blocked"

    def parts(self, full_shape: tuple[int, int]) -> list[list[int]]:
        h, g, hd = self.n_heads, self.n_kv_heads, self.head_dim
        if h % g or self.layout not in ("blocked", "grouped"):
            raise ValueError(f"QKVSplit needs n_heads % n_kv_heads == 0 and layout blocked|grouped, got {self}")
        if full_shape[0] != (h + 2 * g) * hd:
            raise ValueError(f"QKVSplit {self} covers {(h + 2 * g) * hd} rows, the matrix has {full_shape[0]}")
        if self.layout == "blocked":
            q, kv = h * hd, g * hd
            return [list(range(q)), list(range(q, q + kv)), list(range(q + kv, q + 2 * kv))]
        per = (h // g + 2) * hd  # rows of one group
        q_rows, k_rows, v_rows = [], [], []
        for grp in range(g):
            base = grp * per
            q_rows += range(base, base + (h // g) * hd)
            k_rows += range(base + (h // g) * hd, base + (h // g + 1) * hd)
            v_rows += range(base + (h // g + 1) * hd, base + per)
        return [q_rows, k_rows, v_rows]


@dataclass(frozen=True)
class GateUpSplit(RowSplit):
    """A fused SwiGLU ``[gate; up]`` projection (``2F`` rows) as two ``(F, D)`` matrices."""

    def parts(self, full_shape: tuple[int, int]) -> list[list[int]]:
        p = full_shape[0]
        if p % 2:
            raise ValueError(f"GateUpSplit needs an even number of rows, the matrix has {p}")
        return [list(range(p // 2)), list(range(p // 2, p))]


@dataclass(frozen=True)
class HeadSplit(RowSplit):
    """Every block of ``head_dim`` consecutive rows as its own matrix (per-head orthogonalization)."""

    head_dim: int

    def parts(self, full_shape: tuple[int, int]) -> list[list[int]]:
        p, hd = full_shape[0], self.head_dim
        if hd < 1 or p % hd:
            raise ValueError(f"HeadSplit(head_dim={hd}) does not divide the matrix's {p} rows")
        return [list(range(s, s + hd)) for s in range(0, p, hd)]


SplitArg = Mapping[str, RowSplit] | Callable[[str, Tensor], RowSplit | None] | None


def resolve_split(split: SplitArg, name: str, param: Tensor, full_shape: tuple[int, int]
                  ) -> tuple[list[list[int]] | None, str | None]:
    """The parts of param ``name`` (``None``: not split) and an error message (``None``: fine).

    ``split`` maps param names (the name itself, or ``fnmatch`` patterns, e.g. ``"blocks.*.attn.qkv.weight"``) to a :class:`RowSplit`,
    or is a callable ``(name, param) -> RowSplit | None``.
    """
    if split is None:
        return None, None
    if callable(split) and not isinstance(split, Mapping):
        spec = split(name, param)
    else:
        spec = next((v for k, v in split.items() if name_matches(name, k)), None)
    if spec is None:
        return None, None
    if not isinstance(spec, RowSplit):
        return None, f"split for Muon param {name!r} is a {type(spec).__name__}, expected a RowSplit"
    try:
        parts = [list(map(int, rows)) for rows in spec.parts(full_shape)]
    except ValueError as e:
        return None, f"Muon param {name!r} of shape {full_shape}: {e}"
    flat = sorted(r for rows in parts for r in rows)
    if flat != list(range(full_shape[0])) or any(not rows for rows in parts):
        return None, (f"split {spec} of Muon param {name!r} (shape {full_shape}) must give non-empty row sets "
                      "that cover every row once")
    return parts, None


def strided_parts(parts: Sequence[Sequence[int]] | None, full_shape: tuple[int, int], split_factor: int, T: int
                  ) -> list[list[int]]:
    """The parts of a matrix sharded ``_StridedShard(rows, split_factor)`` over ``T`` ranks, in the rows of the
    matrix the exchanges assemble.

    [Note: strided expert rows] The exchanges place rank ``t``'s ``P/T`` local rows at rows ``[t*P/T, (t+1)*P/T)``
    of the matrix they assemble (``block(..., partition_dim=0)``), but a strided shard's local rows are row block
    ``t`` of each of the ``split_factor`` pieces (Hugging Face's fused ``[gate; up]``): the assembled matrix is the
    true one with its rows permuted. That is FSDP2's strided order with the pieces as the outer split: piece ``i``'s
    block on rank ``t`` is ``block(full_shape, 0, T, split_factor, t, i)``. Each true part (the whole matrix when
    ``parts`` is ``None``) becomes the list of its rows' positions in the assembled matrix, in true order, so
    ``_ns.split_ns`` gathers the true matrix (or part), orthogonalizes it and puts each result row back where the
    rank holding it reads it; :func:`apply_runs` then gives every local run its true region and lr ratio.

    Args:
        parts: the true row sets (:func:`resolve_split`), or ``None`` for the whole matrix.
        full_shape: ``(P, Q)``, ``P`` a multiple of ``split_factor * T``.
        split_factor: the pieces (2 for ``[gate; up]``).
        T: the ranks of the strided dim.

    Returns:
        The row sets in assembled positions, one per true part.
    """
    P = full_shape[0]
    at = [0] * P  # true row -> its row in the assembled matrix
    pos = 0
    for t in range(T):  # rank t's local rows, in order: its block of piece 0, then of piece 1, ...
        for i in range(split_factor):
            row0, rows, _, _ = block(full_shape, 0, T, split_factor, t, i)
            for r in range(row0, row0 + rows):
                at[r] = pos
                pos += 1
    return [[at[r] for r in rows] for rows in (parts if parts is not None else [range(P)])]


def apply_runs(parts: Sequence[Sequence[int]] | None, full_shape: tuple[int, int],
               shard: tuple[int, int, int, int]) -> tuple[tuple[int, int, tuple[int, int], tuple[int, int, int, int]], ...]:
    """How a shard applies its update, in runs of local rows that belong to one matrix (the whole matrix, or one
    part of a split one): ``(start, stop, matrix_shape, region)``, where ``matrix_shape`` sets the lr ratio and
    ``region = (row0, rows, col0, cols)`` places the run in that matrix (``_muon_math.apply_update`` rounds as torch
    does on it).

    Args:
        parts: the matrix's row sets (:func:`resolve_split`), or ``None``.
        full_shape: ``(P, Q)`` of the full (fused) matrix.
        shard: ``(row0, rows, col0, cols)`` of this rank's shard in it (``overlap_muon._layout.block``).
    """
    row0, rows, col0, cols = shard
    if parts is None:
        return ((0, rows, tuple(full_shape), tuple(shard)),)
    where = {}  # full row -> (its part's shape, its row index inside the part)
    for rows_k in parts:
        for pos, r in enumerate(rows_k):
            where[r] = ((len(rows_k), full_shape[1]), pos)
    runs: list[list] = []
    for local in range(rows):
        shape, pos = where[row0 + local]
        last = runs[-1] if runs else None
        if last is not None and last[1] == local and last[2] == shape and last[3] + (local - last[0]) == pos:
            last[1] = local + 1
        else:
            runs.append([local, local + 1, shape, pos])
    return tuple((a, b, s, (pos, b - a, col0, cols)) for a, b, s, pos in runs)

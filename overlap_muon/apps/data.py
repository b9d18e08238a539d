"""Byte-level text data for the training entry point: no download, identical bytes on every rank and every run.

Two sources:

- the default: the Python standard library's own ``.py`` source files on this machine (the running
  interpreter's ``sysconfig`` ``stdlib`` directory; test suites and third-party ``site-packages`` excluded),
  read in sorted relative-path order; a file goes to the validation split when ``crc32(relative path) % 10 == 0``
  (about a tenth of the files, fixed by the path alone, so the split does not move when other files
  appear or vanish);
- ``--data FILE``: any UTF-8 text file; its last tenth (at least one window) is the validation split.

Tokens are bytes (vocabulary 256), so a loss in nats divides by ``ln 2`` to give bits per byte.

[Note: stateless batches] The training batch of step ``s`` is a pure function of ``(seed, s)``: a fresh
``torch.Generator`` seeded from both picks the window offsets. Resuming at step ``s`` therefore needs no data
iterator state, only ``s`` (saved in the checkpoint), and every rank can compute the global batch and slice
its own rows without communication.
"""

from __future__ import annotations

import math
import os
import sysconfig
import zlib
from dataclasses import dataclass

import torch

__all__ = ["ByteData", "DataError", "load_stdlib", "load_file", "unigram_entropy_bits"]

#: Directory names skipped when collecting standard-library sources: test suites (large, repetitive,
#: full of deliberately odd code), third-party packages (differ between machines) and caches.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})

#: Fraction of a single ``--data`` file held out for validation (its tail).
_VAL_FRACTION = 0.1


class DataError(ValueError):
    """The text source is unusable (missing, empty, not UTF-8, shorter than a window). The message says what
    to change."""


@dataclass(frozen=True)
class ByteData:
    """A train/validation split of a byte stream.

    Attributes:
        train: ``(N_train,)`` ``torch.uint8`` bytes.
        val: ``(N_val,)`` ``torch.uint8`` bytes.
        source: a short human description (directory or file and the file count).
    """

    train: torch.Tensor
    val: torch.Tensor
    source: str

    def check_window(self, seq_len: int) -> None:
        """Raise :class:`DataError` unless both splits hold at least one ``seq_len + 1`` byte window."""
        need = seq_len + 1
        for name, split in (("train", self.train), ("validation", self.val)):
            if split.numel() < need:
                raise DataError(
                    f"the {name} split of {self.source} has {split.numel()} bytes, fewer than --seq-len + 1 = "
                    f"{need}; use a larger --data file or a smaller --seq-len"
                )

    def train_batch(self, step: int, seed: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global training batch of ``step`` (see [Note: stateless batches]).

        Returns:
            ``(inputs, targets)``, both ``(batch, seq_len)`` ``torch.int64``; ``targets`` is ``inputs``
            shifted by one byte.
        """
        gen = torch.Generator().manual_seed(_mix(seed, step))
        starts = torch.randint(0, self.train.numel() - seq_len, (batch,), generator=gen)
        return _windows(self.train, starts, seq_len)

    def val_batches(self, n_windows: int, batch: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed validation set: ``n_windows`` windows at evenly spaced offsets over the validation split,
        in batches of at most ``batch`` rows (each ``(b, seq_len)`` ``int64`` inputs and targets).

        With ``n_windows * (seq_len + 1)`` beyond the split the windows overlap; every run and rank sees the
        same ones either way.
        """
        last = self.val.numel() - seq_len - 1
        n = max(1, n_windows)
        starts = torch.tensor([round(i * last / max(1, n - 1)) for i in range(n)], dtype=torch.int64)
        return [_windows(self.val, starts[i : i + batch], seq_len) for i in range(0, n, batch)]

    def unigram_entropy_bits(self) -> float:
        """Entropy of the validation split's byte histogram, bits per byte (the best loss of a model that
        ignores context)."""
        return unigram_entropy_bits(self.val)


def _mix(seed: int, step: int) -> int:
    """A 63-bit generator seed from ``(seed, step)`` (splitmix64 finaliser), so nearby steps are unrelated."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    w = data[idx].long()
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def unigram_entropy_bits(data: torch.Tensor) -> float:
    """Entropy ``-sum p log2 p`` of the byte histogram of ``data`` (``uint8``), bits per byte, in float64."""
    counts = torch.bincount(data.long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


def _stdlib_files(root: str) -> list[str]:
    """Relative posix paths of the ``.py`` files under ``root``, skipping :data:`_SKIP_DIRS`, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for f in filenames:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"))
    return sorted(out)


def load_stdlib(root: str | None = None) -> ByteData:
    """The standard library sources under ``root`` (default: this interpreter's ``sysconfig`` ``stdlib``).

    Files that cannot be read are skipped (the rest of the list, and so the split, is unchanged). Files in
    each split are concatenated in sorted order.

    Raises:
        DataError: no source files found.
    """
    root = root or sysconfig.get_paths()["stdlib"]
    train, val, n = bytearray(), bytearray(), 0
    for rel in _stdlib_files(root):
        try:
            with open(os.path.join(root, rel), "rb") as f:
                blob = f.read()
        except OSError:
            continue
        n += 1
        (val if zlib.crc32(rel.encode()) % 10 == 0 else train).extend(blob)
    if not train or not val:
        raise DataError(f"found no Python sources under {root!r}; pass --data FILE with a UTF-8 text file")
    return ByteData(_as_tensor(train), _as_tensor(val), f"the Python standard library at {root} ({n} files)")


def load_file(path: str) -> ByteData:
    """A single UTF-8 text file; the last tenth of its bytes is the validation split.

    Raises:
        DataError: the file is missing, unreadable, empty or not UTF-8.
    """
    if not os.path.isfile(path):
        raise DataError(f"--data {path!r}: no such file; pass an existing UTF-8 text file")
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise DataError(f"--data {path!r}: cannot read it ({e.strerror}); pass a readable UTF-8 text file") from e
    if not blob:
        raise DataError(f"--data {path!r} is empty; pass a non-empty UTF-8 text file")
    try:
        blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"--data {path!r} is not UTF-8 text (bad byte at offset {e.start}); pass a UTF-8 text file"
        ) from e
    cut = len(blob) - max(1, math.floor(len(blob) * _VAL_FRACTION))
    return ByteData(_as_tensor(blob[:cut]), _as_tensor(blob[cut:]), f"{path} ({len(blob)} bytes)")


def _as_tensor(blob: bytes | bytearray) -> torch.Tensor:
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)

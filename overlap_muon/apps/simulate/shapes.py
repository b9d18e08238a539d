"""The simulator's model presets and the byte and time constants of its model."""

from __future__ import annotations

from dataclasses import dataclass



#: bf16: the update is cast before routing (docs/design.md §1).
_WIRE_BYTES = 2
#: Pack, per element of the local shard: fp32 grad read (4) + fp32 momentum read and write (8) + bf16 update
#: write (2) + bf16 copy into the send buffer (2).
_PACK_BYTES = 16
#: Apply, per element of the local shard: bf16 receive-buffer copy (2) + bf16 update read (2) + fp32 param
#: read and write (8).
_APPLY_BYTES = 12
#: [Note: content fingerprints] (overlap_muon/_wave_state.py): ``step()`` reads every gradient and momentum shard a
#: wave read again (8 B/element, fp32), in three passes of the words (read, product write, product read).
_CONTENT_BYTES = 24
#: The content check's one host read per step on CUDA: the host waits for the queued work (a sync), seconds.
_CONTENT_SYNC_S = 50e-6
#: A lane item is finished when less than this much of it (seconds) is left: absorbs float round-off.
_EPS = 1e-12
#: How a fused exchange crosses nodes ([Note: node-aware exchange in the model]).
NODE_EXCHANGES = ("fused", "node_aware")


# ----------------------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """Published dimensions of a dense decoder-only transformer (grouped-query attention, gated MLP)."""

    name: str
    """Preset name."""
    num_layers: int
    """Transformer blocks."""
    d_model: int
    """Hidden size d."""
    ffn_hidden: int
    """Gated-MLP inner size F."""
    num_heads: int
    """Query heads H."""
    num_kv_heads: int
    """Key/value heads KV (grouped-query attention)."""
    head_dim: int
    """Head dim hd."""
    vocab_size: int
    """Vocabulary (embedding and output head; AdamW, only their FLOPs are counted)."""
    source: str = ""
    """Where the dimensions come from."""

    def layer_matrices(self) -> tuple[tuple[str, tuple[int, int]], ...]:
        """The Muon matrices of one layer, registration order, full logical ``(out, in)`` shapes."""
        d, f, q, kv = self.d_model, self.ffn_hidden, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (
            ("wq", (q, d)),
            ("wk", (kv, d)),
            ("wv", (kv, d)),
            ("wo", (d, q)),
            ("w_gate", (f, d)),
            ("w_up", (f, d)),
            ("w_down", (d, f)),
        )

    def layer_forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of one layer: ``2 * matmul params + 2 * seq_len * H * hd`` (causal attention)."""
        params = sum(p * q for _, (p, q) in self.layer_matrices())
        return 2.0 * params + 2.0 * seq_len * self.num_heads * self.head_dim

    def head_forward_flops_per_token(self) -> float:
        """Forward FLOPs per token of the output head, ``2 * d * vocab``."""
        return 2.0 * self.d_model * self.vocab_size


_LLAMA3 = "Llama 3 published dimensions ('The Llama 3 Herd of Models', Meta, 2024, Table 3)"

#: Built-in model presets, by name.
MODEL_PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape(name="llama3-8b", num_layers=32, d_model=4096, ffn_hidden=14336, num_heads=32,
                   num_kv_heads=8, head_dim=128, vocab_size=128256, source=_LLAMA3),
        ModelShape(name="llama3-70b", num_layers=80, d_model=8192, ffn_hidden=28672, num_heads=64,
                   num_kv_heads=8, head_dim=128, vocab_size=128256, source=_LLAMA3),
        ModelShape(name="llama3-405b", num_layers=126, d_model=16384, ffn_hidden=53248, num_heads=128,
                   num_kv_heads=8, head_dim=128, vocab_size=128256, source=_LLAMA3),
    )
}

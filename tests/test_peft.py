"""PEFT LoRA (peft 0.21) under ``OverlapMuon``: the adapters' matrices train with Muon, the frozen base weights (Muon
matrices too, as in ``torch.optim``: they get no gradient, so no state and no update) stay as they were, bitwise
``torch.optim.Muon`` + ``torch.optim.AdamW`` on the same split."""

from __future__ import annotations

import copy

import pytest
import torch

from overlap_muon import OverlapMuon
from tests.models import ADAMW_KW, HP, MuonAdamW

pytest.importorskip("peft", reason="the test wraps a model with PEFT's own LoRA")
pytest.importorskip("transformers", reason="a Hugging Face model is what PEFT wraps")


def test_lora_adapters_bitwise():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ref = copy.deepcopy(model)
    opt = OverlapMuon(model, **HP, adamw_kwargs=ADAMW_KW)
    names = set(opt.muon_param_names)
    assert sum("lora_" in n for n in names) == 8, sorted(names)  # A and B of q and v in 2 layers
    named = dict(ref.named_parameters())
    ref_opt = MuonAdamW([p for n, p in named.items() if n in names],
                        [p for n, p in named.items() if n not in names])
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 16), generator=gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    assert not any(p in opt.state for p in model.parameters() if not p.requires_grad)
    opt.close()

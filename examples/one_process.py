"""One process: OverlapMuon against torch.optim.Muon + torch.optim.AdamW on the same model and batches.

    python examples/one_process.py

Prints "bitwise equal" when every parameter matches bit for bit after 5 steps (exit status 1 otherwise).
"""

import copy
from collections import OrderedDict

import torch
from torch import nn

from overlap_muon import OverlapMuon
torch.manual_seed(0)
model = nn.Sequential(OrderedDict(up=nn.Linear(64, 256), act=nn.GELU(), down=nn.Linear(256, 64),
                                  norm=nn.LayerNorm(64), head=nn.Linear(64, 10)))  # "head": the output head, to AdamW
reference = copy.deepcopy(model)

# OverlapMuon: Muon for the hidden nn.Linear weights, AdamW for the rest (biases, norms, and the output head).
opt = OverlapMuon(model, lr=0.02, weight_decay=0.1, adamw_kwargs=dict(lr=3e-3, weight_decay=0.1))

# The same split by hand, with torch's own optimizers.
muon_names = set(opt.muon_param_names)
named = dict(reference.named_parameters())
ref_opts = [torch.optim.Muon([p for n, p in named.items() if n in muon_names], lr=0.02, weight_decay=0.1),
            torch.optim.AdamW([p for n, p in named.items() if n not in muon_names], lr=3e-3, weight_decay=0.1)]



def train(model, optimizers, batches):
    for x, y in batches:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()  # OverlapMuon: gradient hooks launch the Newton-Schulz work during backward
        for opt in optimizers:
            opt.step()  # OverlapMuon: launches what is left, runs AdamW, returns with the updates landed
            opt.zero_grad()
    return loss.item()


batches = [(torch.randn(32, 64), torch.randint(0, 10, (32,))) for _ in range(5)]
print(f"loss after 5 steps: {train(model, [opt], batches):.4f} (OverlapMuon), "
      f"{train(reference, ref_opts, batches):.4f} (torch.optim.Muon + AdamW)")
assert opt.muon_param_names == ["up.weight", "down.weight"]
equal = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
print("bitwise equal" if equal else "DIFFERENT")
opt.close()
raise SystemExit(0 if equal else 1)

"""Hugging Face Trainer: OverlapMuon against torch.optim.Muon + torch.optim.AdamW, each driven by its own Trainer.

    python examples/hf_trainer.py                                           # one process
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py         # Trainer's DDP on 2 ranks
    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --factory   # Trainer builds the optimizer

A tiny Llama built from its config trains for 4 steps on random tokens, twice with the same TrainingArguments (the
same seed, so the same batches). Prints "bitwise equal" when every weight matches bit for bit (exit status 1
otherwise). Needs transformers and accelerate (the project's test extra installs them).
"""

import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from overlap_muon import OverlapMuon
from overlap_muon.hf import OverlapMuonCallback, OverlapMuonFactory

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
gen = torch.Generator().manual_seed(1)
ds = [{"input_ids": torch.randint(0, 64, (16,), generator=gen), "labels": torch.randint(0, 64, (16,), generator=gen)}
      for _ in range(32)]
args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=4, per_device_train_batch_size=2, use_cpu=True,
                         max_grad_norm=0,  # Trainer's default clip (1.0) would re-run the waves of steps it bites
                         ddp_find_unused_parameters=False,  # every param gets a gradient (and DDP stays quiet)
                         report_to=[], save_strategy="no", disable_tqdm=True, seed=0)

torch.manual_seed(0)
model = LlamaForCausalLM(config)       # Llama, GPT-2 (Conv1D), ...; tied embeddings are fine
kwargs = dict(lr=0.02, adamw_kwargs=dict(lr=3e-4, weight_decay=0.1))  # OverlapMuon's keyword arguments
if "--factory" in sys.argv:            # Trainer's factory protocol: it builds OverlapMuon(model, **kwargs) in train()
    route = dict(optimizer_cls_and_kwargs=(OverlapMuonFactory, kwargs))
else:                                  # or build it yourself
    route = dict(optimizers=(OverlapMuon(model, **kwargs), None))
trainer = Trainer(model=model, args=args, train_dataset=ds, **route)  # its lr schedule drives every group
trainer.add_callback(OverlapMuonCallback(trainer))      # under Trainer's DDP: waves read DDP's averaged gradients
trainer.train()
opt = trainer.optimizer.optimizer      # Accelerate wraps the optimizer: this is the OverlapMuon


class MuonAdamW(torch.optim.Optimizer):
    """The same split by hand, with torch's own optimizers, as the one optimizer Trainer takes."""

    def __init__(self, muon, adamw):
        self.inner = (torch.optim.Muon(muon, lr=0.02), torch.optim.AdamW(adamw, lr=3e-4, weight_decay=0.1))
        super().__init__(muon + adamw, {})
        self.param_groups = [g for o in self.inner for g in o.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        for o in self.inner:
            o.step()

    def state_dict(self):  # Accelerate reloads the state when it wraps the optimizer: keep the groups shared
        return {"inner": [o.state_dict() for o in self.inner]}

    def load_state_dict(self, state_dict):
        for o, sd in zip(self.inner, state_dict["inner"]):
            o.load_state_dict(sd)
        self.param_groups = [g for o in self.inner for g in o.param_groups]


torch.manual_seed(0)
reference = LlamaForCausalLM(config)   # the same initial weights
muon_names = set(opt.muon_param_names)
named = dict(reference.named_parameters())
ref_opt = MuonAdamW([p for n, p in named.items() if n in muon_names],
                    [p for n, p in named.items() if n not in muon_names])
Trainer(model=reference, args=args, train_dataset=ds, optimizers=(ref_opt, None)).train()

opt.close()
equal = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
if trainer.args.process_index == 0:
    print(f"{len(muon_names)} matrices on Muon, {opt.stats['reruns']} waves re-run in step(): "
          + ("bitwise equal" if equal else "DIFFERENT"))
raise SystemExit(0 if equal else 1)

"""Overlap mode under ``torch.compile`` (issue 16): per-block compile with ``fullgraph=True`` (torchtitan's way, both
``block.compile()`` and ``torch.compile(block)``) and whole-model compile, at world 1 and 2 (FSDP2), bitwise against
overlap off with the same compiled model, and with no graph added ([Note: forward waits under torch.compile] in
``hooks/forward_wait.py``). NS is slowed down on purpose, so a forward that did not wait would read stale weights and
the comparison would fail."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.torch_version import TorchVersion

from tests.seams import SeamedOverlapMuon as OverlapMuon, TestingSeam
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP, local

D = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.a = nn.Linear(D, 2 * D)
        self.b = nn.Linear(2 * D, D, bias=False)
        self.graph_break = False

    def forward(self, x):
        h = torch.tanh(self.a(self.norm(x)))
        if self.graph_break:  # a user's own graph break inside the compiled block
            torch._dynamo.graph_break()
        return x + self.b(h)


class Net(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(n)])
        self.proj = nn.Linear(D, 5, bias=False)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.proj(x)


def _compile(model: Net, how: str, backend) -> nn.Module:
    """Compile as users do; returns what to call."""
    if how == "block_method":  # torchtitan: each block's Module.compile(fullgraph=True)
        for b in model.blocks:
            b.compile(backend=backend, fullgraph=True)
    elif how == "block_wrap":  # a torch.compile(block) wrapper put back into the model
        for i, b in enumerate(model.blocks):
            model.blocks[i] = torch.compile(b, backend=backend, fullgraph=True)
    elif how == "whole_wrap":
        return torch.compile(model, backend=backend, fullgraph=True)
    elif how == "whole_method":
        model.compile(backend=backend, fullgraph=True)
    elif how == "block_graph_break":  # no fullgraph: the user's own break splits each block in two graphs
        for b in model.blocks:
            b.graph_break = True
            b.compile(backend=backend)
    elif how == "function":
        return torch.compile(lambda x: model(x), backend=backend, fullgraph=True)
    return model


def _train(how: str, overlap: bool, steps: int = 4, fsdp_mesh=None, rank: int = 0, async_step: bool = True):
    """Params after ``steps`` steps, the number of graphs compiled, and the number of waits that ran.

    ``async_step`` (the mode with forward waits, which these tests are about) unless told otherwise."""
    torch._dynamo.reset()
    graphs = []
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch.manual_seed(0)
    model = Net()
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    call = _compile(model, how, backend) if how != "none" else model
    seam = TestingSeam(ns_delay_s=0.02 if overlap else 0.0, timeline=[])
    opt = OverlapMuon(model, overlap=overlap, adamw_kwargs=ADAMW_KW, wave_slots=1, _testing=seam,
                      device_mesh=fsdp_mesh, async_step=async_step, **HP)
    with warnings.catch_warnings():
        # The fallback for weights read outside their module's forward (a wait at the root) must not be needed: the
        # compiled modules' waits cover their subtrees.
        warnings.filterwarnings("error", message=".*no forward of the module owning them ran")
        for s in range(steps):
            x = torch.randn(4, D, generator=torch.Generator().manual_seed(10 * s + rank))
            call(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    opt.synchronize()
    params = [local(p).detach().clone() for p in model.parameters()]
    waits = sum(1 for e, _, _ in seam.timeline if e == "wait_begin")
    opt.close()
    return params, len(graphs), waits


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["block_method", pytest.param("block_wrap", marks=pytest.mark.slow),
                                 pytest.param("whole_wrap", marks=pytest.mark.slow),
                                 pytest.param("whole_method", marks=pytest.mark.slow), "block_graph_break"])
def test_compiled_overlap_equals_overlap_off_world1(how):
    """Bug: with blocks compiled ``fullgraph=True`` step 2's forward raised ``torch._dynamo.exc.Unsupported`` (the
    forward wait's ``Condition``); without ``fullgraph`` the waits added graph breaks inside the blocks and the
    results differed from overlap off. Now: the same graphs as overlap off, waits at the compiled modules (eagerly),
    and the same params bit for bit."""
    on, graphs_on, waits_on = _train(how, True)
    off, graphs_off, _ = _train(how, False)
    assert graphs_on == graphs_off >= 1
    assert waits_on > 0  # the waits ran, at the compiled boundaries
    bad = [i for i, (a, b) in enumerate(zip(on, off)) if not torch.equal(a, b)]
    assert not bad, bad
    plain, _, _ = _train("none", False)
    assert all(torch.equal(a, b) for a, b in zip(off, plain))  # aot_eager computes what eager does here


@pytest.mark.timeout(120)
def test_compiled_from_outside_is_a_clear_error():
    """``async_step``: ``torch.compile`` of a function that calls the model inlines every forward wait and runs none
    eagerly: a clear error at the first forward, naming the supported ways, instead of reading stale weights. The
    default step has no forward waits: the same compile works, bitwise equal to overlap off."""
    with pytest.raises(Exception, match="compiled from outside"):
        _train("function", True, steps=1)
    on, _, _ = _train("function", True, steps=2, async_step=False)
    off, _, _ = _train("function", False, steps=2)  # overlap off: nothing to wait for, fine
    assert all(torch.equal(a, b) for a, b in zip(on, off))


def _fsdp_body(rank, world, how):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    on, g_on, waits = _train(how, True, fsdp_mesh=mesh, rank=rank)
    off, g_off, _ = _train(how, False, fsdp_mesh=mesh, rank=rank)
    return [i for i, (a, b) in enumerate(zip(on, off)) if not torch.equal(a, b)], g_on, g_off, waits


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["block_method", pytest.param("block_wrap", marks=pytest.mark.slow)])
def test_compiled_blocks_fsdp2_world2(how):
    """FSDP2 over 2 ranks with each block compiled ``fullgraph=True``: FSDP2's own hooks and our waits both run
    eagerly at the block (ours first); bitwise equal to overlap off."""
    for bad, g_on, g_off, waits in run_ranks(_fsdp_body, 2, how, timeout=270):
        assert not bad, bad
        assert g_on == g_off >= 1 and waits > 0


@pytest.mark.timeout(120)
def test_compiled_torch_nn_container_names_the_fix():
    """Found by a new-user test: ``torch.compile(nn.Sequential(...))`` compiles the container's whole ``__call__``
    (torch does so for torch.nn classes), hooks included, so no wait runs eagerly: the error says so and names the
    fixes. ``model.compile()`` works on torch 2.13 (bitwise equal to overlap off); torch 2.14 traces a torch.nn
    class's hooks under ``module.compile()`` too, and the same error then names that."""
    def run(how: str, overlap: bool, async_step: bool = True) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(D, D, bias=False), nn.Tanh(), nn.Linear(D, D, bias=False))
        opt = OverlapMuon(model, overlap=overlap, adamw_kwargs=ADAMW_KW, async_step=async_step, **HP)
        call = torch.compile(model, backend="aot_eager") if how == "wrap" else model
        if how == "method":
            model.compile(backend="aot_eager")
        elif how == "children":
            for m in model:
                m.compile(backend="aot_eager")
        for s in range(3):
            call(torch.randn(4, D, generator=torch.Generator().manual_seed(s))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        opt.close()
        return [p.detach().clone() for p in model.parameters()]

    with pytest.raises(Exception, match=r"torch.nn Sequential.*block.compile\(\).*model.compile\(\) on torch 2.13"):
        run("wrap", True)
    off = run("none", False)
    if TorchVersion(torch.__version__) >= "2.14":  # upstream: torch 2.14's module.compile() traces torch.nn hooks
        for how in ("method", "children"):
            with pytest.raises(Exception, match=r"since torch 2.14 so does module.compile\(\)"):
                run(how, True)
    else:
        assert all(torch.equal(a, b) for a, b in zip(run("method", True), off))
    assert all(torch.equal(a, b) for a, b in zip(run("wrap", True, async_step=False), off))  # the default: no waits

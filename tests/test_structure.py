"""The house's boundaries, checked on the source (``ast``, nothing imported):

* the library (``overlap_muon`` but ``overlap_muon.apps``, with ``hooks/`` and ``scheduler/`` installed as
  ``overlap_muon._hooks`` and ``overlap_muon._scheduler``) never imports the apps;
* the math and layout modules never import the planner, and the planner never imports torch;
* only the communication context (``overlap_muon/_comm.py``) creates process groups, and only the lanes
  (``overlap_muon/_lanes.py``) create streams, events or threads;
* nothing imports the old top-level names ``hooks`` and ``scheduler``;
* the sizes: a library file at most :data:`FILE_LINES` lines, the ``OverlapMuon`` class :data:`OPTIMIZER_LINES`,
  ``Runtime`` :data:`RUNTIME_LINES`, any other class :data:`CLASS_LINES` (the apps' files and classes too), a
  function or method :data:`FUNCTION_LINES` lines of code (its docstring, blank and comment lines not counted), a
  pipeline task (``WavePipeline._*_task``) :data:`TASK_LINES`; the few exceptions are named in :data:`LONG`.

Each rule is shown to catch a planted violation.
"""

from __future__ import annotations

import ast
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: repository folder -> the import package it installs as
PACKAGES = {"overlap_muon": "overlap_muon", "hooks": "overlap_muon._hooks", "scheduler": "overlap_muon._scheduler"}
MATH_AND_LAYOUT = {"overlap_muon._ns", "overlap_muon._muon_math", "overlap_muon._team_ns", "overlap_muon.split",
                   "overlap_muon._domain", "overlap_muon._layout", "overlap_muon.layer_sharded_a2a"}
GROUP_MAKERS = {"new_group", "new_subgroups", "init_device_mesh", "split_group"}
LANE_MAKERS = {"Stream", "Event", "Thread", "ThreadPoolExecutor"}


FILE_LINES, OPTIMIZER_LINES, FUNCTION_LINES, TASK_LINES = 450, 350, 40, 25
#: Every class at most :data:`CLASS_LINES` lines; the runtime (hooks in, waves out, the step's order) at most
#: :data:`RUNTIME_LINES`.
CLASS_LINES, RUNTIME_LINES = 350, 250
#: ``file:function`` -> why it may pass :data:`FUNCTION_LINES` (the list only shrinks).
LONG = {
    "overlap_muon/_comm.py:domain_from_layouts": "every rank creates every group of the domain in one fixed order; "
                                                "the order is the function",
    "overlap_muon/layer_sharded_a2a/_domain_exchange.py:to_homes": "one exchange's collectives, which every rank "
                                                                  "issues in the same order, read in that order",
    "overlap_muon/layer_sharded_a2a/_domain_exchange.py:from_homes": "the same, for the way back",
    "scheduler/waves.py:plan_waves_by_cost": "the cost-cut planner, one algorithm read top to bottom ([Note: "
                                             "planning waves by cost])",
    "scheduler/surplus.py:_greedy": "the surplus planner's greedy pass, one algorithm read top to bottom",
    "scheduler/surplus.py:plan_surplus": "the surplus plan's entry: options, then the pass, then the checks",
}


def _code_lines(lines: list[str], node: ast.AST) -> int:
    """Lines of code of a function: its body without the docstring, blank and comment lines."""
    body = list(node.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    seen = {n for stmt in body for n in range(stmt.lineno, stmt.end_lineno + 1)}
    return sum(1 for n in seen if lines[n - 1].strip() and not lines[n - 1].strip().startswith("#"))


def size_violations(root: Path) -> list[str]:
    """Every size limit the library under ``root`` passes, one line each."""
    bad = []
    for name, path in _modules(root).items():
        text = path.read_text()
        lines, where = text.splitlines(), os.path.relpath(path, root)
        if len(lines) > FILE_LINES:
            bad.append(f"{where}: {len(lines)} lines (limit {FILE_LINES}: make a new file)")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                limit = {"OverlapMuon": OPTIMIZER_LINES, "Runtime": RUNTIME_LINES}.get(node.name, CLASS_LINES)
                if n > limit:
                    bad.append(f"{where}: {node.name} has {n} lines (limit {limit}: make a component)")
            if isinstance(node, ast.ClassDef) and node.name == "WavePipeline":
                for f in node.body:
                    if isinstance(f, ast.FunctionDef) and f.name.endswith("_task") and (
                            n := _code_lines(lines, f)) > TASK_LINES:
                        bad.append(f"{where}: pipeline task {f.name} has {n} lines of code (limit {TASK_LINES})")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(lines, node)
                if n > FUNCTION_LINES and f"{where}:{node.name}" not in LONG:
                    bad.append(f"{where}:{node.lineno}: {node.name} has {n} lines of code (limit {FUNCTION_LINES}: "
                               "make a component, or name it in LONG with its reason)")
    return bad


def _modules(root: Path) -> dict[str, Path]:
    """Import name -> file, for every library module, subpackages included (the apps excluded)."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [package, *path.relative_to(root / folder).with_suffix("").parts]
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if not (name + ".").startswith("overlap_muon.apps."):
                out[name] = path
    return out


def _math_or_layout(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in MATH_AND_LAYOUT)


def _imports(name: str, path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in the module ``name`` (relative imports resolved)."""
    package = name if path.stem == "__init__" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out += [(node.lineno, mod)] + [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def _calls(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, called name)`` of every call: ``f(...)`` -> ``f``, ``x.y.f(...)`` -> ``f``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name:
                out.append((node.lineno, name))
    return out


def violations(root: Path) -> list[str]:
    """Every boundary the tree under ``root`` crosses, one line each."""
    bad = []
    for name, path in _modules(root).items():
        tree = ast.parse(path.read_text(), str(path))
        where = os.path.relpath(path, root)
        for line, mod in _imports(name, path, tree):
            if mod == "overlap_muon.apps" or mod.startswith("overlap_muon.apps."):
                bad.append(f"{where}:{line}: the library imports the apps ({mod})")
            if _math_or_layout(name) and mod.startswith("overlap_muon._scheduler"):
                bad.append(f"{where}:{line}: a math/layout module imports the planner ({mod})")
            if name.startswith("overlap_muon._scheduler") and (mod == "torch" or mod.startswith("torch.")):
                bad.append(f"{where}:{line}: the planner imports torch ({mod})")
        for line, call in _calls(tree):
            if call in GROUP_MAKERS and name != "overlap_muon._comm":
                bad.append(f"{where}:{line}: creates a process group ({call}) outside overlap_muon/_comm.py")
            if call in LANE_MAKERS and name != "overlap_muon._lanes":
                bad.append(f"{where}:{line}: creates a stream/event/thread ({call}) outside overlap_muon/_lanes.py")
    for path in sorted(p for folder in (*PACKAGES, "tests") for p in (root / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            for n in names:
                if n.split(".")[0] in ("hooks", "scheduler"):
                    bad.append(f"{os.path.relpath(path, root)}:{node.lineno}: imports the top-level name {n!r}; "
                               f"use overlap_muon.{n}")
    return bad


def test_the_tree_keeps_its_boundaries():
    assert not violations(ROOT), "\n".join(violations(ROOT))


def test_planted_violations_are_caught(tmp_path):
    for folder in PACKAGES:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    plants = {
        "overlap_muon/_ns.py": "from ._scheduler.cost import ns_flops\n",
        "overlap_muon/layer_sharded_a2a/_route.py": "from .._scheduler import plan_waves\n",
        "overlap_muon/_pipeline.py": "from .apps import bench\n",
        "overlap_muon/optimizer.py": "import torch.distributed as _d\n_g = _d.new_group([0])\n",
        "overlap_muon/config.py": "import threading\n_t = threading.Thread(target=print)\n",
        "scheduler/waves.py": "import torch\n",
        "hooks/ownership.py": "from scheduler import plan_waves\n",
    }
    for rel, text in plants.items():
        with open(tmp_path / rel, "a") as f:
            f.write(text)
    found = "\n".join(violations(tmp_path))
    for rel, what in (("overlap_muon/_ns.py", "imports the planner"), ("overlap_muon/_pipeline.py", "imports the apps"),
                      ("overlap_muon/layer_sharded_a2a/_route.py", "imports the planner"),
                      ("overlap_muon/optimizer.py", "creates a process group"),
                      ("overlap_muon/config.py", "stream/event/thread"), ("scheduler/waves.py", "imports torch"),
                      ("hooks/ownership.py", "top-level name 'scheduler'")):
        assert any(rel in line and what in line for line in found.splitlines()), (rel, what, found)


def app_size_violations(root: Path) -> list[str]:
    """The apps (``overlap_muon/apps/``) under the library's file and class limits, one line each."""
    bad = []
    for path in sorted((root / "overlap_muon" / "apps").rglob("*.py")):
        text, where = path.read_text(), os.path.relpath(path, root)
        if (n := len(text.splitlines())) > FILE_LINES:
            bad.append(f"{where}: {n} lines (limit {FILE_LINES}: make a new file)")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > CLASS_LINES:
                bad.append(f"{where}: {node.name} has {n} lines (limit {CLASS_LINES})")
    return bad


def test_the_library_keeps_its_sizes():
    assert not size_violations(ROOT), "\n".join(size_violations(ROOT))
    assert not app_size_violations(ROOT), "\n".join(app_size_violations(ROOT))


def test_planted_size_violations_are_caught(tmp_path):
    for folder in PACKAGES:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    long_body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES + 1))
    with open(tmp_path / "overlap_muon/config.py", "a") as f:  # a long function
        f.write(f"\n\ndef _planted():\n    \"\"\"Docstring lines do not count.\"\"\"\n{long_body}")
    with open(tmp_path / "overlap_muon/_messages.py", "a") as f:  # a long file
        f.write("\n" * FILE_LINES)
    for rel, cls, body, n in (
            ("overlap_muon/optimizer.py", "class OverlapMuon(", "    def _planted(self):\n", OPTIMIZER_LINES),
            ("overlap_muon/_pipeline.py", "class WavePipeline:", "    def _planted_task(self):\n", TASK_LINES),
            ("overlap_muon/_runtime.py", "class Runtime:", "    x = 0\n", RUNTIME_LINES),
            ("overlap_muon/_lanes.py", "class Lanes:", "    x = 0\n", CLASS_LINES)):
        text = (tmp_path / rel).read_text()  # a long class, a long pipeline task: inside the class
        at = text.index("\n", text.index(cls)) + 1
        pad = "        " if body.startswith("    def") else "    "
        extra = body + "".join(f"{pad}x{i} = {i}\n" for i in range(n + 1))
        (tmp_path / rel).write_text(text[:at] + extra + text[at:])
    with open(tmp_path / "overlap_muon/apps/data.py", "a") as f:  # a long app file
        f.write("\n" * FILE_LINES)
    found = "\n".join(size_violations(tmp_path) + app_size_violations(tmp_path))
    for what in ("config.py", "_planted has", "_messages.py:", "OverlapMuon has", "pipeline task _planted_task",
                 "Runtime has", "Lanes has", "apps/data.py:"):
        assert what in found, (what, found)


#: The library's public modules ([Note: what is public] in docs/design.md): the face, the framework
#: adapters, the options, the modules of the face's classes and the routing API's package face. Every other module
#: of the library (the apps aside: their command lines are their face) is named as internal.
PUBLIC = {"overlap_muon/__init__.py", "overlap_muon/config.py", "overlap_muon/optimizer.py", "overlap_muon/qk_clip.py",
          "overlap_muon/split.py", "overlap_muon/hf.py", "overlap_muon/torchtitan.py", "overlap_muon/lightning.py",
          "overlap_muon/layer_sharded_a2a/__init__.py"}


def public_violations(root: Path) -> list[str]:
    """A library module that is neither in :data:`PUBLIC` nor named as internal (a part of its import name after
    ``overlap_muon`` starting with ``_``), and a public module the module map of docs/design.md does not name."""
    bad = []
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = os.path.relpath(path, root)
            if rel.startswith("overlap_muon/apps/") or rel in PUBLIC:
                continue
            parts = package.split(".")[1:] + os.path.relpath(path, root / folder).split(os.sep)
            if not any(p.startswith("_") and p != "__init__.py" for p in parts):
                bad.append(f"{rel}: not in the public list, and its import name has no part starting with '_'")
    design = (root / "docs" / "design.md").read_text() if (root / "docs" / "design.md").exists() else ""
    bad += [f"{rel}: public, but docs/design.md's module map does not name it" for rel in sorted(PUBLIC)
            if (root / rel).exists() and f"`{rel}`" not in design]
    return bad


def test_internal_modules_are_named_as_internal():
    assert not public_violations(ROOT), "\n".join(public_violations(ROOT))


def test_planted_public_violations_are_caught(tmp_path):
    for folder in (*PACKAGES, "docs"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "apps"))
    (tmp_path / "overlap_muon/helpers.py").write_text("x = 1\n")
    (tmp_path / "scheduler/more.py").write_text("x = 1\n")  # internal by its package's name
    design = tmp_path / "docs/design.md"
    design.write_text(design.read_text().replace("`overlap_muon/lightning.py`", "the Lightning adapter"))
    found = "\n".join(public_violations(tmp_path))
    assert "overlap_muon/helpers.py: not in the public list" in found, found
    assert "overlap_muon/lightning.py: public, but" in found, found
    assert "scheduler/more.py" not in found, found

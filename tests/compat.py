"""The suite on fresh environments of chosen releases, and the refresh of the test lock.

    python -m tests.compat                          # one row: the newest releases the registry installs
    python -m tests.compat --table                  # the rows of docs/results.md ("Compatibility")
    python -m tests.compat --row lock --row "torch==2.14.1 transformers==5.24.0"
    python -m tests.compat refresh                  # the newest releases; the lock is rewritten only if they pass

A row is ``lock`` (``requirements/test-lock.txt``, the releases the suite passed with), ``newest`` (no pin),
``floor`` (the lowest torch ``pyproject.toml`` claims, its newest patch) or pip requirements separated by spaces
(the rest resolve to their newest compatible releases). Each row gets a new virtual environment under
``.venv-compat/`` (removed after the row unless ``--keep``), the project with its ``apps`` and ``test`` extras,
then the README's test command. A table of versions and results is printed and written to
``traces/compat.json``. Arguments after ``--`` go to pytest (e.g. ``-- tests/test_experts.py -x``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCK = os.path.join("requirements", "test-lock.txt")
PACKAGES = ("torch", "transformers", "accelerate", "peft", "lightning", "torchtitan")
TABLE = ("lock", "torch==2.13.0 transformers==5.25.0", "torch==2.14.1 transformers==5.24.0",
         "torch==2.14.1 transformers==5.25.0", "floor")
SUITE_TIMEOUT_S = 3600


def floor_pin() -> str:
    """``torch==X.Y.*`` for the ``torch>=X.Y`` that ``pyproject.toml`` claims."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        m = re.search(r'"torch\s*>=\s*([\d.]+)"', f.read())
    return f"torch=={m.group(1)}.*"


def pins(row: str) -> list[str]:
    """The pip arguments a row adds to the project's install."""
    if row == "lock":
        return ["-c", LOCK]
    if row == "newest":
        return []
    if row == "floor":
        return [floor_pin()]
    return row.split()


def _run(cmd: list[str], timeout: float, log) -> subprocess.CompletedProcess:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, text=True)


def run_row(row: str, pytest_args: list[str], keep: bool) -> dict:
    """A fresh environment for ``row``, the install, the suite. Returns the row's versions and result."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "_", row)
    venv = os.path.join(ROOT, ".venv-compat", slug)
    shutil.rmtree(venv, ignore_errors=True)
    os.makedirs(os.path.join(ROOT, "traces"), exist_ok=True)
    log_path = os.path.join(ROOT, "traces", f"compat_{slug}.log")
    py = os.path.join(venv, "bin", "python")
    out = {"row": row, "log": os.path.relpath(log_path, ROOT)}
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        _run([sys.executable, "-m", "venv", venv], 300, log)
        _run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], 600, log)
        inst = _run([py, "-m", "pip", "install", "-q", *pins(row), "-e", ".[apps,test]"], 1800, log)
        listed = subprocess.run([py, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True)
        have = {d["name"].lower(): d["version"] for d in json.loads(listed.stdout or "[]")}
        out["versions"] = {p: have.get(p, "-") for p in PACKAGES}
        out["freeze"] = subprocess.run([py, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True,
                                       text=True).stdout
        if inst.returncode != 0:
            out.update(result="install failed", failed=[], minutes=round((time.monotonic() - t0) / 60, 1))
            return out
        try:
            res = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args], SUITE_TIMEOUT_S, log)
            code = res.returncode
        except subprocess.TimeoutExpired:
            code = -1
    text = open(log_path).read()
    summary = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed)", ln) and " in " in ln]
    out["result"] = summary[-1].strip("= ") if summary else ("timed out" if code == -1 else f"exit {code}")
    out["failed"] = sorted(set(re.findall(r"^FAILED (\S+)", text, re.M)))
    out["ok"] = code == 0
    out["minutes"] = round((time.monotonic() - t0) / 60, 1)
    if not keep:
        shutil.rmtree(venv, ignore_errors=True)
    return out


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table: versions, result, minutes, failed tests."""
    head = "| row | " + " | ".join(PACKAGES) + " | result | min | failed |"
    lines = [head, "|" + "---|" * (len(PACKAGES) + 4)]
    for r in rows:
        v = r.get("versions", {})
        lines.append(f"| {r['row']} | " + " | ".join(v.get(p, "-") for p in PACKAGES) +
                     f" | {r['result']} | {r['minutes']} | {'<br>'.join(r['failed']) or '-'} |")
    return "\n".join(lines)


def write_lock(freeze: str, row: str) -> None:
    """``requirements/test-lock.txt`` from a passing environment's ``pip freeze``, local version labels dropped
    (``2.13.0+cpu`` -> ``2.13.0``, which the CPU and the default wheel both satisfy)."""
    body = sorted({re.sub(r"\+[A-Za-z0-9.]+$", "", ln.strip()) for ln in freeze.splitlines()
                   if "==" in ln and not ln.startswith("-e")}, key=str.lower)
    with open(os.path.join(ROOT, LOCK), "w") as f:
        f.write("# The test environment the suite passed with (python -m tests.compat refresh, row "
                f"{row!r}, Python {sys.version.split()[0]}).\n# Used as pip constraints: "
                "pip install -c requirements/test-lock.txt -e '.[apps,test]'\n")
        f.write("\n".join(body) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m tests.compat", description=__doc__.split("\n")[0])
    ap.add_argument("command", nargs="?", choices=["run", "refresh"], default="run")
    ap.add_argument("--row", action="append", default=[], help="a row (repeatable); default: newest")
    ap.add_argument("--table", action="store_true", help="the rows of docs/results.md: " + "; ".join(TABLE))
    ap.add_argument("--keep", action="store_true", help="keep each row's environment under .venv-compat/")
    args = ap.parse_args(argv)
    rows = list(TABLE) if args.table else (args.row or ["newest"])
    if args.command == "refresh":
        rows = ["newest"]
    results = []
    for row in rows:
        print(f"row {row!r}: installing and running the suite (log under traces/)", flush=True)
        results.append(run_row(row, pytest_args, args.keep))
        print(f"row {row!r}: {results[-1]['result']} ({results[-1]['minutes']} min)", flush=True)
    with open(os.path.join(ROOT, "traces", "compat.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "freeze"} for r in results], f, indent=1)
    print(table(results))
    if args.command == "refresh":
        if not results[0].get("ok") or pytest_args:
            print(f"{LOCK} unchanged: " + ("pytest arguments given (a partial run)" if pytest_args else
                                           "the suite did not pass on the newest releases"))
            return 1
        write_lock(results[0]["freeze"], rows[0])
        print(f"{LOCK} written")
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

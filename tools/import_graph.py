"""The package drawn from its imports: circles, floors, the largest folder's share of lines, and the files one
leaderboard run's table passes through on its way from ``runner.run_unit`` to the env.

usage: python tools/import_graph.py [ROOT]   (ROOT: a checkout, default this one; needs IAPO_GYM_DATA for
the traced run, which opens the MATH table)

Every import counts, also those inside functions. A module's floor is the length of the longest chain of imports
below it (floor 0 imports nothing else of the package; a circle's modules share one floor). The trace records,
for one run of ``run_unit`` on MATH with the ``uniform`` agent at one budget, the package files entered in call
order: how many distinct files, how many calls go up to a file on a higher floor (a circle's files share one
floor, so calls inside a circle are not counted), and how often the data returns to a file it had left.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` below the packages."""
    found = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = f
    return found


def edges_of(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in the file)."""
    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        base = m.split(".") if f.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    prefix = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix for a in node.names]
            for t in targets:
                r = resolve(t)
                if r and r != m:
                    edges[m].add(r)
    return edges


def components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan)."""
    sys.setrecursionlimit(10000)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def floors(edges: dict[str, set[str]], comps: list[list[str]]) -> dict[str, int]:
    """Module -> floor (longest import chain below it, circles collapsed)."""
    comp_of = {m: i for i, c in enumerate(comps) for m in c}
    memo: dict[int, int] = {}

    def floor(i: int) -> int:
        if i not in memo:
            below = {comp_of[w] for m in comps[i] for w in edges[m]} - {i}
            memo[i] = 1 + max((floor(j) for j in below), default=-1)
        return memo[i]

    return {m: floor(comp_of[m]) for m in comp_of}


def trace_table(root: Path, floor_of: dict[str, int], mods: dict[str, Path]) -> tuple[int, int, int, list[str]]:
    """Files entered by one run_unit (MATH, uniform, one budget), climbs up a floor, returns to a file left."""
    sys.path.insert(0, str(root))
    import importlib

    runner = importlib.import_module("iapo_gym.leaderboard.run.runner")  \
        if (root / "iapo_gym/leaderboard/run/runner.py").is_file() \
        else importlib.import_module("iapo_gym.leaderboard.runner")
    specs = importlib.import_module("iapo_gym.leaderboard.run.specs") \
        if (root / "iapo_gym/leaderboard/run/specs.py").is_file() \
        else importlib.import_module("iapo_gym.leaderboard.specs")
    by_file = {str(f.resolve()): m for m, f in mods.items() if m.startswith("iapo_gym")}
    unit = runner.plan_units([specs.resolve_task("math")], [specs.parse_agent_spec("uniform")], [50], 1, set())[0]
    sequence: list[str] = []  # package files in the order the data is in them (calls and returns)
    calls: list[tuple[str, str]] = []  # (caller, callee) of every call from one package file into another

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        here = by_file.get(frame.f_code.co_filename)
        back = by_file.get(frame.f_back.f_code.co_filename) if frame.f_back is not None else None
        if event == "call":
            if here is not None and back is not None and here != back:
                calls.append((back, here))
            m = here
        elif event == "return":
            m = back
        else:
            return
        if m is not None and (not sequence or sequence[-1] != m):
            sequence.append(m)

    sys.setprofile(profile)
    try:
        runner.run_unit(unit)
    finally:
        sys.setprofile(None)
    # from run_unit to the env: up to the first time the env module is entered
    env_module = "iapo_gym.env"
    cut = sequence.index(env_module) + 1 if env_module in sequence else len(sequence)
    path = sequence[:cut]
    cut_calls = next((i + 1 for i, (_, callee) in enumerate(calls) if callee == env_module), len(calls))
    climbs = sum(1 for caller, callee in calls[:cut_calls] if floor_of[callee] > floor_of[caller])
    seen: set[str] = set()
    returns = 0
    for m in path:
        if m in seen:
            returns += 1
        seen.add(m)
    return len(set(path)), climbs, returns, path


def main() -> None:
    """Print the figures for ROOT."""
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    mods = modules(root, ("iapo_gym", "agents"))
    edges = edges_of(mods)
    comps = components(edges)
    circles = [c for c in comps if len(c) > 1]
    floor_of = floors(edges, comps)
    for c in circles:
        print("circle:", ", ".join(c))
    print("circles:", len(circles))
    print("floors:", 1 + max(floor_of.values()))
    lines: dict[str, int] = defaultdict(int)
    for f in mods.values():
        lines[str(f.parent.relative_to(root))] += sum(1 for _ in f.open())
    total = sum(lines.values())
    folder, most = max(lines.items(), key=lambda kv: kv[1])
    print(f"lines (iapo_gym + agents): {total}; largest folder: {folder} {most} lines = {most / total:.1%}")
    n_files, climbs, returns, path = trace_table(root, floor_of, mods)
    print(f"one run's table, run_unit to the env: {n_files} files, {climbs} calls up a floor, "
          f"{returns} returns to a file it had left ({len(path)} steps)")
    print("  " + " -> ".join(f"{m.removeprefix('iapo_gym.')}({floor_of[m]})" for m in path))


if __name__ == "__main__":
    main()

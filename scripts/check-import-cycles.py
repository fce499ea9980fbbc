#!/usr/bin/env python3
"""Finds import circles between the top-level modules of each crate.

For every .rs file under CRATE/src, its top-level module is the first path component (lib.rs
and main.rs are the crate root). Every `crate::NAME` occurrence outside comments (in `use`
lines and inline paths alike, test code included) is an edge from the file's module to NAME.
Prints each strongly connected component with more than one module and exits 1 if any.
"""
import re, sys, pathlib

def module_of(src, path):
    rel = path.relative_to(src)
    first = rel.parts[0]
    if first in ("lib.rs", "main.rs"):
        return None
    return first[:-3] if first.endswith(".rs") else first

def graph(src):
    edges = {}
    for path in src.rglob("*.rs"):
        mod = module_of(src, path)
        if mod is None:
            continue
        text = path.read_text()
        text = re.sub(r"//[^\n]*", "", text)
        # `use crate::{a, b::c}` groups
        for group in re.findall(r"crate::\{([^}]*)\}", text):
            for name in re.findall(r"(?:^|,)\s*([a-z_][a-z0-9_]*)", group):
                if name != mod:
                    edges.setdefault(mod, set()).add(name)
        for name in re.findall(r"crate::([a-z_][a-z0-9_]*)\b", text):
            if name != mod:
                edges.setdefault(mod, set()).add(name)
        edges.setdefault(mod, set())
    mods = set(edges)
    return {m: {n for n in e if n in mods} for m, e in edges.items()}

def sccs(g):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    def visit(v):
        index[v] = low[v] = counter[0]; counter[0] += 1
        stack.append(v); on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out

bad = False
for crate in sys.argv[1:] or ["kernels", "runtime", "gateway", "."]:
    src = pathlib.Path(crate) / "src"
    g = graph(src)
    for comp in sccs(g):
        if len(comp) > 1:
            bad = True
            print(f"{crate}: circle between {', '.join(comp)}")
            for m in comp:
                print(f"  {m} -> {', '.join(sorted(g[m] & set(comp)))}")
sys.exit(1 if bad else 0)

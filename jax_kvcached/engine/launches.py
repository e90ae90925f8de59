"""How much device work a compiled program launches: its optimized HLO's ops that each
run as a kernel (or library call, copy, custom call) when executed op by op, that is
without command buffers. Fused computations count once (their fusion); a loop's body
counts once per iteration (its known trip count); a conditional counts the predicate's
copy to the host plus its cheapest branch (``least``) or its costliest (``most``). With
command buffers (CUDA graphs) the same work is replayed by one launch per graph."""

from __future__ import annotations

import dataclasses
import re

# Ops that launch nothing themselves (bookkeeping, or control flow counted through the
# computations it calls).
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "while", "conditional", "call",
    "add-dependency", "domain",
}  # fmt: skip
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_OPCODE = re.compile(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"(to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_COMMENT = re.compile(r"/\*.*?\*/")  # (/*index=5*/ inside long tuple shapes)


@dataclasses.dataclass(frozen=True)
class Launches:
    """Per execution of the program: launches (kernels and calls, op by op) when every
    conditional takes its cheapest branch (``least``: a greedy step's sampler) and its
    costliest (``most``); ``loops`` (while ops run) and ``conditionals`` (each a
    predicate copied to the host and waited for, outside a command buffer) on the
    costliest path."""

    least: int
    most: int
    loops: int
    conditionals: int


def count_launches(hlo_text: str) -> Launches:
    """The launches of one execution of a compiled program, from its
    ``compiled.as_text()``."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _HEADER.match(line)
        if m and not line.startswith(" "):
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
        elif current is not None and "=" in line:
            comps[current].append(_COMMENT.sub("", line))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    memo: dict[str, Launches] = {}

    def walk(name: str) -> Launches:
        if name in memo:
            return memo[name]
        least = most = loops = conds = 0
        for line in comps.get(name, []):
            m = _OPCODE.search(line)
            if m is None:
                continue
            op = m.group(1)
            if op not in _FREE:
                least, most = least + 1, most + 1
                continue
            called = dict(_CALLED.findall(line))
            if op == "while":
                trip = _TRIP.search(line)
                n = int(trip.group(1)) if trip else 1
                body, cond = walk(called["body"]), walk(called["condition"])
                least += n * (body.least + cond.least)
                most += n * (body.most + cond.most)
                loops += 1 + n * (body.loops + cond.loops)
                conds += n * (body.conditionals + cond.conditionals)
            elif op == "conditional":
                b = _BRANCHES.search(line)
                names = (
                    [x.strip().lstrip("%") for x in b.group(1).split(",")]
                    if b
                    else [called["true_computation"], called["false_computation"]]
                )
                branches = [walk(x) for x in names]
                worst = max(branches, key=lambda x: x.most)
                least += 1 + min(x.least for x in branches)  # + the predicate's copy
                most += 1 + worst.most
                loops += worst.loops
                conds += 1 + worst.conditionals
            elif op == "call":
                inner = walk(called["to_apply"])
                least, most = least + inner.least, most + inner.most
                loops, conds = loops + inner.loops, conds + inner.conditionals
        memo[name] = Launches(least, most, loops, conds)
        return memo[name]

    return walk(entry)

"""The host side of logit processing: each row's token list and the packed step inputs
of :func:`jax_kvcached.engine.sampling.process_logits`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_kvcached.engine.sampling import SamplingParams

Entries = tuple[np.ndarray, np.ndarray]  # token ids (P,), weights (3, P)


def row_entries(
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    sample_step: int,
    eos_ids: Sequence[int],
) -> Entries:
    """A row's token list: generated tokens with their counts, prompt tokens (for the
    repetition penalty), biases, and the EOS / stop tokens banned (-inf) before
    ``min_tokens``. ``output``: the generated tokens the host has (one still on the
    device is counted there)."""
    w: dict[int, list[float]] = {}
    out, counts = np.unique(np.asarray(output, np.int64), return_counts=True)
    for t, c in zip(out.tolist(), counts.tolist(), strict=True):
        w[t] = [float(c), 0.0, 0.0]
    if params.repetition_penalty != 1.0:
        for t in set(prompt):
            w.setdefault(t, [0.0, 0.0, 0.0])[1] = 1.0
    for t, bias in params.logit_bias:
        w.setdefault(t, [0.0, 0.0, 0.0])[2] += bias
    if sample_step < params.min_tokens:
        eos = () if params.ignore_eos else tuple(eos_ids)
        for t in (*eos, *params.stop_token_ids):
            w.setdefault(t, [0.0, 0.0, 0.0])[2] = -np.inf
    ids = np.fromiter(w, np.int32, len(w))
    return ids, np.asarray(list(w.values()), np.float32).reshape(-1, 3).T


def entry_sizes(max_entries: int) -> tuple[int, ...]:
    """Widths of the packed token lists (each compiled once): 64, then x4."""
    sizes = [64]
    while sizes[-1] < max_entries:
        sizes.append(sizes[-1] * 4)
    return tuple(sizes)


def pack_rows(
    rows: Sequence[tuple[Entries, SamplingParams] | None], padded: int, sizes: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The step inputs of :func:`process_logits` for ``rows`` (None: the row processes
    nothing) padded to ``padded`` rows: ids ``(padded, P)``, weights ``(3, padded, P)``,
    penalties ``(3, padded)``; P the smallest of ``sizes`` that fits (past the largest,
    a multiple of 64). None when no row processes."""
    used = [r for r in rows if r is not None]
    if not used:
        return None
    width = max(len(e[0]) for e, _ in used)
    p = next((s for s in sizes if s >= width), -(-width // 64) * 64)
    ids = np.zeros((padded, p), np.int32)
    weights = np.zeros((3, padded, p), np.float32)
    penalties = np.zeros((3, padded), np.float32)
    penalties[2] = 1.0
    for i, r in enumerate(rows):
        if r is None:
            continue
        (e_ids, e_w), q = r
        ids[i, : len(e_ids)] = e_ids
        weights[:, i, : len(e_ids)] = e_w
        penalties[:, i] = (q.presence_penalty, q.frequency_penalty, q.repetition_penalty)
    return ids, weights, penalties

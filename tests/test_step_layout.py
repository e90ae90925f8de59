"""The step's packed input: one named layout packs and unpacks, and the scheduler's
decisions reach the device only through the input builder."""

import ast
import pathlib

import numpy as np
import pytest

import jax_kvcached
from jax_kvcached.engine.step_layout import SEGMENTS, StepLayout


def _segments(lay: StepLayout, rng) -> dict[str, np.ndarray]:
    return {n: rng.integers(-5, 1000, lay.shapes[n]).astype(np.int32) for n in SEGMENTS}


@pytest.mark.parametrize("t,seqs,nb,items,tile,groups", [(1, 1, 8, 1, 1, 1), (64, 8, 16, 16, 8, 2),
                                                         (32, 4, 8, 0, 1, 3)])  # fmt: skip
def test_pack_and_unpack_are_inverse_by_name(t, seqs, nb, items, tile, groups):
    lay = StepLayout(t, seqs, nb, items, tile, groups)
    seg = _segments(lay, np.random.default_rng(t))
    packed = lay.pack(**seg)
    assert packed.shape == (lay.size,) and packed.dtype == np.int32
    assert lay.size == sum(a.size for a in seg.values())
    out = lay.unpack(packed)
    assert list(out) == list(SEGMENTS)
    for name in SEGMENTS:
        np.testing.assert_array_equal(out[name], seg[name])


def test_pack_refuses_missing_misshapen_and_float_segments():
    lay = StepLayout(8, 4, 8, 8, 1, 1)
    seg = _segments(lay, np.random.default_rng(0))
    with pytest.raises(ValueError, match="missing"):
        lay.pack(**{k: v for k, v in seg.items() if k != "src"})
    with pytest.raises(ValueError, match="'tables' has shape"):
        lay.pack(**{**seg, "tables": np.zeros((2, 4, 8), np.int32)})
    with pytest.raises(ValueError, match="not integers"):
        lay.pack(**{**seg, "params": seg["params"].astype(np.float32)})
    with pytest.raises(ValueError, match="packed step input"):
        lay.unpack(np.zeros(lay.size + 1, np.int32))


def test_the_step_program_slices_by_name_only():
    """No positional slicing of the packed input is left in the step program."""
    src = (pathlib.Path(jax_kvcached.__file__).parent / "engine" / "step_program.py").read_text()
    subscripts = [
        n for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
        and n.value.id in ("parts", "packed")
    ]  # fmt: skip
    assert subscripts == []
    assert "layout.unpack(packed)" in src

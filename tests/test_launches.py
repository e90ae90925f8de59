"""Counting what a compiled program launches op by op (the work a command buffer replays
at once): loops by their trip count, conditionals by their costliest branch plus the
predicate's trip to the host; and the runner's step as one program whose launches grow
with depth only through its layer loop."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jax_kvcached as kv
from jax_kvcached.engine.launches import count_launches
from jax_kvcached.engine.runner import ModelRunner, StepInput
from jax_kvcached.models import BUILTIN_CONFIGS, build_model


def _launches(n: int, branch: bool):
    def f(x):
        y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c) @ c, None), x, None, length=n)
        return jax.lax.cond(y.sum() > 0, lambda: y + 1, lambda: y * 2) if branch else y

    return count_launches(jax.jit(f).lower(jnp.ones((4, 4))).compile().as_text())


def test_loops_count_per_iteration_and_conditionals_per_branch():
    five, ten = _launches(5, False), _launches(10, False)
    per_iteration = (ten.most - five.most) / 5
    assert per_iteration >= 2 and per_iteration == int(per_iteration)  # tanh, dot, ...
    assert five.most > 5 * per_iteration  # plus the entry's own ops
    assert (five.loops, five.conditionals, five.least) == (1, 0, five.most)
    branched = _launches(5, True)
    assert branched.conditionals == 1 and branched.least >= five.most + 2
    with pytest.raises(ValueError, match="ENTRY"):
        count_launches("HloModule m\n")


def test_the_scanned_step_launches_grow_only_through_its_layer_loop():
    counts = {}
    for layers in (2, 4):
        cfg = dataclasses.replace(BUILTIN_CONFIGS["tiny-llama"], num_layers=layers)
        pool = kv.Pool("64MiB", backend="host", min_reserved_pages=0, max_reserved_pages=0)
        c = pool.create_kv_cache("a", layers, cfg.num_kv_heads, cfg.head_dim, "float32")
        runner = ModelRunner(build_model(cfg, seed=0), c, attention="host", max_batch=2,
                             max_num_batched_tokens=16, max_model_len=64,
                             scan_layers=True, fuse_sampling=True)  # fmt: skip
        blocks = c.alloc(1).tolist()
        runner.run([StepInput([3], 0, blocks)])
        shape = runner.shapes_for([StepInput([3], 0, blocks)])
        counts[layers] = runner.launches(shape)
        assert runner.dispatches == 1  # the step sampled its row itself
        c.free(blocks, after=runner.token)
        pool.close()
    two, four = counts[2], counts[4]
    assert two.loops == four.loops >= 1
    per_layer = (four.least - two.least) / 2
    assert per_layer == (four.most - two.most) / 2
    # each layer: at least the K/V write, the attention call, projections and the MLP
    assert per_layer >= 4 and per_layer == int(per_layer)
    assert two.least - 2 * per_layer > 0  # embedding, head, sampler: once per step
    assert two.most > two.least  # the sampler's draw over the whole vocabulary

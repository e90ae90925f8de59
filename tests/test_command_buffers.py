"""The options the runner compiles with: command buffers (CUDA graphs) on CUDA, with the
step's branches and layer loop inside them; nothing on a CPU. XLA validates option names
and values on any backend, so a misspelt command type fails here, not on a GPU."""

import jax
import jax.numpy as jnp
import pytest

from jax_kvcached.engine.device_choices import COMMAND_BUFFER_COMMANDS, compiler_options


def test_cuda_steps_compile_as_command_buffers_with_branches_and_loops(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    on = compiler_options("cuda")
    commands = set(on["xla_gpu_enable_command_buffer"].split(","))
    # the FFI K/V write (CUSTOM_CALL), the sampler's and scores' branches, the layer scan
    assert {"CUSTOM_CALL", "CONDITIONAL", "WHILE", "FUSION"} <= commands
    assert compiler_options("cuda", command_buffers=False) == {"xla_gpu_enable_command_buffer": ""}
    assert compiler_options("host") == {} and compiler_options("host", True) == {}
    # The user's own XLA flag is kept (the benchmark's "off" run sets it empty).
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    assert compiler_options("cuda") == {}
    assert compiler_options("cuda", command_buffers=True) == on


@pytest.mark.parametrize("value", [COMMAND_BUFFER_COMMANDS, ""])
def test_xla_accepts_the_options(value):
    f = jax.jit(lambda x: jax.lax.cond(x.sum() > 0, lambda: x + 1, lambda: x - 1))
    compiled = f.lower(jnp.ones(3)).compile(
        compiler_options={"xla_gpu_enable_command_buffer": value}
    )
    assert compiled(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(Exception, match="not a valid enum value"):
        f.lower(jnp.ones(3)).compile(compiler_options={"xla_gpu_enable_command_buffer": "GRAPHS"})

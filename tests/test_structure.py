"""The package's structure: the one-way layers, no import cycles, the C++ module's stubs,
and tests that stay on public surfaces."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_cache

import jax_kvcached
import jax_kvcached.models
from jax_kvcached.memory import _C, ops

PKG = pathlib.Path(jax_kvcached.__file__).parent
TESTS = pathlib.Path(__file__).parent
# A layer may import only the layers after it in this list (and itself).
LAYERS = ("serve", "engine", "memory")
# What the models may import of the package beyond themselves: the C++ core's FFI targets
# (a model that calls a kernel of the core registers it where it builds the call).
MODEL_SEAMS = {"jax_kvcached.memory.ffi_targets"}


# The models package: inside PKG in a wheel, its own folder in an editable install.
MODELS = pathlib.Path(jax_kvcached.models.__file__).parent


def _module(path: pathlib.Path) -> str:
    if path.is_relative_to(MODELS) and not MODELS.is_relative_to(PKG):
        parts = ("jax_kvcached", "models", *path.relative_to(MODELS).with_suffix("").parts)
    else:
        parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dynamic_import(call: ast.Call) -> str | None:
    """The module a call of ``importlib.import_module`` / ``__import__`` loads, when it is
    a jax_kvcached string (an import the layering must see like any other)."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and str(arg.value).startswith("jax_kvcached"):
        return str(arg.value)
    return None


def _files() -> list[pathlib.Path]:
    extra = [] if MODELS.is_relative_to(PKG) else list(MODELS.rglob("*.py"))
    return [*PKG.rglob("*.py"), *extra]


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """jax_kvcached modules imported by a file (any scope, relative imports resolved;
    ``from package import submodule`` counts as importing the submodule)."""
    mod = _module(path) if path.is_relative_to(PKG.parent) or path.is_relative_to(MODELS) else ""
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and _dynamic_import(node):
            out.add(_dynamic_import(node))  # importlib.import_module("jax_kvcached...")
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("jax_kvcached")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.startswith("jax_kvcached"):
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.add(sub if sub in modules else base)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in _files()}
    names = set(files)
    return {m: {i for i in _imports(p, names) if i in files and i != m} for m, p in files.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in graph.items():
        lm = _layer(m)
        for d in deps:
            ld = _layer(d)
            if lm and ld and LAYERS.index(ld) < LAYERS.index(lm):
                bad.append(f"{m} -> {d}")
            if (m.startswith("jax_kvcached.models") and not d.startswith("jax_kvcached.models")
                    and d not in MODEL_SEAMS):  # fmt: skip
                bad.append(f"{m} -> {d} (models stand alone)")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles among modules (Tarjan's strongly connected components > 1)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_layers_import_one_way():
    graph = _graph()
    assert {"jax_kvcached.memory.pool", "jax_kvcached.engine.kv_manager"} <= set(graph)
    assert layer_violations(graph) == []
    # the models' one seam into the core is an edge the check sees
    assert "jax_kvcached.memory.ffi_targets" in graph["jax_kvcached.models.quant_linear"]


def test_a_dynamic_import_is_an_import(tmp_path):
    """importlib.import_module / __import__ of a jax_kvcached module count as imports, so
    they cannot slip past the layering; the models' allowed seam is allowed by name."""
    f = tmp_path / "m.py"
    f.write_text("import importlib\n"
                 "def k():\n"
                 "    importlib.import_module('jax_kvcached.memory.ops')\n"
                 "    __import__('jax_kvcached.serve.app')\n")  # fmt: skip
    names = {"jax_kvcached.memory.ops", "jax_kvcached.serve.app"}
    assert _imports(f, names) == names
    graph = {"jax_kvcached.models.moe": {"jax_kvcached.memory.ops"},
             "jax_kvcached.models.quant_linear": {"jax_kvcached.memory.ffi_targets"}}
    assert layer_violations(graph) == [
        "jax_kvcached.models.moe -> jax_kvcached.memory.ops (models stand alone)"
    ]


def test_no_import_cycles():
    # The package's own __init__ re-exports lazily, so it is not a node of any cycle.
    graph = {m: d - {"jax_kvcached"} for m, d in _graph().items()}
    assert cycles(graph) == []


def test_the_checks_catch_violations():
    bad = {
        "jax_kvcached.memory.pool": {"jax_kvcached.engine.engine"},
        "jax_kvcached.engine.engine": {"jax_kvcached.serve.loop", "jax_kvcached.memory.pool"},
        "jax_kvcached.models.llama": {"jax_kvcached.memory.ops"},
        "jax_kvcached.serve.loop": set(),
        "jax_kvcached.memory.ops": set(),
    }
    assert layer_violations(bad) == [
        "jax_kvcached.engine.engine -> jax_kvcached.serve.loop",
        "jax_kvcached.memory.pool -> jax_kvcached.engine.engine",
        "jax_kvcached.models.llama -> jax_kvcached.memory.ops (models stand alone)",
    ]
    assert cycles(bad) == [["jax_kvcached.engine.engine", "jax_kvcached.memory.pool"]]


def _private_uses(source: str) -> list[str]:
    """``obj._name`` accesses where obj is not ``self`` / ``cls`` (dunders are fine)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_tests_use_public_surfaces_only():
    assert _private_uses("x = cache._buffer.mapped_pages()") == ["cache._buffer (line 1)"]
    bad = {
        p.name: uses
        for p in [*TESTS.glob("*.py"), *TESTS.glob("gpu/*.py")]
        if (uses := _private_uses(p.read_text()))
    }
    assert bad == {}


def test_no_module_reaches_into_anothers_privates():
    # jax's jit-cache size is the one foreign private read (the "nothing compiled after
    # warm-up" check counts executables in jit's own cache).
    allowed = {
        f"self._jitted{x}._cache_size" for x in ("", "_sample", "_process", "_logprobs", "_copy")
    }
    allowed.add("os._exit")  # public stdlib (serve exits past a compile at its deadline)
    bad = {
        _module(p): uses
        for p in _files()
        if (uses := [u for u in _private_uses(p.read_text()) if u.split(" (")[0] not in allowed])
    }
    assert bad == {}


def _stub_names(tree: ast.Module) -> dict[str, set[str]]:
    """Top-level names of a stub, and each class's members."""
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {
                n.name for n in node.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"
            }
        elif isinstance(node, ast.FunctionDef):
            out[node.name] = set()
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = set()
    return out


def test_c_module_stubs_match_the_module():
    # beside the module (a wheel), or in the package's source folder (an editable install)
    import jax_kvcached.memory as memory

    places = [pathlib.Path(_C.__file__).parent, *map(pathlib.Path, memory.__path__)]
    stubs = [p / "_C.pyi" for p in places if (p / "_C.pyi").is_file()]
    assert stubs, "the _C.pyi stubs are installed beside the module"
    stub = stubs[0]
    names = _stub_names(ast.parse(stub.read_text()))
    public = {n for n in dir(_C) if not n.startswith("_")}
    assert set(names) == public
    for cls in ("PagePool", "KVBuffer"):
        members = {n for n in dir(getattr(_C, cls)) if not n.startswith("_")}
        assert names[cls] == members, cls


def test_ops_run_under_vmap_once_per_element(pool):
    """Every ffi_call declares its vmap method: a vmapped write is a sequence of writes
    and a vmapped attention equals the unbatched calls."""
    c = make_cache(pool)
    ids = c.alloc(2)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((2, 4, 2, 64)), jnp.float32)  # 2 batches of 4
    slots = jnp.asarray(np.stack([c.slot_mapping(ids, np.arange(4) + 4 * i) for i in range(2)]))
    token = ops.new_token()
    write = jax.vmap(lambda k, s, c: ops.write_kv(c, 1, k, -k, s, token), in_axes=(0, 0, None))
    tokens = jax.jit(write)(k, slots, c)  # (the cache an argument, not batched)
    assert tokens.shape == (2,)
    jax.block_until_ready(tokens)
    got = np.asarray(c.view[1, 0, ids]).reshape(-1, 2, 64)[:8]
    np.testing.assert_array_equal(got, np.asarray(k).reshape(8, 2, 64))

    q = jnp.asarray(rng.standard_normal((3, 2, 2, 1, 64)), jnp.float32)
    table = jnp.asarray(np.tile(ids, (1, 1)), jnp.int32)
    lens = jnp.asarray([8], jnp.int32)
    starts, q_lens = jnp.asarray([0], jnp.int32), jnp.asarray([2], jnp.int32)

    def attend(q, c):
        return ops.paged_attention(c, 1, q, table, lens, starts, q_lens, tokens[0])

    batched = jax.vmap(attend, in_axes=(0, None))(q, c)
    single = jnp.stack([attend(q[i], c) for i in range(3)])
    np.testing.assert_allclose(np.asarray(batched), np.asarray(single), rtol=1e-6)
    c.free(ids)


def test_the_package_reexports_the_public_api():
    from jax_kvcached.engine.engine import Engine, RequestOutput
    from jax_kvcached.engine.sampling import SamplingParams
    from jax_kvcached.memory.kv_cache import KVCache
    from jax_kvcached.memory.pool import Pool
    from jax_kvcached.serve.loop import ServingLoop

    kv = jax_kvcached
    assert (kv.Pool, kv.KVCache, kv.Engine, kv.SamplingParams, kv.ServingLoop) == (
        Pool, KVCache, Engine, SamplingParams, ServingLoop,
    )  # fmt: skip
    assert kv.RequestOutput is RequestOutput and kv.ops is ops
    assert issubclass(kv.PoolExhausted, kv.KVCacheError)
    assert set(kv.__all__) >= {"Pool", "KVCache", "PoolExhausted", "ops", "Engine", "ServingLoop"}


def test_the_kv_manager_asks_group_managers_and_never_branches_on_a_group_type():
    """Group types differ only in their manager class (engine/kv_group_managers.py):
    the KV manager has no condition on a window, a group kind or a manager's class,
    and each type is a class."""
    from jax_kvcached.engine import kv_group_managers as m
    from jax_kvcached.engine.kv_group_managers import RecurrentStateManager, make_manager
    from jax_kvcached.models.interface import FULL, RECURRENT, KVSpec

    tree = ast.parse((PKG / "engine" / "kv_manager.py").read_text())
    methods = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
               and f.name != "__init__"]  # fmt: skip  (__init__ validates its arguments)
    nodes = [n for f in methods for n in ast.walk(f)]
    tests = [n.test for n in nodes if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    tests += [c for n in nodes if isinstance(n, ast.comprehension) for c in n.ifs]
    assert len(methods) > 20 and tests
    named = {x.attr if isinstance(x, ast.Attribute) else getattr(x, "id", None)
             for t in tests for x in ast.walk(t)}  # fmt: skip
    assert not named & {"windows", "window", "kind", "holds_slot", "SlidingWindowManager",
                        "RecurrentStateManager", "isinstance"}, named  # fmt: skip
    kinds = {c.kind for c in (m.FullAttentionManager, m.SlidingWindowManager,
                              RecurrentStateManager)}  # fmt: skip
    assert kinds == {"full", "sliding", "recurrent"}
    assert make_manager(FULL, _FakeGroup(), 16, None).kind == "full"
    assert make_manager(KVSpec.sliding(8), _FakeGroup(), 16, None).window == 8
    assert make_manager(RECURRENT, _FakeGroup(), 16, None, slot_blocks=2, interval=64).kind == (
        "recurrent")  # fmt: skip
    assert set(m.MANAGERS) == set(KVSpec.KINDS)  # a manager per kind of layer spec
    for bad in [("sliding", 0), ("full", 8), ("recurrent", -1), ("shared", 0)]:
        with pytest.raises(ValueError):
            KVSpec(*bad)


class _FakeGroup:
    index = 0


def test_the_memory_layer_knows_no_sleep_and_the_pool_no_ledger_type():
    """Sleep is the serving layer's meaning of the group channel's two words: no name in
    memory/ speaks of it (time.sleep aside), and the pool talks to its group through its
    channel object, never by testing the ledger's type."""
    for path in (PKG / "memory").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(tree)
                 if isinstance(n, (ast.Attribute, ast.Name))} - {"sleep"}  # fmt: skip
        names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not [n for n in names if "sleep" in n.lower()], path.name
    pool = ast.parse((PKG / "memory" / "pool.py").read_text())
    checks = [n for n in ast.walk(pool) if isinstance(n, ast.Call)
              and getattr(n.func, "id", None) == "isinstance"
              and "Ledger" in ast.unparse(n)]  # fmt: skip
    assert checks == []
    import jax_kvcached as kv

    p = kv.Pool("8MiB", backend="host")
    p.channel.publish("nobody", 1)  # alone: published to no one, nothing posted
    assert p.channel.request("nobody") == 0 and p.group_records() is None
    p.close()

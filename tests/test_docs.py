"""Every code block of the README and of docs/ runs as written.

Python blocks run in order, each in a fresh namespace unless the line before it says
``<!-- continues -->`` (then it runs in the namespace of the block before). Shell blocks:
every ``jax-kvcached ...`` command in them must parse with the CLI's own parser (the
commands exist and take those flags); ``text`` blocks are output, not code."""

import pathlib
import re
import shlex

import pytest

from jax_kvcached import cli

ROOT = pathlib.Path(__file__).parents[1]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))]
FENCE = re.compile(r"(<!-- continues -->\n)?```(\w*)\n(.*?)```", re.S)


def blocks(page: str) -> list[tuple[str, str, bool]]:
    """(language, code, continues) of every fenced block of a page, in order."""
    text = (ROOT / page).read_text()
    return [(m.group(2), m.group(3), bool(m.group(1))) for m in FENCE.finditer(text)]


def shell_commands(code: str) -> list[list[str]]:
    """The ``jax-kvcached`` commands of a shell block (continuation lines joined)."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if line.startswith("jax-kvcached"):
            out.append(shlex.split(line)[1:])
    return out


def test_every_page_has_checked_blocks():
    langs = {lang for page in PAGES for lang, _, _ in blocks(page)}
    assert {"python", "bash", "text"} <= langs
    assert not langs - {"python", "bash", "text"}, "a block of an unknown language"
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300  # a front page


@pytest.mark.parametrize("page", PAGES)
def test_shell_blocks_parse(page):
    for lang, code, _ in blocks(page):
        if lang != "bash":
            continue
        for argv in shell_commands(code):
            try:
                cli.build_parser().parse_args(argv)
            except SystemExit as e:
                cmd = f"jax-kvcached {shlex.join(argv)}"
                raise AssertionError(f"{page}: `{cmd}` does not parse") from e


def _has_python(page: str) -> bool:
    return any(lang == "python" for lang, _, _ in blocks(page))


def test_the_library_pages_have_python():
    assert {"README.md", "docs/library.md", "docs/memory.md"} <= set(filter(_has_python, PAGES))


@pytest.mark.parametrize("page", [p for p in PAGES if _has_python(p)])
def test_python_blocks_run(page, capsys):
    namespace: dict = {}
    ran = 0
    for i, (lang, code, continues) in enumerate(blocks(page)):
        if lang != "python":
            continue
        if not continues:
            namespace = {}
        exec(compile(code, f"{page}[block {i}]", "exec"), namespace)
        ran += 1
    out = capsys.readouterr().out
    if page == "README.md":
        assert ran == 3
        # the engine example gives the right answer by default (fp32 on the CPU)
        assert "The capital of France is Paris." in out
        assert "budget_pages" in out  # the KV example printed the pool's stats


def test_the_shell_check_can_fail():
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(shell_commands("jax-kvcached serve --no-such-flag 1")[0])


def _report():
    import importlib.util

    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_is_what_the_committed_json_says(page):
    """The generated regions (docs/benchmarks.md's tables, the figures the pages quote)
    are what `benchmarks/report.py --write` makes of benchmarks/results/."""
    text = (ROOT / page).read_text()
    assert _report().render(text) == text, f"{page}: run python benchmarks/report.py --write"


def test_the_figures_follow_the_json():
    """A figure changed in the JSON changes the page: the check can fail."""
    import copy

    report = _report()
    load = report.results_loader()

    def changed(name):
        data = load(name)
        if name == "bench_sleep.json":
            data = copy.deepcopy(data)
            data["runs"]["4096"]["wake_detail"][3]["seconds"] = 9.0
        return data

    regions = sum(t.count("<!-- fig ") + t.count("<!-- table ") + t.count("<!-- report ")
                  for t in ((ROOT / p).read_text() for p in PAGES))  # fmt: skip
    assert regions >= 40
    readme = (ROOT / "README.md").read_text()
    assert "<!-- fig smollm2_wake_ms -->" in readme
    new = report.render(readme, changed)
    assert new != readme and "125-9000<!-- /fig --> ms" in new
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    assert report.render(bench, changed) != bench

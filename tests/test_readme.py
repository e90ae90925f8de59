"""The README's usage example runs as written."""

import pathlib
import re

import jax


def test_readme_example_runs(capsys):
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    with jax.default_device(jax.devices("cpu")[0]):
        namespace: dict = {}
        exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["pool"].stats()["mapped_pages"] == 0
    assert "budget_pages" in capsys.readouterr().out
    namespace["pool"].close()

"""guidellm, the benchmark client of vLLM deployments, against ``serve`` as a user runs
it: synthetic data, a tokenizer folder saved from the GGUF, a few streamed requests on
each OpenAI route. It sends vLLM's extensions (``stream_options.continuous_usage_stats``)
that once made every request a 400."""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_guidellm import SERVED, run_guidellm, tokenizer_dir  # noqa: E402
from bench_serving import Server  # noqa: E402
from conftest import COMPILE_CACHE  # noqa: E402

from jax_kvcached.serve.config import ServeConfig  # noqa: E402

GUIDELLM = shutil.which("guidellm") or os.path.join(os.path.dirname(sys.executable), "guidellm")
# guidellm comes with the test extra: missing, the test fails (CI must not pass without it).
assert os.path.exists(GUIDELLM), "guidellm is not installed: pip install -e '.[test]'"


def test_guidellm_runs_against_serve_without_an_error(tmp_path):
    from jax_kvcached.models.pretrained import pretrained_path

    tok = tokenizer_dir(pretrained_path("smollm2-135m"), str(tmp_path))
    server = Server(sys.executable, f"{SERVED}=smollm2-135m", [], COMPILE_CACHE,
                    ServeConfig(warmup=False))  # (shapes compile as the requests need them)
    args = argparse.Namespace(concurrency=2, prompt_tokens=48, output_tokens=8, requests=4)
    try:
        server.first_answer()
        for i, route in enumerate(("/v1/completions", "/v1/chat/completions")):
            for attempt in range(2):
                res = run_guidellm(GUIDELLM, server.url, tok, args,
                                   str(tmp_path / f"{i}-{attempt}.json"), seed=i, route=route)
                # guidellm's scheduler (two processes) can end its run with one answered
                # request still uncounted: neither successful, errored nor incomplete.
                # That run goes again once; any error, or a second short run, fails.
                if res["requests"] == 4 or res["errored"]:
                    break
            assert res["requests"] == 4 and res["errored"] == 0, (route, res["errors"])
            assert res["output_tokens_mean"] == 8, res  # (guidellm asks to ignore EOS)
            assert res["prompt_tokens_mean"] >= 48, res
    finally:
        server.stop()

"""Served through a real client: ``guidellm`` (the vLLM project's benchmark client) against
``jax-kvcached serve`` and llama.cpp's own OpenAI server on the same GGUF file.

Both servers get the same file, the same thread count (``--threads``) and the same load:
guidellm's synthetic text at ``--concurrency`` streams, ``--prompt-tokens`` per prompt,
``--output-tokens`` per answer (ignore EOS), ``--requests`` requests, all over
``/v1/completions``; its tokenizer is a folder written from the GGUF's own vocabulary.
Rounds alternate the two servers (medians reported). guidellm and llama-cpp-python stay out
of this project's environment: ``--guidellm`` names the guidellm executable and
``--llama-python`` an interpreter with ``llama-cpp-python[server]``.
Prints a table and writes JSON (benchmarks/results/bench_guidellm.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import Process, Server  # noqa: E402

from jax_kvcached.serve.config import ServeConfig  # noqa: E402

MODEL = "smollm2-135m"
SERVED = "m"  # the name both servers answer to (bench_serving's Server probes it)


def tokenizer_dir(path: str, out: str) -> str:
    """A Hugging Face tokenizer folder (``tokenizer.json`` and its config) from a GGUF."""
    from jax_kvcached.models.gguf import GGUFCheckpoint

    tok = GGUFCheckpoint(path).tokenizer()
    tok._tok.save(os.path.join(out, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", **tok.special_tokens}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f)
    return out


class LlamaServer(Process):
    """``python -m llama_cpp.server`` on a free loopback port."""

    def __init__(self, python: str, path: str, threads: int, ctx: int) -> None:
        super().__init__()
        self.launch([python, "-m", "llama_cpp.server", "--model", path, "--host", "127.0.0.1",
                     "--port", str(self.port), "--n_threads", str(threads),
                     "--n_threads_batch", str(threads), "--n_ctx", str(ctx),
                     "--model_alias", SERVED])  # fmt: skip

    def wait(self, timeout: float = 300) -> None:
        """Until it lists its model (it loads the file before it answers)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited: {self.tail(3000)}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("llama.cpp server did not start")


def run_guidellm(exe: str, url: str, tok: str, args: argparse.Namespace, out: str,
                 seed: int, validate: bool = True, route: str = "/v1/completions"
                 ) -> dict:  # fmt: skip
    """``seed``: the synthetic prompts' (a round's own: a later round would hit the prefix
    cache); ``validate``: guidellm's probe of ``/health`` first (llama.cpp's has none);
    ``route``: the OpenAI route it sends to."""
    cmd = [exe, "run",
           "--backend", f"kind=openai_http,target={url},model={SERVED},"
                        f"request_format={route},validate_backend={validate}",
           "--profile", f"kind=concurrent,streams={args.concurrency}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                     f"output_tokens={args.output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={tok}",
           "--seed", f"kind=static,value={seed}",
           "--constraint", f"kind=max_requests,count={args.requests}",
           "--output", f"kind=json,path={out}", "--disable-console"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"guidellm failed: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    with open(out) as f:
        b = json.load(f)["benchmarks"][0]
    m, reqs = b["metrics"], b["requests"]
    if not reqs["successful"]:
        raise RuntimeError(f"no request succeeded at {url}: {reqs['errored'][:1]}")
    out_tokens = m["output_token_count"]["successful"]["total_sum"]
    return {
        "requests": len(reqs["successful"]),
        # llama.cpp's server has no ignore_eos: an answer that starts with EOS is empty,
        # which guidellm counts as an error (its tokens are not in output_tok_s)
        "errored": len(reqs["errored"]),
        "errors": sorted({str(r["info"].get("error"))[:120] for r in reqs["errored"]}),
        "duration_s": b["duration"],
        "output_tok_s": out_tokens / b["duration"],  # every output token over the run
        "guidellm_output_tok_s_mean": m["output_tokens_per_second"]["successful"]["mean"],
        "ttft_ms_median": m["time_to_first_token_ms"]["successful"]["median"],
        "itl_ms_median": m["inter_token_latency_ms"]["successful"]["median"],
        "prompt_tokens_mean": m["prompt_token_count"]["successful"]["mean"],
        "output_tokens_mean": m["output_token_count"]["successful"]["mean"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--guidellm", default=shutil.which("guidellm"))
    p.add_argument("--llama-python", required=True,
                   help="an interpreter with llama-cpp-python[server]")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--quantization", default="auto", help="serve --quantization")
    p.add_argument("--serve-args", default="", help="more serve flags, e.g. "
                   "'--max-num-batched-tokens 128'")  # fmt: skip
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--out", default=os.path.join(here, "results", "bench_guidellm.json"))
    args = p.parse_args()
    if not args.guidellm:
        sys.exit("guidellm is not on PATH: --guidellm names its executable")
    from jax_kvcached.models.pretrained import pretrained_path

    path = pretrained_path(MODEL)
    work = tempfile.mkdtemp(prefix="kvcached-guidellm-")
    tok = tokenizer_dir(path, work)
    ours = Server(sys.executable, f"{SERVED}={MODEL}", args.serve_args.split(),
                  os.path.join(work, "xla-cache"),
                  ServeConfig(quantization=args.quantization))  # fmt: skip
    llama = LlamaServer(args.llama_python, path, args.threads, ctx=4096)
    runs: dict[str, list[dict]] = {"jax_kvcached": [], "llama_cpp": []}
    try:
        ours.first_answer()
        llama.wait()
        for r in range(args.rounds):
            for name, url in (("jax_kvcached", ours.url), ("llama_cpp", llama.url)):
                res = run_guidellm(args.guidellm, url, tok, args,
                                   os.path.join(work, f"{name}-{r}.json"), seed=1000 + r,
                                   validate=name == "jax_kvcached")  # fmt: skip
                runs[name].append(res)
                print(f"round {r} {name:12s} {res['output_tok_s']:6.1f} output tok/s, "
                      f"TTFT median {res['ttft_ms_median']:.0f} ms", flush=True)  # fmt: skip
    finally:
        ours.stop()
        llama.stop()
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0] if f != "errors"}
           for k, v in runs.items()}  # fmt: skip
    version = subprocess.run(
        [args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    ours_m, llama_m = med["jax_kvcached"], med["llama_cpp"]
    result = {
        "model": MODEL, "file": os.path.basename(path), "threads": args.threads,
        "load": {k: getattr(args, k) for k in ("concurrency", "prompt_tokens", "output_tokens",
                                               "requests", "quantization", "serve_args")},
        "llama_cpp_python": version, "median": med, "runs": runs,
        "output_tok_s_ratio": ours_m["output_tok_s"] / llama_m["output_tok_s"],
        "ttft_ratio": ours_m["ttft_ms_median"] / llama_m["ttft_ms_median"],
    }  # fmt: skip
    print(f"\nguidellm, concurrency {args.concurrency}, {args.prompt_tokens} prompt / "
          f"{args.output_tokens} output tokens, {args.requests} requests (medians of "
          f"{args.rounds} rounds)")  # fmt: skip
    print("server        output tok/s  TTFT median ms  ITL median ms  out tokens/req  errored")
    for k, v in med.items():
        print(f"{k:12s}  {v['output_tok_s']:12.1f}  {v['ttft_ms_median']:14.0f}  "
              f"{v['itl_ms_median']:13.1f}  {v['output_tokens_mean']:14.1f}  "
              f"{v['errored']:7.0f}")  # fmt: skip
    print(f"ours / llama.cpp: output tok/s {result['output_tok_s_ratio']:.2f}x, "
          f"TTFT {result['ttft_ratio']:.2f}x")  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

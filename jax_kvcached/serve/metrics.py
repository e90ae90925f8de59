"""Prometheus metrics of a server: per-model memory, prefix hit rate, queues, TTFT."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from jax_kvcached.serve.loop import ServingLoop

TTFT_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
    3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _LoopCollector:
    """Gauges read from the loop and its pools at scrape time."""

    def __init__(self, loop: ServingLoop) -> None:
        self.loop = loop

    def collect(self) -> Iterator[Metric]:
        stats = self.loop.stats()
        pools = [p.stats() for p in self.loop.pools()]

        def gauge(name: str, doc: str, key: str) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model"])
            for model, s in stats.items():
                value = s[key]
                g.add_metric([model], float("nan") if value is None else float(value))
            return g

        yield gauge(
            "kvcached_mapped_bytes", "Physical KV memory mapped by the model.", "mapped_bytes"
        )
        yield gauge(
            "kvcached_weight_bytes",
            "Device memory held by the model's weights (per device; 0 asleep).",
            "weight_bytes",
        )
        yield gauge(
            "kvcached_weight_packed_bytes",
            "Of the weights, packed int8 / int4 values and their scales.",
            "weight_packed_bytes",
        )
        yield gauge(
            "kvcached_memory_limit_bytes", "The model's memory limit (NaN: the pool budget).",
            "limit_bytes",
        )  # fmt: skip
        yield gauge(
            "kvcached_memory_guarantee_bytes", "Memory other models may not take from it.",
            "guarantee_bytes",
        )  # fmt: skip
        yield gauge("kvcached_queue_depth", "Requests waiting for admission.", "waiting")
        yield gauge("kvcached_running_requests", "Requests being generated.", "running")
        yield gauge("kvcached_queue_limit", "Requests in flight before 429.", "max_queue")
        yield gauge("kvcached_max_batch", "Requests run at once.", "max_batch")
        yield gauge(
            "kvcached_prefix_hit_rate",
            "Prompt tokens served from the prefix cache on the device.",
            "prefix_hit_rate",
        )
        yield gauge(
            "kvcached_prefix_cached_tokens",
            "Tokens held by the prefix cache.",
            "prefix_cached_tokens",
        )
        yield gauge(
            "kvcached_host_cache_bytes",
            "Host memory held by the prefix cache's host tier (entries x block bytes).",
            "host_bytes",
        )
        yield gauge(
            "kvcached_host_cache_capacity_bytes",
            "The host tier's bound (0: no host tier).",
            "host_capacity_bytes",
        )
        yield gauge("kvcached_host_cache_entries", "Blocks held by the host tier.", "host_entries")
        yield gauge(
            "kvcached_lora_slot_bytes",
            "Device memory of the model's LoRA adapter slots (0: no adapters), per device.",
            "lora_slot_bytes",
        )  # fmt: skip
        yield gauge(
            "kvcached_host_hit_rate",
            "Prompt tokens restored from the host tier (of those looked up).",
            "host_hit_rate",
        )
        yield gauge(
            "kvcached_model_failed", "1 if the model's engine was taken out of service.", "failed"
        )
        yield gauge(
            "kvcached_model_sleeping", "1 if the model is asleep (weights and KV given back).",
            "sleeping",
        )  # fmt: skip
        yield gauge(
            "kvcached_model_waiting_for_wake", "Requests waiting for the model to wake.",
            "waiting_for_wake",
        )  # fmt: skip
        for name, doc, key in (
            ("kvcached_preemptions", "Requests preempted for memory.", "preemptions"),
            ("kvcached_steps", "Engine steps dispatched.", "steps"),
            ("kvcached_generated_tokens", "Tokens generated.", "generated_tokens"),
            ("kvcached_prefix_hit_tokens", "Prompt tokens found cached.", "prefix_hits_tokens"),
            ("kvcached_prefix_query_tokens", "Prompt tokens looked up.", "prefix_queries_tokens"),
            ("kvcached_host_hit_tokens", "Prompt tokens restored from the host tier.",
             "host_hits_tokens"),
            ("kvcached_host_restores", "Requests whose prefix the host tier restored.",
             "host_restores"),
            ("kvcached_host_copied_to_host_bytes", "Bytes copied out to the host tier.",
             "host_bytes_to_host"),
            ("kvcached_host_copied_from_host_bytes", "Bytes restored from the host tier.",
             "host_bytes_from_host"),
            ("kvcached_model_sleeps", "Times the model was put to sleep.", "sleeps"),
            ("kvcached_model_wakes", "Times the model was woken.", "wakes"),
            ("kvcached_model_wake_failures", "Wakes that failed (the model stayed asleep).",
             "wake_failures"),
        ):  # fmt: skip
            c = CounterMetricFamily(name, doc, labels=["model"])
            for model, s in stats.items():
                c.add_metric([model], float(s[key]))
            yield c
        g = GaugeMetricFamily(
            "kvcached_kv_cache_group_mapped_bytes",
            "Physical KV memory mapped by each KV cache group of the model (kind full, "
            "sliding with its window, or recurrent: state slots and checkpoints).",
            labels=["model", "kv_group", "window", "kind"],
        )
        for model, s in stats.items():
            for i, grp in enumerate(s["kv_cache_groups"]):
                g.add_metric([model, str(i), str(grp["window"]), grp["kind"]],
                             float(grp["mapped_bytes"]))  # fmt: skip
        yield g
        for key in ("budget", "mapped", "reserved"):
            g = GaugeMetricFamily(
                f"kvcached_pool_{key}_bytes",
                f"The pool's {key} memory (on each device of a tensor-parallel pool).",
                labels=["pool"],
            )
            for i, pool in enumerate(pools):  # one series per pool (its first device)
                g.add_metric([f"{i}:{pool['device']}"], float(pool[f"{key}_bytes"]))
            yield g
        g = GaugeMetricFamily(
            "kvcached_pool_devices", "Devices the pool's KV heads are split over.", labels=["pool"]
        )
        for i, pool in enumerate(pools):
            g.add_metric([f"{i}:{pool['device']}"], float(pool["tensor_parallel"]))
        yield g
        yield from self._group()
        yield from self._vllm_names(stats)

    @staticmethod
    def _vllm_names(stats: dict[str, dict[str, Any]]) -> Iterator[Metric]:
        """The load figures under vLLM's names (label ``model_name``), which routers'
        load policies poll (smg's ``least_load``, ``power_of_two``, ``cache_aware``)."""
        for name, doc, key in (
            ("vllm:num_requests_running", "Requests being generated.", "running"),
            ("vllm:num_requests_waiting", "Requests waiting for admission.", "waiting"),
            ("vllm:kv_cache_usage_perc", "KV memory mapped, of what the model may map "
             "(1 = full).", "kv_usage"),
            ("vllm:gpu_cache_usage_perc", "The same (vLLM's older name).", "kv_usage"),
            ("vllm:gpu_prefix_cache_hit_rate", "Prompt tokens found cached, of those "
             "looked up.", "prefix_hit_rate"),
        ):  # fmt: skip
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            for model, s in stats.items():
                g.add_metric([model], float(s[key]))
            yield g

    def _group(self) -> Iterator[Metric]:
        """Every tenant of the process groups the server's pools are in (all processes)."""
        rows = []
        for pool in self.loop.pools():
            records = pool.group_records()
            if records is not None:
                rows += [(pool.group, pool.page_size, r) for r in records]
        if not rows:
            return
        labels = ["group", "tenant", "pid"]
        for key, doc in (
            ("mapped", "Pages mapped by each tenant of the group (every process)."),
            ("reserved", "The tenant's pool's reserved pages (shared by its tenants)."),
            ("limit", "The tenant's limit (NaN: the group budget)."),
            ("guarantee", "The tenant's guarantee."),
        ):
            g = GaugeMetricFamily(f"kvcached_group_{key}_bytes", doc, labels=labels)
            for group, ps, r in rows:
                pages = getattr(r, f"{key}_pages")
                value = float("nan") if pages is None else float(pages * ps)
                g.add_metric([group, r.name, str(r.pid)], value)
            yield g
        g = GaugeMetricFamily(
            "kvcached_group_hit_rate", "The tenant's prefix hit rate (NaN: no lookups yet).",
            labels=labels,
        )  # fmt: skip
        for group, _, r in rows:
            rate = float("nan") if r.hit_rate is None else r.hit_rate
            g.add_metric([group, r.name, str(r.pid)], rate)
        yield g


class ServerMetrics:
    """A registry of its own (no process-global state) for one server."""

    def __init__(self, loop: ServingLoop) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_LoopCollector(loop))
        self.ttft = Histogram(
            "kvcached_ttft_seconds", "Time to first token, from request arrival.", ["model"],
            buckets=TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "kvcached_request_latency_seconds", "Request latency, arrival to last token.",
            ["model"], buckets=TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.requests = Counter(
            "kvcached_requests", "Requests answered, by outcome.", ["model", "outcome"],
            registry=self.registry,
        )  # fmt: skip
        self.wake_seconds = Histogram(
            "kvcached_wake_seconds", "Time to wake a sleeping model (weights back, preload).",
            ["model"], buckets=TTFT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        loop.wake_listeners.append(
            lambda model, out: self.wake_seconds.labels(model).observe(out["seconds"])
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

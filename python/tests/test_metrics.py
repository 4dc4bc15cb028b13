"""The Prometheus text of Manager, Scheduler and Worker, read back with a real Prometheus text
parser (``prometheus_client.parser``, installed by .ci/run), and the plain dicts of
``metrics()`` fed to a ``prometheus_client`` custom collector.

Without ``prometheus_client`` these tests fail, unless ``KVO_SKIP_PROMETHEUS_TESTS=1`` says to
skip them (the reason is printed).
"""

import ctypes
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import kvoffload  # noqa: E402
from kvoffload import (  # noqa: E402
    InvalidArgumentError,
    JobKind,
    KvTensor,
    Manager,
    Scheduler,
    Worker,
)

try:
    from prometheus_client.core import CollectorRegistry, Metric
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    MISSING = None
except ImportError as e:  # pragma: no cover - depends on the machine
    MISSING = e

PREFIX = "vllm:kv_offload"
LABELS = {"engine": 'e"1\\x\n', "rank": "3"}
PAGE = 4096


def parsed(text):
    """family name -> prometheus_client Metric."""
    return {m.name: m for m in text_string_to_metric_families(text)}


def value(families, family, sample=None, **labels):
    """The value of the one sample of ``family`` named ``sample`` (default: the family's
    counter or gauge sample) with ``labels`` among its labels."""
    m = families[family]
    want = sample or (family + "_total" if m.type == "counter" else family)
    hits = [
        s.value
        for s in m.samples
        if s.name == want and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    if len(hits) != 1:
        raise AssertionError(f"{want} {labels}: {len(hits)} samples in {m.samples}")
    return hits[0]


class Base(unittest.TestCase):
    def setUp(self):
        if MISSING is not None:
            if os.environ.get("KVO_SKIP_PROMETHEUS_TESTS") == "1":
                self.skipTest(f"prometheus_client is not installed ({MISSING})")
            self.fail(
                f"prometheus_client is not installed ({MISSING}): `pip install prometheus-client`"
                " (.ci/run does), or KVO_SKIP_PROMETHEUS_TESTS=1 to skip"
            )

    def assert_labels_everywhere(self, families):
        for m in families.values():
            for s in m.samples:
                self.assertEqual(
                    {k: s.labels[k] for k in LABELS}, LABELS, f"{s.name}: constant labels"
                )

    def assert_dict_matches_parser(self, as_dict, families):
        """metrics() gives what the real parser reads from metrics_text()."""
        self.assertEqual(set(as_dict), set(families))
        for name, m in families.items():
            d = as_dict[name]
            self.assertEqual(d["type"], m.type, name)
            self.assertEqual(d["help"], m.documentation, name)
            self.assertEqual(
                d["samples"], [(s.name, dict(s.labels), s.value) for s in m.samples], name
            )


class WorkerMetricsTest(Base):
    def test_text_parses_and_matches_stats(self):
        kv = ctypes.create_string_buffer(16 * PAGE)
        with Worker([KvTensor.from_buffer(kv, 16, PAGE, PAGE)], num_host_slots=8) as w:
            w.submit_job(1, JobKind.STORE, [0, 1, 2], [0, 1, 2])
            w.submit_job(2, JobKind.STORE, [99], [3])  # outside the tensor: fails
            w.submit_job(3, JobKind.LOAD, [0], [9])
            w.wait([1, 2, 3], timeout_ms=10_000)
            self.assertEqual(len(w.poll()), 3)
            st = w.stats()
            text = w.metrics_text(PREFIX, LABELS)
            families = parsed(text)
            as_dict = w.metrics(PREFIX, LABELS)

        self.assertEqual((st.store.jobs, st.store.failed_jobs, st.store.bytes), (2, 1, 3 * PAGE))
        self.assertEqual((st.load.jobs, st.load.failed_jobs, st.load.bytes), (1, 0, PAGE))
        self.assertEqual(st.store.size_buckets[0], 1)
        self.assertEqual(len(st.store.size_buckets), len(kvoffload.SIZE_BUCKET_BOUNDS) + 1)
        self.assertEqual(st.jobs_in_flight, 0)

        f = families
        self.assertEqual(f[f"{PREFIX}_load_bytes"].type, "counter")
        self.assertEqual(value(f, f"{PREFIX}_load_bytes"), PAGE)
        self.assertEqual(value(f, f"{PREFIX}_store_bytes"), 3 * PAGE)
        self.assertEqual(value(f, f"{PREFIX}_store_jobs"), 2)
        self.assertEqual(value(f, f"{PREFIX}_store_failed_jobs"), 1)
        self.assertEqual(value(f, f"{PREFIX}_load_time"), st.load.seconds)
        self.assertEqual(f[f"{PREFIX}_jobs_in_flight"].type, "gauge")
        self.assertEqual(value(f, f"{PREFIX}_jobs_in_flight"), 0)
        h = f"{PREFIX}_store_size"
        self.assertEqual(f[h].type, "histogram")
        self.assertEqual(value(f, h, h + "_count"), 1)
        self.assertEqual(value(f, h, h + "_sum"), 3 * PAGE)
        buckets = {float(x.labels["le"]): x.value for x in f[h].samples if x.name == h + "_bucket"}
        bounds = [float(b) for b in kvoffload.SIZE_BUCKET_BOUNDS] + [float("inf")]
        self.assertEqual(buckets, {b: 1.0 for b in bounds}, "cumulative buckets")
        lh = f"{PREFIX}_load_size"
        self.assertEqual(value(f, lh, lh + "_bucket", le="+Inf"), 1)
        self.assert_labels_everywhere(f)
        self.assert_dict_matches_parser(as_dict, f)

    def test_bad_arguments(self):
        kv = ctypes.create_string_buffer(4 * PAGE)
        with Worker([KvTensor.from_buffer(kv, 4, PAGE, PAGE)], num_host_slots=2) as w:
            with self.assertRaises(InvalidArgumentError) as cm:
                w.metrics_text("no spaces")
            self.assertIn("prefix", str(cm.exception))
            with self.assertRaises(InvalidArgumentError) as cm:
                w.metrics_text("p", {"le": "1"})
            self.assertIn("labels[0].name", str(cm.exception))
            with self.assertRaises(TypeError):
                w.metrics_text("p", {"rank": 3})
            with self.assertRaises(TypeError):
                w.metrics_text(None)
            self.assertTrue(w.metrics_text("").startswith("# HELP load_bytes_total "))


class SchedulerMetricsTest(Base):
    def test_text_parses_and_matches_stats(self):
        hashes = [i.to_bytes(8, "big") for i in (1, 2)]
        with Scheduler(num_slots=16, key_len=8, gpu_block_size=4) as s:
            s.add_request(7, prompt_tokens=8)
            s.append_block_hashes(7, hashes, num_tokens=8)
            s.match(7, num_computed_tokens=0)
            st = s.stats()
            families = parsed(s.metrics_text(PREFIX, LABELS))
            as_dict = s.metrics(PREFIX, LABELS)
        f = families
        self.assertEqual(value(f, f"{PREFIX}_matches"), st.matches)
        self.assertEqual(value(f, f"{PREFIX}_requests"), st.requests)
        self.assertEqual(value(f, f"{PREFIX}_host_slots"), 16)
        self.assertEqual(value(f, f"{PREFIX}_lookups"), st.manager.lookups)
        for reason in ("jobs_in_flight", "store_in_flight", "being_loaded"):
            self.assertEqual(value(f, f"{PREFIX}_deferred_matches", reason=reason), 0)
        self.assert_labels_everywhere(f)
        self.assert_dict_matches_parser(as_dict, f)
        with Scheduler(num_slots=4, key_len=8) as s:
            with self.assertRaises(InvalidArgumentError) as cm:
                s.metrics_text(PREFIX, {"reason": "x"})
            self.assertIn("labels[0].name", str(cm.exception))


class ManagerMetricsTest(Base):
    def test_text_parses_matches_stats_and_feeds_a_collector(self):
        keys = [i.to_bytes(8, "big") for i in (1, 2, 3)]
        with Manager(num_slots=4, key_len=8) as m:
            m.prepare_store(keys)
            m.complete_store(keys[:2])  # key 3's store stays in flight
            m.lookup(keys[0])
            st = m.stats()
            families = parsed(m.metrics_text(PREFIX, LABELS))
            as_dict = m.metrics(PREFIX, LABELS)
        f = families
        # vLLM's usage: slots not evictable (here key 3, in flight) over capacity.
        self.assertEqual(value(f, f"{PREFIX}_cpu_cache_usage_perc"), 1 / 4)
        self.assertEqual(value(f, f"{PREFIX}_used_slots"), st.used)
        self.assertEqual(value(f, f"{PREFIX}_store_in_flight_slots"), 1)
        self.assertEqual(value(f, f"{PREFIX}_lookups"), st.lookups)
        self.assertEqual(value(f, f"{PREFIX}_stores_skipped"), 0)
        self.assert_labels_everywhere(f)
        self.assert_dict_matches_parser(as_dict, f)

        # A prometheus_client collector built from the dicts exposes the same metrics.
        class Collector:
            def collect(self):
                for name, fam in as_dict.items():
                    metric = Metric(name, fam["help"], fam["type"])
                    for sample, labels, v in fam["samples"]:
                        metric.add_sample(sample, labels, v)
                    yield metric

        registry = CollectorRegistry()
        registry.register(Collector())
        again = parsed(generate_latest(registry).decode())
        self.assertEqual(
            {n: [(s.name, s.labels, s.value) for s in m.samples] for n, m in again.items()},
            {n: [(s.name, s.labels, s.value) for s in m.samples] for n, m in f.items()},
        )


if __name__ == "__main__":
    unittest.main()

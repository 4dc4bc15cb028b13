//! The stats of a manager, a scheduler or a worker as Prometheus text (exposition format 0.0.4),
//! for a host server's `/metrics` endpoint. Names are `<prefix>_<name>` with the caller's prefix
//! (vLLM's is `vllm:kv_offload`) and carry the caller's constant labels (engine, rank, ...).
//! Where vLLM has a metric of the same meaning its name is used (`load_bytes_total`,
//! `load_time_total`, `load_size`, `cpu_cache_usage_perc`, `stores_skipped_total`, ...); the
//! others follow the Prometheus naming rules (`_total` counters, base units). README.md lists
//! them all.

use crate::error::{Error, Result};
use crate::manager::{ALLOCATION_SIZE_BOUNDS, ManagerStats};
use crate::scheduler::SchedulerStats;
use crate::transfer::{DirectionStats, SIZE_BUCKET_BOUNDS, WorkerStats};
use prometheus::core::Desc;
use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};
use prometheus::{Encoder, TextEncoder};
use std::collections::HashMap;

/// A metric prefix and constant labels, checked: the prefix is empty or a metric name
/// (`[a-zA-Z_:][a-zA-Z0-9_:]*`), label names are label names (`[a-zA-Z_][a-zA-Z0-9_]*`), none
/// repeated and none `le` (the histograms' bucket label).
pub struct Naming {
    prefix: String,
    labels: Vec<LabelPair>,
}

impl Naming {
    /// Checks `prefix` and `labels` (name, value pairs, kept in this order). The names are
    /// checked by the `prometheus` crate's descriptor rules.
    pub fn new(prefix: &str, labels: &[(&str, &str)]) -> Result<Self> {
        let probe = if prefix.is_empty() {
            "x".to_owned()
        } else {
            format!("{prefix}_x")
        };
        if let Err(e) = Desc::new(probe, "x".into(), Vec::new(), HashMap::new()) {
            return Err(Error::InvalidArgument(format!("prefix: \"{prefix}\": {e}")));
        }
        for (i, &(name, _)) in labels.iter().enumerate() {
            let one = HashMap::from([(name.to_owned(), String::new())]);
            if let Err(e) = Desc::new("x".into(), "x".into(), Vec::new(), one) {
                return Err(Error::InvalidArgument(format!("labels[{i}].name: {e}")));
            }
            if name == "le" {
                return Err(Error::InvalidArgument(format!(
                    "labels[{i}].name: \"le\" is reserved for histogram buckets"
                )));
            }
            if labels[..i].iter().any(|&(n, _)| n == name) {
                return Err(Error::InvalidArgument(format!(
                    "labels[{i}].name: \"{name}\" is given twice"
                )));
            }
        }
        let labels = labels
            .iter()
            .map(|&(name, value)| {
                let mut p = LabelPair::default();
                p.set_name(name.to_owned());
                p.set_value(value.to_owned());
                p
            })
            .collect();
        Ok(Self {
            prefix: prefix.to_owned(),
            labels,
        })
    }
}

/// Metric families being gathered for one rendering.
struct Families<'a> {
    naming: &'a Naming,
    families: Vec<MetricFamily>,
}

impl<'a> Families<'a> {
    fn new(naming: &'a Naming) -> Self {
        Self {
            naming,
            families: Vec::new(),
        }
    }

    fn family(&mut self, name: &str, help: &str, kind: MetricType, metrics: Vec<Metric>) {
        let mut f = MetricFamily::default();
        f.set_name(if self.naming.prefix.is_empty() {
            name.to_owned()
        } else {
            format!("{}_{name}", self.naming.prefix)
        });
        f.set_help(help.to_owned());
        f.set_field_type(kind);
        f.set_metric(metrics);
        self.families.push(f);
    }

    /// One sample with the constant labels and `extra` labels.
    fn metric(&self, extra: &[(&str, &str)]) -> Metric {
        let mut labels = self.naming.labels.clone();
        for &(name, value) in extra {
            let mut p = LabelPair::default();
            p.set_name(name.to_owned());
            p.set_value(value.to_owned());
            labels.push(p);
        }
        Metric::from_label(labels)
    }

    fn counter(&mut self, name: &str, help: &str, value: f64) {
        let mut m = self.metric(&[]);
        let mut c = Counter::default();
        c.set_value(value);
        m.set_counter(c);
        self.family(name, help, MetricType::COUNTER, vec![m]);
    }

    fn gauge(&mut self, name: &str, help: &str, value: f64) {
        let mut m = self.metric(&[]);
        let mut g = Gauge::default();
        g.set_value(value);
        m.set_gauge(g);
        self.family(name, help, MetricType::GAUGE, vec![m]);
    }

    /// A histogram of transfer sizes from per-bucket (not cumulative) counts.
    fn size_histogram(&mut self, name: &str, help: &str, d: &DirectionStats) {
        self.histogram(
            name,
            help,
            &SIZE_BUCKET_BOUNDS,
            &d.size_buckets,
            d.bytes as f64,
        );
    }

    /// A histogram from per-bucket (not cumulative) `counts`, one per bound and one above the
    /// last bound. The encoder adds the `+Inf` bucket (the sample count).
    fn histogram(&mut self, name: &str, help: &str, bounds: &[u64], counts: &[u64], sum: f64) {
        let mut buckets = Vec::with_capacity(bounds.len());
        let mut cumulative = 0u64;
        for (&bound, &n) in bounds.iter().zip(counts) {
            cumulative += n;
            let mut b = Bucket::default();
            b.set_upper_bound(bound as f64);
            b.set_cumulative_count(cumulative);
            buckets.push(b);
        }
        let mut h = Histogram::default();
        h.set_bucket(buckets);
        h.set_sample_count(counts.iter().sum());
        h.set_sample_sum(sum);
        let mut m = self.metric(&[]);
        m.set_histogram(h);
        self.family(name, help, MetricType::HISTOGRAM, vec![m]);
    }

    fn manager(&mut self, s: &ManagerStats) {
        let usage = if s.capacity == 0 {
            0.0
        } else {
            s.used.saturating_sub(s.evictable) as f64 / s.capacity as f64
        };
        self.gauge(
            "cpu_cache_usage_perc",
            "Fraction of host slots not evictable: store in flight or pinned by a load (vLLM's definition).",
            usage,
        );
        let write_usage = if s.capacity == 0 {
            0.0
        } else {
            s.stores_in_flight as f64 / s.capacity as f64
        };
        self.gauge(
            "cpu_cache_write_usage_perc",
            "Fraction of host slots whose store is in flight (vLLM 0.33's definition).",
            write_usage,
        );
        self.gauge(
            "cpu_cache_read_usage_perc",
            "Fraction of host slots pinned by loads and not by a store: usage minus write usage (vLLM 0.33's definition).",
            (usage - write_usage).max(0.0),
        );
        self.histogram(
            "cpu_allocation_size",
            "Keys to store of each prepare_store that allocated host slots (vLLM 0.33's buckets).",
            &ALLOCATION_SIZE_BOUNDS,
            &s.allocation_size_buckets,
            s.allocation_keys as f64,
        );
        self.gauge("host_slots", "Host slots of the tier.", s.capacity as f64);
        self.gauge(
            "used_slots",
            "Host slots holding a key (ready or store in flight).",
            s.used as f64,
        );
        self.gauge(
            "ready_slots",
            "Host slots whose key is ready to load.",
            s.ready as f64,
        );
        self.gauge(
            "evictable_slots",
            "Ready host slots not pinned by a load.",
            s.evictable as f64,
        );
        self.gauge(
            "pinned_slots",
            "Host slots pinned by at least one load.",
            s.pinned as f64,
        );
        self.gauge(
            "store_in_flight_slots",
            "Host slots whose store is in flight.",
            s.stores_in_flight as f64,
        );
        self.counter("lookups_total", "Keys looked up.", s.lookups as f64);
        self.counter(
            "lookup_hits_total",
            "Key lookups that found the key stored.",
            s.hits as f64,
        );
        self.counter(
            "stores_skipped_total",
            "Keys not stored because of the store threshold.",
            s.stores_skipped as f64,
        );
        self.counter("evictions_total", "Keys evicted.", s.evictions as f64);
    }

    fn scheduler(&mut self, s: &SchedulerStats) {
        self.gauge(
            "requests",
            "Requests tracked (finished ones with jobs in flight included).",
            s.requests as f64,
        );
        self.counter("matches_total", "Matches answered.", s.matches as f64);
        let deferred: Vec<Metric> = [
            ("jobs_in_flight", s.deferred_jobs_in_flight),
            ("store_in_flight", s.deferred_store_in_flight),
            ("being_loaded", s.deferred_being_loaded),
        ]
        .iter()
        .map(|&(reason, n)| {
            let mut m = self.metric(&[("reason", reason)]);
            let mut c = Counter::default();
            c.set_value(n as f64);
            m.set_counter(c);
            m
        })
        .collect();
        self.family(
            "deferred_matches_total",
            "Matches answered DEFER, by reason.",
            MetricType::COUNTER,
            deferred,
        );
        self.counter(
            "match_hits_total",
            "Matches answering a hit.",
            s.hits as f64,
        );
        self.counter(
            "hit_tokens_total",
            "Tokens of the hits (to be loaded).",
            s.hit_tokens as f64,
        );
        self.counter(
            "load_jobs_scheduled_total",
            "Load jobs made.",
            s.load_jobs as f64,
        );
        self.counter(
            "store_jobs_scheduled_total",
            "Store jobs made.",
            s.store_jobs as f64,
        );
        self.counter(
            "stored_chunks_total",
            "Chunks the store jobs offload.",
            s.stored_chunks as f64,
        );
        self.counter(
            "store_no_room_total",
            "Store attempts answered no room (retried later).",
            s.store_no_room as f64,
        );
        self.counter(
            "jobs_reported_failed_total",
            "Jobs whose completion reported a failure.",
            s.failed_jobs as f64,
        );
        self.gauge(
            "loads_in_flight",
            "Load jobs in flight.",
            s.loads_in_flight as f64,
        );
        self.gauge(
            "stores_in_flight",
            "Store jobs in flight.",
            s.stores_in_flight as f64,
        );
        self.manager(&s.manager);
    }

    fn worker(&mut self, s: &WorkerStats) {
        for (dir, d, what) in [
            ("load", &s.load, "host tier to KV cache"),
            ("store", &s.store, "KV cache to host tier"),
        ] {
            self.counter(
                &format!("{dir}_bytes_total"),
                &format!("Bytes copied {what} by jobs that succeeded."),
                d.bytes as f64,
            );
            self.counter(
                &format!("{dir}_time_total"),
                &format!("Seconds spent copying {what} by jobs that succeeded."),
                d.seconds,
            );
            self.size_histogram(
                &format!("{dir}_size"),
                &format!("Bytes per job copying {what} (jobs that succeeded)."),
                d,
            );
            self.counter(
                &format!("{dir}_jobs_total"),
                &format!("Jobs copying {what} finished, failed ones included."),
                d.jobs as f64,
            );
            self.counter(
                &format!("{dir}_failed_jobs_total"),
                &format!("Jobs copying {what} that failed."),
                d.failed_jobs as f64,
            );
        }
        self.gauge(
            "jobs_in_flight",
            "Jobs submitted and not yet reported.",
            s.jobs_in_flight as f64,
        );
    }

    fn render(self, out: &mut String) -> Result<()> {
        let mut bytes = Vec::new();
        TextEncoder::new()
            .encode(&self.families, &mut bytes)
            .map_err(|e| Error::Internal(format!("prometheus text: {e}")))?;
        out.push_str(
            std::str::from_utf8(&bytes)
                .map_err(|e| Error::Internal(format!("prometheus text: {e}")))?,
        );
        Ok(())
    }
}

/// Appends a manager's metrics to `out`.
pub fn manager_text(naming: &Naming, s: &ManagerStats, out: &mut String) -> Result<()> {
    let mut f = Families::new(naming);
    f.manager(s);
    f.render(out)
}

/// Appends a scheduler's metrics, its tier's (the manager's) included, to `out`. Fails for a
/// constant label named `reason` (the label of `deferred_matches_total`).
pub fn scheduler_text(naming: &Naming, s: &SchedulerStats, out: &mut String) -> Result<()> {
    if let Some(i) = naming.labels.iter().position(|l| l.name() == "reason") {
        return Err(Error::InvalidArgument(format!(
            "labels[{i}].name: \"reason\" is the label of deferred_matches_total"
        )));
    }
    let mut f = Families::new(naming);
    f.scheduler(s);
    f.render(out)
}

/// Appends a worker's metrics to `out`.
pub fn worker_text(naming: &Naming, s: &WorkerStats, out: &mut String) -> Result<()> {
    let mut f = Families::new(naming);
    f.worker(s);
    f.render(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_labels_are_checked() {
        assert!(Naming::new("vllm:kv_offload", &[("engine", "0"), ("rank", "1")]).is_ok());
        assert!(Naming::new("", &[]).is_ok());
        for (prefix, labels, what) in [
            ("1x", &[][..], "prefix"),
            ("a-b", &[][..], "prefix"),
            ("ok", &[("le", "1")][..], "labels[0].name"),
            ("ok", &[("a", "1"), ("a", "2")][..], "labels[1].name"),
            ("ok", &[("a:b", "1")][..], "labels[0].name"),
            ("ok", &[("a", "1"), ("", "1")][..], "labels[1].name"),
        ] {
            let e = Naming::new(prefix, labels).err().expect(what);
            assert!(e.to_string().starts_with(what), "{what}: {e}");
        }
    }

    #[test]
    fn worker_text_has_vllm_names_labels_and_cumulative_buckets() {
        let mut s = WorkerStats::default();
        s.load.jobs = 3;
        s.load.failed_jobs = 1;
        s.load.bytes = 7_000_000;
        s.load.seconds = 0.25;
        s.load.size_buckets[0] = 1;
        s.load.size_buckets[2] = 1;
        s.jobs_in_flight = 2;
        let n = Naming::new("vllm:kv_offload", &[("engine", "a\"b")]).unwrap();
        let mut out = String::new();
        worker_text(&n, &s, &mut out).unwrap();
        for line in [
            "# TYPE vllm:kv_offload_load_bytes_total counter",
            "vllm:kv_offload_load_bytes_total{engine=\"a\\\"b\"} 7000000",
            "vllm:kv_offload_load_time_total{engine=\"a\\\"b\"} 0.25",
            "# TYPE vllm:kv_offload_load_size histogram",
            "vllm:kv_offload_load_size_bucket{engine=\"a\\\"b\",le=\"1000000\"} 1",
            "vllm:kv_offload_load_size_bucket{engine=\"a\\\"b\",le=\"5000000\"} 1",
            "vllm:kv_offload_load_size_bucket{engine=\"a\\\"b\",le=\"10000000\"} 2",
            "vllm:kv_offload_load_size_bucket{engine=\"a\\\"b\",le=\"+Inf\"} 2",
            "vllm:kv_offload_load_size_count{engine=\"a\\\"b\"} 2",
            "vllm:kv_offload_load_failed_jobs_total{engine=\"a\\\"b\"} 1",
            "vllm:kv_offload_jobs_in_flight{engine=\"a\\\"b\"} 2",
        ] {
            assert!(out.lines().any(|l| l == line), "missing {line:?} in\n{out}");
        }
    }

    #[test]
    fn usage_is_vllms_non_evictable_fraction() {
        let s = ManagerStats {
            capacity: 4,
            used: 3,
            evictable: 1,
            ..ManagerStats::default()
        };
        let mut out = String::new();
        manager_text(&Naming::new("p", &[]).unwrap(), &s, &mut out).unwrap();
        assert!(out.contains("\np_cpu_cache_usage_perc 0.5\n"), "{out}");
        let mut out = String::new();
        manager_text(
            &Naming::new("p", &[]).unwrap(),
            &ManagerStats::default(),
            &mut out,
        )
        .unwrap();
        assert!(out.contains("\np_cpu_cache_usage_perc 0\n"), "{out}");
    }
}

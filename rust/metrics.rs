//! Prometheus metrics under vLLM's names (so GIE/llm-d schedulers and GPUStack's vLLM mapping work unchanged),
//! plus `deepinfer_*` internals. Hot-path updates are atomic; gauges that mirror rank state are read at scrape
//! time, so nothing here takes the GIL or a rank lock.

use crate::ring::Ring;
use crate::ring::status::{
    AUX_HEARTBEAT_MS, AUX_KV_USAGE_PPM, AUX_PREEMPTIONS, AUX_QUEUED_TOKENS, AUX_REABORTS, AUX_REQUESTS,
    AUX_SPEC_ACCEPTED_TOKENS, AUX_SPEC_DRAFT_TOKENS, monotonic_ms,
};
use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};
use std::time::Duration;

/// What a scrape reads of one rank (`RankLink::view`): its requests in flight, and its two rings, whose status words
/// the rank keeps.
pub struct RankView<'a> {
    pub index: usize,
    pub in_flight: usize,
    pub requests: &'a Ring,
    pub output: &'a Ring,
}

pub struct Metrics {
    registry: Registry,
    running: IntGauge,
    waiting: IntGauge,
    kv_usage: Gauge,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub success: IntCounterVec,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue: Histogram,
    /// The TTFT breakdown (`crate::ttft`), and vLLM's name for its prefill stage.
    ttft_stages: HistogramVec,
    prefill: Histogram,
    pub rejected: IntCounterVec,
    pub aborted: IntCounterVec,
    rank_requests: IntGaugeVec,
    rank_queued_tokens: IntGaugeVec,
    rank_engine_requests: IntGaugeVec,
    rank_heartbeat_age: GaugeVec,
    ring_used: IntGaugeVec,
    spec_draft_tokens: IntCounter,
    spec_accepted_tokens: IntCounter,
    preemptions: IntCounter,
    reaborts: IntCounter,
    healthy: IntGauge,
    capacity: IntGauge,
    /// The last five minutes, second by second, for the console (`crate::pulse`).
    pub pulse: crate::pulse::Pulse,
    /// Spans exported, and dropped (queue full, or the collector could not be reached): `crate::trace`.
    pub trace_spans: crate::trace::Counters,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
];
const STAGE_BUCKETS: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 120.0,
];
const ITL_BUCKETS: &[f64] =
    &[0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5];

impl Metrics {
    pub fn new(model_name: &str) -> Self {
        let registry = Registry::new();
        let opts = |name: &str, help: &str| Opts::new(name, help).const_label("model_name", model_name);
        let hist = |name: &str, help: &str, buckets: &[f64]| {
            Histogram::with_opts(
                HistogramOpts::new(name, help).const_label("model_name", model_name).buckets(buckets.to_vec()),
            )
            .expect("valid histogram")
        };
        let m = Metrics {
            running: IntGauge::with_opts(opts("vllm:num_requests_running", "Requests running on the engine ranks."))
                .unwrap(),
            waiting: IntGauge::with_opts(opts(
                "vllm:num_requests_waiting",
                "Requests waiting for a slot: in the wait queue, or admitted and waiting for a batch slot on a rank.",
            ))
            .unwrap(),
            kv_usage: Gauge::with_opts(opts(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage (0-1), highest over the ranks.",
            ))
            .unwrap(),
            prompt_tokens: IntCounter::with_opts(opts("vllm:prompt_tokens_total", "Prompt tokens processed.")).unwrap(),
            generation_tokens: IntCounter::with_opts(opts("vllm:generation_tokens_total", "Tokens generated."))
                .unwrap(),
            success: IntCounterVec::new(
                opts("vllm:request_success_total", "Requests that finished, by finish reason."),
                &["finished_reason"],
            )
            .unwrap(),
            ttft: hist("vllm:time_to_first_token_seconds", "Arrival to first generated token.", LATENCY_BUCKETS),
            itl: hist("vllm:inter_token_latency_seconds", "Time between generated tokens.", ITL_BUCKETS),
            e2e: hist("vllm:e2e_request_latency_seconds", "Arrival to the last token.", LATENCY_BUCKETS),
            queue: hist(
                "vllm:request_queue_time_seconds",
                "Arrival until the request is handed to its rank (checks, the wait queue, conversion, encoding).",
                LATENCY_BUCKETS,
            ),
            ttft_stages: HistogramVec::new(
                HistogramOpts::new(
                    "deepinfer_ttft_stage_seconds",
                    "Where the time to first token goes, by stage: parse, queue, encode, dispatch, ring, \
                     engine_queue, prefill, publish (they add up to the TTFT), then sse (first token read to its \
                     event written, streams).",
                )
                .buckets(STAGE_BUCKETS.to_vec()),
                &["stage"],
            )
            .unwrap(),
            prefill: hist(
                "vllm:request_prefill_time_seconds",
                "From the engine step that starts the request's prefill to its first token, on the rank.",
                STAGE_BUCKETS,
            ),
            rejected: IntCounterVec::new(
                Opts::new("deepinfer_rejected_requests_total", "Requests refused before running, by reason."),
                &["reason"],
            )
            .unwrap(),
            aborted: IntCounterVec::new(
                Opts::new("deepinfer_aborted_requests_total", "Requests stopped before the engine finished them."),
                &["reason"],
            )
            .unwrap(),
            rank_requests: IntGaugeVec::new(
                Opts::new("deepinfer_rank_requests", "Requests in flight per data-parallel rank."),
                &["rank"],
            )
            .unwrap(),
            rank_queued_tokens: IntGaugeVec::new(
                Opts::new("deepinfer_rank_queued_prefill_tokens", "Prompt tokens a rank still has to prefill."),
                &["rank"],
            )
            .unwrap(),
            rank_engine_requests: IntGaugeVec::new(
                Opts::new(
                    "deepinfer_rank_engine_requests",
                    "Requests the rank's engine holds (running + waiting), as the rank reports it.",
                ),
                &["rank"],
            )
            .unwrap(),
            rank_heartbeat_age: GaugeVec::new(
                Opts::new(
                    "deepinfer_rank_heartbeat_age_seconds",
                    "Seconds since the rank's loop last reported in (grows while a rank hangs).",
                ),
                &["rank"],
            )
            .unwrap(),
            ring_used: IntGaugeVec::new(
                Opts::new("deepinfer_ring_used_bytes", "Unread bytes in a rank's shared-memory ring."),
                &["rank", "ring"],
            )
            .unwrap(),
            spec_draft_tokens: IntCounter::with_opts(opts(
                "vllm:spec_decode_num_draft_tokens_total",
                "Draft tokens proposed by speculative decoding.",
            ))
            .unwrap(),
            spec_accepted_tokens: IntCounter::with_opts(opts(
                "vllm:spec_decode_num_accepted_tokens_total",
                "Draft tokens accepted (emitted) by speculative decoding.",
            ))
            .unwrap(),
            preemptions: IntCounter::with_opts(opts(
                "vllm:num_preemptions_total",
                "Sequences the engine preempted (their KV freed; they are recomputed).",
            ))
            .unwrap(),
            reaborts: IntCounter::new(
                "deepinfer_engine_reaborted_requests_total",
                "Aborts the engine lost (the request kept running), sent again by the rank.",
            )
            .unwrap(),
            healthy: IntGauge::new(
                "deepinfer_healthy",
                "1 while GET /health answers 200 (every rank running, not draining), else 0.",
            )
            .unwrap(),
            capacity: IntGauge::new(
                "deepinfer_capacity_requests",
                "Requests admitted at once before a 429: data-parallel ranks x --max-num-seqs.",
            )
            .unwrap(),
            pulse: Default::default(),
            trace_spans: crate::trace::Counters {
                exported: IntCounter::new("deepinfer_trace_spans_exported_total", "Trace spans exported over OTLP.")
                    .unwrap(),
                dropped: IntCounter::new(
                    "deepinfer_trace_spans_dropped_total",
                    "Trace spans dropped: the export queue was full, or the OTLP endpoint failed or could not be reached.",
                )
                .unwrap(),
            },
            registry,
        };
        m.register_all();
        for stage in crate::ttft::STAGES {
            m.ttft_stages.with_label_values(&[stage]);
        }
        // Export every label value from the start, so dashboards and rate() see zeros rather than gaps.
        for reason in ["stop", "length"] {
            m.success.with_label_values(&[reason]);
        }
        for reason in [
            "invalid_request_error",
            "model_not_found",
            "payload_too_large",
            "rate_limit_exceeded",
            "queue_full",
            "queue_timeout",
            "unsupported_media_type",
        ] {
            m.rejected.with_label_values(&[reason]);
        }
        for reason in [
            "client_disconnect",
            "slow_reader",
            "timeout",
            "engine_error",
            "engine_abort",
            "prompt_length_exceeded",
            "insufficient_system_resource",
            "grammar_error",
            "ve_error",
            "prompt_logprobs_unavailable",
            "rank_failure",
            "rank_hung",
            "shutdown",
            "abort_request",
        ] {
            m.aborted.with_label_values(&[reason]);
        }
        m
    }

    fn register_all(&self) {
        let r = &self.registry;
        let all: Vec<Box<dyn prometheus::core::Collector>> = vec![
            Box::new(self.running.clone()),
            Box::new(self.waiting.clone()),
            Box::new(self.kv_usage.clone()),
            Box::new(self.prompt_tokens.clone()),
            Box::new(self.generation_tokens.clone()),
            Box::new(self.success.clone()),
            Box::new(self.ttft.clone()),
            Box::new(self.itl.clone()),
            Box::new(self.e2e.clone()),
            Box::new(self.queue.clone()),
            Box::new(self.ttft_stages.clone()),
            Box::new(self.prefill.clone()),
            Box::new(self.rejected.clone()),
            Box::new(self.aborted.clone()),
            Box::new(self.rank_requests.clone()),
            Box::new(self.rank_queued_tokens.clone()),
            Box::new(self.rank_engine_requests.clone()),
            Box::new(self.rank_heartbeat_age.clone()),
            Box::new(self.ring_used.clone()),
            Box::new(self.spec_draft_tokens.clone()),
            Box::new(self.spec_accepted_tokens.clone()),
            Box::new(self.preemptions.clone()),
            Box::new(self.reaborts.clone()),
            Box::new(self.healthy.clone()),
            Box::new(self.capacity.clone()),
            Box::new(self.trace_spans.exported.clone()),
            Box::new(self.trace_spans.dropped.clone()),
        ];
        for c in all {
            r.register(c).expect("unique metric names");
        }
    }

    /// Observe a request's TTFT stages (`Stamps::stages`).
    pub fn observe_ttft_stages(&self, stages: &[(&'static str, Duration)]) {
        for (stage, d) in stages {
            self.ttft_stages.with_label_values(&[stage]).observe(d.as_secs_f64());
            if *stage == "prefill" {
                self.prefill.observe(d.as_secs_f64());
            }
        }
    }

    /// The `sse` stage's histogram, for the stream that observes it when its first token's event is written.
    pub fn sse_stage(&self) -> Histogram {
        self.ttft_stages.with_label_values(&["sse"])
    }

    /// A request's first token came `ttft` after it arrived.
    pub fn observe_ttft(&self, ttft: Duration) {
        self.ttft.observe(ttft.as_secs_f64());
        self.pulse.first_token(ttft);
    }

    /// A request ended with its last token (`reason`: stop or length).
    pub fn observe_success(&self, reason: &str) {
        self.success.with_label_values(&[reason]).inc();
        self.pulse.finished();
    }

    /// Observe `n` tokens that arrived `gap` after the previous ones.
    pub fn observe_tokens(&self, n: usize, gap: Option<Duration>) {
        self.generation_tokens.inc_by(n as u64);
        self.pulse.tokens(n, gap);
        if let Some(gap) = gap
            && n > 0
        {
            let each = gap.as_secs_f64() / n as f64;
            for _ in 0..n {
                self.itl.observe(each);
            }
        }
    }

    fn advance(counter: &IntCounter, total: u64) {
        let now = counter.get();
        if total > now {
            counter.inc_by(total - now);
        }
    }

    /// The text exposition, with the rank-state gauges refreshed first. `queued`: requests in the admission wait
    /// queue; `healthy`: what /health would say.
    pub fn render(&self, ranks: &[RankView<'_>], max_num_seqs: usize, queued: usize, healthy: bool) -> String {
        self.healthy.set(i64::from(healthy));
        self.capacity.set((ranks.len() * max_num_seqs) as i64);
        let (mut running, mut waiting, mut kv) = (0usize, 0usize, 0f64);
        let (mut drafted, mut accepted, mut preempted, mut reaborted) = (0u64, 0u64, 0u64, 0u64);
        let now_ms = monotonic_ms();
        for link in ranks {
            let n = link.in_flight;
            let rank = link.index.to_string();
            running += n.min(max_num_seqs);
            waiting += n.saturating_sub(max_num_seqs);
            kv = kv.max(link.output.aux(AUX_KV_USAGE_PPM) as f64 / 1e6);
            self.rank_requests.with_label_values(&[&rank]).set(n as i64);
            self.rank_queued_tokens.with_label_values(&[&rank]).set(link.output.aux(AUX_QUEUED_TOKENS) as i64);
            self.rank_engine_requests.with_label_values(&[&rank]).set(link.output.aux(AUX_REQUESTS) as i64);
            let age_ms = now_ms.saturating_sub(link.output.aux(AUX_HEARTBEAT_MS));
            self.rank_heartbeat_age.with_label_values(&[&rank]).set(age_ms as f64 / 1e3);
            self.ring_used.with_label_values(&[&rank, "request"]).set(link.requests.used_bytes() as i64);
            self.ring_used.with_label_values(&[&rank, "output"]).set(link.output.used_bytes() as i64);
            drafted += link.output.aux(AUX_SPEC_DRAFT_TOKENS);
            accepted += link.output.aux(AUX_SPEC_ACCEPTED_TOKENS);
            preempted += link.output.aux(AUX_PREEMPTIONS);
            reaborted += link.output.aux(AUX_REABORTS);
        }
        // The ranks keep running totals; a counter only moves forward (renders may race: the larger wins).
        Self::advance(&self.spec_draft_tokens, drafted);
        Self::advance(&self.spec_accepted_tokens, accepted);
        Self::advance(&self.preemptions, preempted);
        Self::advance(&self.reaborts, reaborted);
        self.running.set(running as i64);
        self.waiting.set((waiting + queued) as i64);
        self.kv_usage.set(kv);
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        String::from_utf8(out).unwrap_or_default()
    }
}

//! A dispatcher over real rings in a temporary directory, and a request for it, for the tests of its users.

use super::gather::GatherPolicy;
use super::{Dispatcher, Job, RankLink, RequestMeta, Ticket};
use crate::admission::Admission;
use crate::metrics::Metrics;
use crate::ring::Ring;
use crate::ring::records::Submit;
use crate::stream::Outlet;
use pyo3::prelude::*;
use std::sync::Arc;
use std::time::Instant;

pub fn dispatcher(dir: &std::path::Path, ranks: usize) -> Arc<Dispatcher> {
    gathering(dir, ranks, GatherPolicy::OFF)
}

pub fn gathering(dir: &std::path::Path, ranks: usize, policy: GatherPolicy) -> Arc<Dispatcher> {
    let links = (0..ranks)
        .map(|i| {
            let req = Arc::new(Ring::create(dir.join(format!("q{i}")), 1 << 16).unwrap());
            let out = Arc::new(Ring::create(dir.join(format!("o{i}")), 1 << 16).unwrap());
            RankLink::new(i, req, out, None)
        })
        .collect();
    Dispatcher::with_gather(links, Arc::new(Metrics::new("m")), policy)
}

/// Submit a three-token prompt.
pub fn submit(d: &Arc<Dispatcher>, admission: &Admission) -> Ticket {
    let (outlet, _) = Outlet::unary();
    let decoder = Python::attach(|py| py.None());
    let prompt = [1u32, 2, 3];
    let submit = Submit {
        request_id: 0,
        prompt: &prompt[..],
        max_tokens: 4,
        temperature: 1.0,
        top_p: 1.0,
        top_k: -1,
        seed: None,
        ignore_eos: false,
        logprobs: None,
        prompt_logprobs: false,
        constraint: None,
        images: None,
    };
    let now = Instant::now();
    let meta = RequestMeta {
        id: d.next_id(),
        request_id: "r".into(),
        arrival: now,
        parsed: now,
        admitted: now,
        on_finish: None,
        trace: None,
        abortable: true,
    };
    let permit = admission.try_admit().unwrap();
    d.submit(meta, Job { submit, incremental: true }, decoder, outlet, permit).unwrap()
}

//! Prometheus text exposition helpers shared by every metrics family the
//! agent exports (`agent::metrics`, `lb::metrics`): one constant counter or
//! gauge, or a family of labelled samples, through `prometheus-client`'s
//! encoder.

use prometheus_client::{
    encoding::{DescriptorEncoder, EncodeMetric as _, MetricEncoder},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
};

pub type Fmt = Result<(), std::fmt::Error>;

pub fn counter(enc: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> Fmt {
    let c = ConstCounter::new(v);
    c.encode(enc.encode_descriptor(name, help, None, c.metric_type())?)
}

pub fn gauge<N: prometheus_client::encoding::EncodeGaugeValue>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: N,
) -> Fmt {
    let g = ConstGauge::new(v);
    g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)
}

/// One family: a sample per label set.
pub fn family<'a, V>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    samples: impl IntoIterator<Item = (Vec<(&'a str, &'a str)>, V)>,
    sample: impl Fn(MetricEncoder, V) -> Fmt,
) -> Fmt {
    let mut fam = enc.encode_descriptor(name, help, None, kind)?;
    for (labels, v) in samples {
        sample(fam.encode_family(&labels)?, v)?;
    }
    Ok(())
}

pub fn const_counter(e: MetricEncoder, v: u64) -> Fmt {
    ConstCounter::new(v).encode(e)
}

pub fn const_gauge(e: MetricEncoder, v: u64) -> Fmt {
    ConstGauge::new(v).encode(e)
}

//! Medians with their range, the figure every section reports.

#[derive(Clone, Copy)]
pub(crate) struct Stat {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

pub(crate) fn stat(mut v: Vec<f64>) -> Stat {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Stat {
        median: v[v.len() / 2],
        min: v[0],
        max: v[v.len() - 1],
    }
}

//! Rate over time, as a job's report and a server's status page keep it:
//! cumulative counts taken at moments in time. At most [`POINTS`] are kept.
//! A run's history ([`History::new`]) spans the whole run: when full, every
//! other point is dropped and points are then taken half as often. A
//! server's ([`History::recent`]) spans the last [`POINTS`] intervals, so a
//! transfer that just started fills its chart instead of being a sliver of
//! the server's uptime. [`Rates`] reads the rate now and the peak from
//! either, once, for every place that shows them.

use serde::{Deserialize, Serialize};
use std::sync::Mutex;
use std::time::Instant;

/// Most points kept.
pub const POINTS: usize = 600;

/// One point: seconds since the history began, and the counts then.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub t: f64,
    pub bytes: u64,
    pub files: u64,
}

/// A bounded history of cumulative counts.
pub struct History {
    began: Instant,
    inner: Mutex<Points>,
}

struct Points {
    points: Vec<Point>,
    /// Least time between two points kept, in seconds.
    every: f64,
    /// Whether old points are dropped (a window of recent ones) rather
    /// than thinned out (the whole run).
    sliding: bool,
}

impl Default for History {
    fn default() -> History {
        History::new(1.0)
    }
}

impl History {
    /// A history that keeps a point at most every `every` seconds.
    pub fn new(every: f64) -> History {
        History { began: Instant::now(), inner: Mutex::new(Points { points: Vec::new(), every, sliding: false }) }
    }

    /// A history of the last [`POINTS`] points taken at most every `every`
    /// seconds (10 minutes at 1 s): older ones are dropped.
    pub fn recent(every: f64) -> History {
        History { began: Instant::now(), inner: Mutex::new(Points { points: Vec::new(), every, sliding: true }) }
    }

    /// Notes the counts now and returns the points so far. The last point
    /// is always the latest noted; the others are at least `every` apart.
    pub fn note(&self, bytes: u64, files: u64) -> Vec<Point> {
        self.note_at(self.began.elapsed().as_secs_f64(), bytes, files)
    }

    fn note_at(&self, t: f64, bytes: u64, files: u64) -> Vec<Point> {
        let mut p = self.inner.lock().expect("history lock");
        let point = Point { t, bytes, files };
        let n = p.points.len();
        if n >= 2 && t - p.points[n - 2].t < p.every {
            p.points[n - 1] = point;
        } else {
            if n == POINTS && p.sliding {
                p.points.remove(0);
            } else if n == POINTS {
                let kept: Vec<Point> = p.points.iter().step_by(2).copied().collect();
                p.points = kept;
                p.every *= 2.0;
            }
            p.points.push(point);
        }
        p.points.clone()
    }
}

/// How long the rate "now" is taken over: long enough to smooth out one
/// file or block arriving, short enough to follow a change.
pub const NOW_SPAN: f64 = 5.0;

/// The rate of a history's bytes now and at its highest, in bytes per
/// second, worked out here once for every place that shows them (the
/// status text, the web page, `--json`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Rates {
    /// Over the last [`NOW_SPAN`] seconds of the history (or its whole
    /// span if shorter).
    pub now_bytes_per_s: f64,
    /// The highest between two points at least a second apart.
    pub peak_bytes_per_s: f64,
}

impl Rates {
    pub fn of(points: &[Point]) -> Rates {
        let rate = |a: &Point, b: &Point| (b.bytes.saturating_sub(a.bytes)) as f64 / (b.t - a.t);
        let Some(last) = points.last() else { return Rates::default() };
        let now = points.iter().rev().find(|p| last.t - p.t >= NOW_SPAN).or(points.first()).filter(|p| last.t > p.t);
        let mut peak = 0f64;
        let mut from = 0;
        for (i, p) in points.iter().enumerate().skip(1) {
            // Points closer than a second are joined to the next, so that
            // one block landing in a few milliseconds is no peak.
            if p.t - points[from].t >= 1.0 {
                peak = peak.max(rate(&points[from], p));
                from = i;
            }
        }
        let now = now.map_or(0.0, |p| rate(p, last));
        Rates { now_bytes_per_s: now, peak_bytes_per_s: peak.max(now) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_stay_bounded_and_span_the_whole_run() {
        let h = History::new(1.0);
        assert_eq!(h.note_at(0.0, 0, 0).len(), 1);
        assert_eq!(h.note_at(0.5, 5, 1).len(), 2);
        let p = h.note_at(0.7, 7, 1);
        assert_eq!(p.len(), 2, "too soon after the first: the last point moves on");
        assert_eq!(p[1], Point { t: 0.7, bytes: 7, files: 1 });
        let mut last = Vec::new();
        for s in 1..20_000u64 {
            last = h.note_at(s as f64 / 2.0, s * 10, s);
            assert!(last.len() <= POINTS);
        }
        assert_eq!(last[0].t, 0.0, "the start is kept");
        assert_eq!(*last.last().unwrap(), Point { t: 19_999.0 / 2.0, bytes: 199_990, files: 19_999 }, "the last point is the latest");
        assert!(last.windows(2).all(|w| w[0].t < w[1].t && w[0].bytes <= w[1].bytes));
        assert!(last.len() > POINTS / 2, "thinned out no more than needed: {}", last.len());
    }

    #[test]
    fn a_recent_history_keeps_the_last_points_at_full_resolution() {
        let h = History::recent(1.0);
        let mut last = Vec::new();
        for s in 0..2_000u64 {
            last = h.note_at(s as f64, s * 10, s);
        }
        assert_eq!(last.len(), POINTS);
        assert_eq!(last[0].t, (2_000 - POINTS) as f64, "the oldest points are dropped");
        assert!(last.windows(2).all(|w| w[1].t - w[0].t == 1.0), "no point is thinned out");
    }

    #[test]
    fn rates_are_the_last_seconds_and_the_highest_second() {
        let p = |t: f64, bytes: u64| Point { t, bytes, files: 0 };
        // 1 MB/s for 10 s, 3 MB in the 11th second, then 2 MB/s for 6 s.
        let mut points: Vec<Point> = (0..=10).map(|s| p(s as f64, s * 1_000_000)).collect();
        points.push(p(11.0, 13_000_000));
        points.extend((1..=6).map(|s| p(11.0 + s as f64, 13_000_000 + s * 2_000_000)));
        let r = Rates::of(&points);
        assert!((r.now_bytes_per_s - 2e6).abs() < 1.0, "{r:?}");
        assert!((r.peak_bytes_per_s - 3e6).abs() < 1.0, "{r:?}");
        // A block landing within 10 ms of the last point is not a peak of 100 MB/s.
        points.push(p(17.01, 14_000_000));
        assert!(Rates::of(&points).peak_bytes_per_s < 3.1e6, "{:?}", Rates::of(&points));
        assert_eq!(Rates::of(&[]), Rates::default());
        assert_eq!(Rates::of(&[p(3.0, 5)]), Rates::default());
    }
}

//! Rate over time, as a job's report and a server's status page keep it:
//! cumulative counts taken at moments in time. At most [`POINTS`] are kept: when full, every other
//! point is dropped and points are then taken half as often, so the chart
//! always spans the whole run in bounded memory.

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
}

impl Default for History {
    fn default() -> History {
        History::new(1.0)
    }
}

impl History {
    /// A history that keeps a point at most every `every` seconds.
    pub fn new(every: f64) -> History {
        History { began: Instant::now(), inner: Mutex::new(Points { points: Vec::new(), every }) }
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
            if n == POINTS {
                let kept: Vec<Point> = p.points.iter().step_by(2).copied().collect();
                p.points = kept;
                p.every *= 2.0;
            }
            p.points.push(point);
        }
        p.points.clone()
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
}

//! The steady-state goodput of N parallel TCP Reno connections over one
//! bottleneck (eqs. (1) and (2) of Ito et al., after Hacker et al.): the
//! smaller of the socket-buffer bound `N·W/R` and the loss-limited rate at
//! the loss probability N connections cause on a link of rate B.
//!
//! Rates are in bytes per second, times in seconds, sizes in bytes.

/// Packet length the model counts in (the paper's 1,500 bytes).
pub const PACKET: f64 = 1500.0;

/// Eq. (2): the loss probability `p*` that N connections cause on a link of
/// rate `b` with round-trip time `r`; `None` where the model does not apply
/// (less than about one packet in flight per connection).
pub fn loss_probability(b: f64, r: f64, n: f64) -> Option<f64> {
    let x = b * r / (n * PACKET);
    let d = -2.0 + 2.0 * x + 2.0 / 3.0 * x * x;
    (d > 1.0).then(|| 1.0 / d)
}

/// The second term of eq. (1): the loss-limited goodput of `n` connections.
pub fn loss_limited(b: f64, r: f64, n: f64) -> f64 {
    match loss_probability(b, r, n) {
        Some(p) => n * (1.0 - p) / (2.0 * r) * (-3.0 + (6.0 + 21.0 * p).sqrt() / p.sqrt()) * PACKET,
        None => 0.0,
    }
}

/// Eq. (1): the goodput of `n` connections with socket buffer `w`.
pub fn goodput(b: f64, r: f64, w: f64, n: f64) -> f64 {
    (n * w / r).min(loss_limited(b, r, n))
}

/// The stream count in `1..=max` that maximises eq. (1); the smallest of
/// those within 0.1 % of the best.
pub fn best_streams(b: f64, r: f64, w: f64, max: usize) -> usize {
    let g: Vec<f64> = (1..=max.max(1)).map(|n| goodput(b, r, w, n as f64)).collect();
    let top = g.iter().cloned().fold(0.0, f64::max);
    g.iter().position(|&v| v >= top * 0.999).map_or(1, |i| i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MBIT: f64 = 1e6 / 8.0;

    #[test]
    fn one_buffer_limited_stream_gets_w_over_r() {
        let g = goodput(100.0 * MBIT, 0.02, 65536.0, 1.0);
        assert!((g - 65536.0 / 0.02).abs() < 1.0, "{g}");
    }

    #[test]
    fn loss_limited_rate_approaches_the_link_rate_for_few_streams() {
        let g = loss_limited(100.0 * MBIT, 0.02, 1.0);
        assert!(g > 0.95 * 100.0 * MBIT && g < 100.0 * MBIT, "{}", g / MBIT);
        // More streams push the loss rate up and the goodput down.
        assert!(loss_limited(100.0 * MBIT, 0.02, 32.0) < g);
    }

    #[test]
    fn the_optimum_is_where_the_buffer_bound_meets_the_link() {
        // 100 Mbit/s, 20 ms, 64 KiB: 3 streams give 78.6 Mbit/s, 4 fill the link.
        assert_eq!(best_streams(100.0 * MBIT, 0.02, 65536.0, 64), 4);
        // A longer round trip needs more.
        assert_eq!(best_streams(100.0 * MBIT, 0.04, 65536.0, 64), 8);
        // A big buffer needs one.
        assert_eq!(best_streams(100.0 * MBIT, 0.02, 4.0 * 1048576.0, 64), 1);
    }

    #[test]
    fn the_model_refuses_less_than_a_packet_per_stream() {
        assert_eq!(loss_probability(1e6, 0.001, 64.0), None);
        assert_eq!(loss_limited(1e6, 0.001, 64.0), 0.0);
    }
}

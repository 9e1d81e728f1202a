//! Sizes on the command line: `64M`, `1G`, `512K`, `4096` (powers of 1024).

pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let unit = s[i..].to_ascii_uppercase();
            let m = match unit.trim_end_matches("IB").trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1u64 << 40,
                _ => return Err(format!("unknown unit in '{s}' (use K, M, G or T)")),
            };
            (&s[..i], m)
        }
        None => (s, 1),
    };
    let n: f64 = num.trim().parse().map_err(|_| format!("'{s}' is not a size"))?;
    if !(n.is_finite() && n >= 0.0) {
        return Err(format!("'{s}' is not a size"));
    }
    Ok((n * mult as f64) as u64)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes() {
        assert_eq!(super::parse_size("1M"), Ok(1 << 20));
        assert_eq!(super::parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(super::parse_size("1.5k"), Ok(1536));
        assert_eq!(super::parse_size("7"), Ok(7));
        assert!(super::parse_size("x").is_err());
        assert!(super::parse_size("5Q").is_err());
    }
}

//! Logical replication: the CDC source's wire client and pgoutput decoder.
//!
//! - [`protocol`]: a replication-mode connection (`replication=database`), built on
//!   `postgres-protocol` over a tokio TCP (optionally TLS) stream.
//! - [`pgoutput`]: a decoder for the `pgoutput` logical decoding plugin's messages.

pub mod pgoutput;
pub mod protocol;

use std::fmt;
use std::str::FromStr;

/// A position in the write-ahead log (PostgreSQL's `pg_lsn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// The text was not of the `X/Y` form PostgreSQL prints.
#[derive(Debug, thiserror::Error)]
#[error("invalid LSN {0:?}: expected two hexadecimal numbers separated by '/', like 16/B374D848")]
pub struct ParseLsnError(String);

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError(s.to_owned());
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        let hi = u32::from_str_radix(hi, 16).map_err(|_| err())?;
        let lo = u32::from_str_radix(lo, 16).map_err(|_| err())?;
        Ok(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_round_trips_through_text() {
        let lsn: Lsn = "16/B374D848".parse().unwrap();
        assert_eq!(lsn.0, 0x16_B374_D848);
        assert_eq!(lsn.to_string(), "16/B374D848");
        assert!("16B374D848".parse::<Lsn>().is_err());
        assert!("x/1".parse::<Lsn>().is_err());
    }
}

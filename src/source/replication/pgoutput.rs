//! pgoutput decoder (in progress).

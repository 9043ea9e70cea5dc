//! Malformed input: every truncation, trailing bytes, unknown tags, bad
//! UTF-8, hostile counts and marker bytes are errors, never panics.

use super::*;

fn all_fixture_messages() -> Vec<Bytes> {
    captured(TEXT_FIXTURE)
        .into_iter()
        .chain(captured(BINARY_FIXTURE))
        .map(|c| c.raw)
        .collect()
}

#[test]
fn every_proper_prefix_of_a_fixture_is_an_error() {
    for raw in all_fixture_messages() {
        for len in 0..raw.len() {
            let result = decode(raw.slice(..len));
            assert!(
                matches!(
                    result,
                    Err(DecodeError::Empty
                        | DecodeError::Truncated { .. }
                        | DecodeError::UnterminatedString { .. })
                ),
                "prefix of {len} bytes of {raw:x?} gave {result:?}"
            );
        }
    }
}

#[test]
fn trailing_bytes_are_an_error() {
    for raw in all_fixture_messages() {
        let mut longer = raw.to_vec();
        longer.push(0);
        assert_eq!(
            decode(longer.into()),
            Err(DecodeError::TrailingBytes {
                message: MessageKind::from_tag(raw[0]).expect("known tag"),
                offset: raw.len(),
                count: 1,
            })
        );
    }
}

#[test]
fn unknown_and_empty_messages() {
    assert_eq!(decode(Bytes::new()), Err(DecodeError::Empty));
    // Stream Start, Stream Abort, Begin Prepare, a NUL and plain garbage.
    for tag in [b'S', b'A', b'b', 0, 0xff, b'x'] {
        let result = decode(Bytes::from(vec![tag, 1, 2, 3]));
        assert_eq!(result, Err(DecodeError::UnknownMessageType { tag }));
    }
}

fn bytes_of(parts: &[&[u8]]) -> Bytes {
    Bytes::from(parts.concat())
}

#[test]
fn invalid_utf8_names_the_field_and_offset() {
    let raw = bytes_of(&[
        b"R",
        &16384_u32.to_be_bytes(),
        b"public\0",
        b"bad\xff\0",
        b"d",
        &[0, 0],
    ]);
    let err = decode(raw).expect_err("invalid UTF-8");
    assert!(
        matches!(
            err,
            DecodeError::InvalidUtf8 {
                message: MessageKind::Relation,
                field: "relation name",
                offset: 12,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "Relation message: relation name at offset 12 is not valid UTF-8"
    );
}

#[test]
fn missing_nul_terminator() {
    let raw = bytes_of(&[b"O", &1_u64.to_be_bytes(), b"origin"]);
    assert_eq!(
        decode(raw),
        Err(DecodeError::UnterminatedString {
            message: MessageKind::Origin,
            field: "origin name",
            offset: 9,
        })
    );
}

#[test]
fn hostile_counts_fail_without_allocating_for_them() {
    // Pre-allocation follows the bytes left, not the count.
    let reader = Reader {
        buf: Bytes::from_static(&[0; 9]),
        pos: 1,
        message: MessageKind::Truncate,
    };
    assert_eq!(reader.capacity_for(usize::MAX, 4), 2);
    assert_eq!(reader.capacity_for(1, 4), 1);

    // Truncate claiming u32::MAX relations but carrying one.
    let raw = bytes_of(&[b"T", &u32::MAX.to_be_bytes(), &[0], &7_u32.to_be_bytes()]);
    assert_eq!(
        decode(raw),
        Err(DecodeError::Truncated {
            message: MessageKind::Truncate,
            field: "relation id",
            offset: 10,
            needed: 4,
            available: 0,
        })
    );

    // Relation claiming 65535 columns and carrying none.
    let raw = bytes_of(&[
        b"R",
        &1_u32.to_be_bytes(),
        b"\0t\0d",
        &u16::MAX.to_be_bytes(),
    ]);
    assert!(matches!(
        decode(raw),
        Err(DecodeError::Truncated {
            field: "column flags",
            ..
        })
    ));

    // Insert claiming 65535 columns.
    let raw = bytes_of(&[
        b"I",
        &1_u32.to_be_bytes(),
        b"N",
        &u16::MAX.to_be_bytes(),
        b"n",
    ]);
    assert!(matches!(
        decode(raw),
        Err(DecodeError::Truncated {
            field: "tuple column kind",
            offset: 9,
            ..
        })
    ));
}

#[test]
fn hostile_lengths_fail_without_allocating_for_them() {
    // A text value and a message claiming 4 GiB.
    let raw = bytes_of(&[
        b"I",
        &1_u32.to_be_bytes(),
        b"N\0\x01t",
        &u32::MAX.to_be_bytes(),
    ]);
    assert!(matches!(
        decode(raw),
        Err(DecodeError::Truncated { field: "text value", needed, available: 0, .. })
            if needed == u32::MAX as usize
    ));
    let raw = bytes_of(&[
        b"M\x01",
        &1_u64.to_be_bytes(),
        b"p\0",
        &u32::MAX.to_be_bytes(),
        b"x",
    ]);
    assert!(matches!(
        decode(raw),
        Err(DecodeError::Truncated {
            field: "content",
            available: 1,
            ..
        })
    ));
}

#[test]
fn unexpected_marker_bytes() {
    let relation = 1_u32.to_be_bytes();
    let cases: [(Bytes, &str, usize, u8); 5] = [
        (
            bytes_of(&[b"I", &relation, b"K\0\0"]),
            "new tuple marker",
            5,
            b'K',
        ),
        (
            bytes_of(&[b"U", &relation, b"X\0\0"]),
            "old tuple marker",
            5,
            b'X',
        ),
        (
            bytes_of(&[b"U", &relation, b"K\0\0O\0\0"]),
            "new tuple marker",
            8,
            b'O',
        ),
        (
            bytes_of(&[b"D", &relation, b"N\0\0"]),
            "old tuple marker",
            5,
            b'N',
        ),
        (
            bytes_of(&[b"I", &relation, b"N\0\x01x"]),
            "tuple column kind",
            8,
            b'x',
        ),
    ];
    for (raw, field, offset, value) in cases {
        let err = decode(raw.clone()).expect_err("bad marker");
        match err {
            DecodeError::UnexpectedByte {
                field: f,
                offset: o,
                value: v,
                ..
            } => {
                assert_eq!((f, o, v), (field, offset, value), "{raw:x?}")
            }
            other => panic!("{raw:x?} gave {other:?}"),
        }
    }
    let raw = bytes_of(&[b"M\x02", &1_u64.to_be_bytes(), b"p\0", &0_u32.to_be_bytes()]);
    assert!(matches!(
        decode(raw),
        Err(DecodeError::UnexpectedByte {
            message: MessageKind::Message,
            field: "flags",
            ..
        })
    ));
}

#[test]
fn truncation_error_reads_well() {
    let err = decode(Bytes::from_static(b"B\0\0")).expect_err("truncated");
    assert_eq!(
        err.to_string(),
        "Begin message truncated: final LSN at offset 1 needs 8 bytes, 2 left"
    );
}

// --- property-style: no input panics ---

/// A tiny deterministic xorshift64* generator.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn random_bytes_never_panic() {
    const TAGS: &[u8] = b"BCORYIUDTM";
    let mut rng = XorShift(0x5eed_f00d_cafe_d00d);
    for _ in 0..5_000 {
        let len = rng.below(64);
        let mut raw: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        // Mostly known tags, so that the bodies get exercised rather than the tag check.
        if let Some(first) = raw.first_mut().filter(|_| rng.below(8) != 0) {
            *first = TAGS[rng.below(TAGS.len())];
        }
        let _ = decode(raw.into());
    }
}

#[test]
fn mutated_fixtures_never_panic() {
    let mut rng = XorShift(0x00de_c0de);
    let fixtures = all_fixture_messages();
    let mut decoded = 0;
    for round in 0..20_000 {
        let mut raw = fixtures[round % fixtures.len()].to_vec();
        for _ in 0..=rng.below(3) {
            let at = rng.below(raw.len().max(1));
            match rng.below(5) {
                0 if !raw.is_empty() => raw[at] = rng.next() as u8,
                1 if !raw.is_empty() => raw[at] ^= 1 << rng.below(8),
                2 => raw.insert(at.min(raw.len()), rng.next() as u8),
                3 if !raw.is_empty() => {
                    raw.remove(at);
                }
                // Overwrite with a boundary value, where counts and lengths break first.
                _ if raw.len() >= at + 2 => {
                    let value = [0x00, 0x7f, 0x80, 0xff][rng.below(4)];
                    raw[at] = value;
                    raw[at + 1] = value;
                }
                _ => {}
            }
        }
        if decode(raw.into()).is_ok() {
            decoded += 1;
        }
    }
    // Some mutations (inside text values, say) still decode; most must not.
    assert!(decoded > 0 && decoded < 20_000, "{decoded} mutants decoded");
}

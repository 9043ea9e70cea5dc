//! The fixtures are the output of `pg_logical_slot_peek_binary_changes` on PostgreSQL 15 for the
//! scenario in `tests/fixtures/pgoutput/capture.sql` (re-captured by `capture.sh` there): one
//! message per line as `lsn|xid|hex`. LSNs, xids and commit times differ between captures, so
//! the assertions check them against the server's own `lsn` and `xid` columns rather than
//! against literals.

use super::*;

const TEXT_FIXTURE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/pgoutput/text.hex"
));
const BINARY_FIXTURE: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/pgoutput/binary.hex"
));

/// Seconds between the Unix epoch and PostgreSQL's (2000-01-01).
const POSTGRES_EPOCH_UNIX_SECS: i64 = 946_684_800;

const OUTBOX_UUID: &str = "0b9c1a2e-5f0d-4c7e-9a51-3d2f8e6b7c10";

/// One captured message: the server's `lsn` and `xid` columns and the raw bytes.
struct Captured {
    lsn: Lsn,
    xid: u32,
    raw: Bytes,
}

fn unhex(hex: &str) -> Vec<u8> {
    assert!(hex.len().is_multiple_of(2), "odd-length hex {hex:?}");
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex digit"))
        .collect()
}

fn captured(fixture: &str) -> Vec<Captured> {
    fixture
        .lines()
        .map(|line| {
            let mut fields = line.split('|');
            let mut next = || fields.next().expect("lsn|xid|hex");
            Captured {
                lsn: next().parse().expect("lsn"),
                xid: next().parse().expect("xid"),
                raw: Bytes::from(unhex(next())),
            }
        })
        .collect()
}

fn decode_all(fixture: &str) -> Vec<(Captured, LogicalMessage)> {
    captured(fixture)
        .into_iter()
        .map(|c| {
            let message = decode(c.raw.clone())
                .unwrap_or_else(|e| panic!("message at {} did not decode: {e}", c.lsn));
            (c, message)
        })
        .collect()
}

fn tag(message: &LogicalMessage) -> char {
    match message {
        LogicalMessage::Begin(_) => 'B',
        LogicalMessage::Commit(_) => 'C',
        LogicalMessage::Origin(_) => 'O',
        LogicalMessage::Relation(_) => 'R',
        LogicalMessage::Type(_) => 'Y',
        LogicalMessage::Insert(_) => 'I',
        LogicalMessage::Update(_) => 'U',
        LogicalMessage::Delete(_) => 'D',
        LogicalMessage::Truncate(_) => 'T',
        LogicalMessage::Message(_) => 'M',
    }
}

/// What capture.sql makes PostgreSQL send, one group per transaction.
const CAPTURE_ORDER: &str = "BRIC BYRIIC BUC BUC BDC BRIC BUC BDC BRIC BMC M BRRTC BORIC";

fn text(value: &TupleValue) -> &str {
    match value {
        TupleValue::Text(bytes) => std::str::from_utf8(bytes).expect("UTF-8 text value"),
        other => panic!("expected a text value, got {other:?}"),
    }
}

fn texts(values: &[TupleValue]) -> Vec<Option<&str>> {
    values
        .iter()
        .map(|value| match value {
            TupleValue::Null => None,
            TupleValue::UnchangedToast => Some("<unchanged toast>"),
            value => Some(text(value)),
        })
        .collect()
}

fn messages(decoded: &[(Captured, LogicalMessage)]) -> Vec<&LogicalMessage> {
    decoded.iter().map(|(_, message)| message).collect()
}

fn relation<'a>(decoded: &'a [(Captured, LogicalMessage)], name: &str) -> &'a Relation {
    decoded
        .iter()
        .find_map(|(_, message)| match message {
            LogicalMessage::Relation(r) if r.name == name => Some(r),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no Relation message for {name}"))
}

#[test]
fn text_fixture_decodes_in_capture_order() {
    let decoded = decode_all(TEXT_FIXTURE);
    let order: String = decoded.iter().map(|(_, m)| tag(m)).collect();
    assert_eq!(order, CAPTURE_ORDER.replace(' ', ""));
    for (c, message) in &decoded {
        assert_eq!(MessageKind::from_tag(c.raw[0]), Some(message.kind()));
    }
}

#[test]
fn transactions_agree_with_the_servers_lsn_and_xid() {
    let decoded = decode_all(TEXT_FIXTURE);
    let mut open: Option<&Begin> = None;
    for (c, message) in &decoded {
        match message {
            LogicalMessage::Begin(begin) => {
                assert!(open.is_none(), "nested Begin at {}", c.lsn);
                assert_eq!(begin.xid, c.xid);
                open = Some(begin);
            }
            LogicalMessage::Commit(commit) => {
                let begin = open.take().expect("Commit without Begin");
                assert_eq!(commit.flags, 0);
                assert_eq!(commit.commit_lsn, begin.final_lsn);
                assert_eq!(commit.commit_time_micros, begin.commit_time_micros);
                // The row's lsn for a Commit is the end of the commit record.
                assert_eq!(commit.end_lsn, c.lsn);
                assert!(commit.end_lsn > commit.commit_lsn);
            }
            LogicalMessage::Message(m) if !m.transactional => {
                assert!(open.is_none());
                assert_eq!(c.xid, 0);
            }
            _ => {
                let begin = open.expect("change outside a transaction");
                assert_eq!(c.xid, begin.xid);
            }
        }
    }
    assert!(open.is_none());
}

#[test]
fn outbox_relation_and_insert() {
    let decoded = decode_all(TEXT_FIXTURE);
    let outbox = relation(&decoded, "outbox");
    assert_eq!(outbox.namespace, "public");
    assert_eq!(outbox.replica_identity, b'd');
    let columns: Vec<(&str, u32, i32, bool)> = outbox
        .columns
        .iter()
        .map(|c| (c.name.as_str(), c.type_oid, c.type_modifier, c.is_key()))
        .collect();
    assert_eq!(
        columns,
        [
            ("id", 2950, -1, true),
            ("aggregate_type", 25, -1, false),
            ("aggregate_id", 25, -1, false),
            ("event_type", 25, -1, false),
            ("event_version", 23, -1, false),
            ("payload", 3802, -1, false),
            ("headers", 3802, -1, false),
            ("created_at", 1184, -1, false),
        ]
    );

    let LogicalMessage::Insert(insert) = messages(&decoded)[2] else {
        panic!("expected the outbox Insert third");
    };
    assert_eq!(insert.relation_id, outbox.id);
    assert_eq!(
        texts(&insert.tuple),
        [
            Some(OUTBOX_UUID),
            Some("order"),
            Some("42"),
            Some("OrderPlaced"),
            Some("1"),
            // jsonb comes back normalised: keys reordered, escapes resolved, one space after
            // ':' and ','.
            Some(
                r#"{"note": "café \"quoted\"", "items": [{"qty": 2, "sku": "A-1"}], "total": 12.5}"#
            ),
            None,
            // In the walsender's TimeZone and DateStyle (the cluster default here: UTC, ISO).
            Some("2024-05-06 07:08:09.123456+00"),
        ]
    );
}

#[test]
fn relation_cache_names_the_columns_of_a_tuple() {
    let decoded = decode_all(TEXT_FIXTURE);
    let mut cache = RelationCache::new();
    let mut payloads = Vec::new();
    for (_, message) in decoded {
        match message {
            LogicalMessage::Relation(relation) => {
                cache.apply(relation);
            }
            LogicalMessage::Insert(insert) => {
                let relation = cache
                    .get(insert.relation_id)
                    .expect("Relation before Insert");
                if relation.name == "outbox" {
                    let payload = relation.column_value(&insert.tuple, "payload");
                    payloads.push(payload.map(text).map(str::to_owned));
                }
            }
            _ => {}
        }
    }
    assert_eq!(payloads.len(), 1);
    assert!(
        payloads[0]
            .as_deref()
            .is_some_and(|p| p.starts_with(r#"{"note""#))
    );
}

#[test]
fn relation_cache_replaces_a_changed_table() {
    let decoded = decode_all(TEXT_FIXTURE);
    let outbox = relation(&decoded, "outbox").clone();
    let mut cache = RelationCache::new();
    assert_eq!(cache.apply(outbox.clone()), None);
    assert_eq!(outbox.column_index("payload"), Some(5));
    assert_eq!(outbox.column_index("missing"), None);

    let mut altered = outbox.clone();
    altered.columns.remove(0);
    assert_eq!(cache.apply(altered), Some(outbox.clone()));
    let current = cache.get(outbox.id).expect("cached");
    assert_eq!(current.column_index("payload"), Some(4));
    assert_eq!(cache.get(outbox.id + 1), None);
    // A tuple shorter than the relation yields no value rather than a panic.
    assert_eq!(current.column_value(&[TupleValue::Null], "payload"), None);
}

#[test]
fn custom_type_typmods_and_skipped_columns() {
    let decoded = decode_all(TEXT_FIXTURE);
    let LogicalMessage::Type(mood) = messages(&decoded)[5] else {
        panic!("expected the Type message before the Moods relation");
    };
    assert_eq!(
        (mood.namespace.as_str(), mood.name.as_str()),
        ("public", "mood")
    );

    let moods = relation(&decoded, "Moods ü");
    let columns: Vec<(&str, u32, i32)> = moods
        .columns
        .iter()
        .map(|c| (c.name.as_str(), c.type_oid, c.type_modifier))
        .collect();
    // The dropped column `gone` and the generated column `doubled` are not published.
    assert_eq!(
        columns,
        [
            ("id", 20, -1),
            ("m", mood.id, -1),
            ("note", 25, -1),
            ("big", 25, -1),
            // numeric(10, 2) and varchar(20), with PostgreSQL's 4-byte header offset.
            ("price", 1700, ((10 << 16) | 2) + 4),
            ("tag", 1043, 20 + 4),
        ]
    );
    assert_eq!(moods.columns.iter().filter(|c| c.is_key()).count(), 1);
}

#[test]
fn inserts_updates_and_deletes_with_default_identity() {
    let decoded = decode_all(TEXT_FIXTURE);
    let moods = relation(&decoded, "Moods ü").id;
    let m = messages(&decoded);

    let LogicalMessage::Insert(first) = m[7] else {
        panic!("Insert")
    };
    assert_eq!(first.relation_id, moods);
    let values = texts(&first.tuple);
    assert_eq!(
        values[..3],
        [Some("1"), Some("happy"), Some("line1\nline2\ttab")]
    );
    let big = values[3].expect("big");
    assert_eq!(big.len(), 100 * 32);
    assert!(big.starts_with("c4ca4238a0b923820dcc509a6f75849b")); // md5('1')
    assert_eq!(values[4..], [Some("12.30"), Some("x")]);

    let LogicalMessage::Insert(second) = m[8] else {
        panic!("Insert")
    };
    assert_eq!(
        texts(&second.tuple),
        [Some("2"), None, None, None, None, None]
    );

    // The TOASTed column the update did not touch is not sent.
    let LogicalMessage::Update(update) = m[11] else {
        panic!("Update")
    };
    assert_eq!((update.relation_id, &update.old), (moods, &None));
    assert_eq!(
        texts(&update.new),
        [
            Some("1"),
            Some("sad"),
            Some("line1\nline2\ttab"),
            Some("<unchanged toast>"),
            Some("12.30"),
            Some("x")
        ]
    );

    // A key change carries the old key; non-key columns of the old tuple are null.
    let LogicalMessage::Update(key_change) = m[14] else {
        panic!("Update")
    };
    let Some(OldTuple::Key(old)) = &key_change.old else {
        panic!("expected the old key, got {:?}", key_change.old);
    };
    assert_eq!(texts(old), [Some("2"), None, None, None, None, None]);
    assert_eq!(
        texts(&key_change.new),
        [Some("3"), None, None, None, None, None]
    );

    let LogicalMessage::Delete(delete) = m[17] else {
        panic!("Delete")
    };
    assert_eq!(delete.relation_id, moods);
    let OldTuple::Key(old) = &delete.old else {
        panic!("Key")
    };
    assert_eq!(texts(old), [Some("3"), None, None, None, None, None]);
}

#[test]
fn full_and_index_replica_identity() {
    let decoded = decode_all(TEXT_FIXTURE);
    let full = relation(&decoded, "full_ident");
    assert_eq!(full.replica_identity, b'f');
    assert!(full.columns.iter().all(RelationColumn::is_key));
    let m = messages(&decoded);

    let LogicalMessage::Update(update) = m[24] else {
        panic!("Update")
    };
    assert_eq!(update.relation_id, full.id);
    let Some(OldTuple::Full(old)) = &update.old else {
        panic!("Full")
    };
    assert_eq!(texts(old), [Some("1"), Some("a")]);
    assert_eq!(texts(&update.new), [Some("1"), Some("b")]);

    let LogicalMessage::Delete(delete) = m[27] else {
        panic!("Delete")
    };
    let OldTuple::Full(old) = &delete.old else {
        panic!("Full")
    };
    assert_eq!(texts(old), [Some("1"), Some("b")]);

    let by_index = relation(&decoded, "by_index");
    assert_eq!(
        (by_index.namespace.as_str(), by_index.replica_identity),
        ("app", b'i')
    );
    let keys: Vec<bool> = by_index
        .columns
        .iter()
        .map(RelationColumn::is_key)
        .collect();
    assert_eq!(keys, [true, false]);
}

#[test]
fn logical_decoding_messages_truncate_and_origin() {
    let decoded = decode_all(TEXT_FIXTURE);
    let m = messages(&decoded);

    let LogicalMessage::Message(tx) = m[34] else {
        panic!("Message")
    };
    assert!(tx.transactional);
    assert_eq!((tx.prefix.as_str(), &tx.content[..]), ("p", &b"x"[..]));
    assert_eq!(tx.lsn, decoded[34].0.lsn);

    let LogicalMessage::Message(non_tx) = m[36] else {
        panic!("Message")
    };
    assert!(!non_tx.transactional);
    assert_eq!(non_tx.prefix, "outbox.nontx");
    assert_eq!(&non_tx.content[..], [0x00, 0xff]);
    assert_eq!(non_tx.lsn, decoded[36].0.lsn);

    let LogicalMessage::Truncate(truncate) = m[40] else {
        panic!("Truncate")
    };
    assert!(truncate.cascade() && truncate.restart_identity());
    let other = relation(&decoded, "other").id;
    let full = relation(&decoded, "full_ident").id;
    assert_eq!(truncate.relation_ids, [other, full]);

    let LogicalMessage::Begin(begin) = m[42] else {
        panic!("Begin")
    };
    let LogicalMessage::Origin(origin) = m[43] else {
        panic!("Origin")
    };
    assert_eq!(origin.name, "origin_a");
    assert_eq!(origin.commit_lsn, Lsn(0x1234_5678));
    // A replayed transaction carries the commit time set by pg_replication_origin_xact_setup.
    let origin_time_unix = 1_704_164_645; // 2024-01-02 03:04:05 UTC
    assert_eq!(
        begin.commit_time_micros,
        (origin_time_unix - POSTGRES_EPOCH_UNIX_SECS) * 1_000_000
    );
}

#[test]
fn binary_fixture_carries_send_formats() {
    let decoded = decode_all(BINARY_FIXTURE);
    let order: String = decoded.iter().map(|(_, m)| tag(m)).collect();
    assert_eq!(order, CAPTURE_ORDER.replace(' ', ""));

    let LogicalMessage::Insert(insert) = messages(&decoded)[2] else {
        panic!("Insert")
    };
    let binary: Vec<&[u8]> = insert
        .tuple
        .iter()
        .map(|value| match value {
            TupleValue::Binary(bytes) => &bytes[..],
            TupleValue::Null => &[],
            other => panic!("expected binary, got {other:?}"),
        })
        .collect();
    assert_eq!(binary[0], unhex(&OUTBOX_UUID.replace('-', "")));
    assert_eq!(binary[1], b"order");
    assert_eq!(binary[4], 1_i32.to_be_bytes());
    // jsonb's binary form is a version byte followed by the text.
    assert_eq!(binary[5].first(), Some(&1));
    assert!(binary[5][1..].starts_with(br#"{"note""#));
    let created_at = 1_714_979_289 - POSTGRES_EPOCH_UNIX_SECS; // 2024-05-06 07:08:09 UTC
    assert_eq!(binary[7], (created_at * 1_000_000 + 123_456).to_be_bytes());
}

mod malformed;

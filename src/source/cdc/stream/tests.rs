use super::*;

/// A stream whose status message never finishes sending.
struct Stuck;

impl CdcStream for Stuck {
    async fn next(&mut self) -> Result<Option<StreamMessage>, SourceError> {
        std::future::pending().await
    }
    async fn send_status(&mut self, _: Lsn, _: Lsn) -> Result<(), SourceError> {
        std::future::pending().await
    }
    async fn finish(self) {}
    fn slot_confirmed(&self) -> Lsn {
        Lsn(0)
    }
}

/// A status message cut short counts nothing as reported: the report
/// stays due, instead of a window of confirmations going unreported
/// until the next one piles up.
#[tokio::test]
async fn a_status_message_cut_short_leaves_its_report_due() {
    let progress = Mutex::new(Progress::new(Lsn(10), 100));
    {
        let at = |index| CdcPosition {
            commit_lsn: Lsn(100),
            index,
            seq: None,
            xid: None,
        };
        let mut p = lock(&progress);
        p.begin(Lsn(100));
        for i in 0..3 {
            p.event(&at(i));
        }
        p.commit(Lsn(110));
        for i in 0..3 {
            p.confirm(&at(i));
        }
    }
    assert_eq!(lock(&progress).unreported(), 3);
    let mut s = Streaming::new(Stuck, None, Lsn(10), false, None);
    let send = s.send_status(&progress, std::time::Duration::from_secs(10));
    let cut = tokio::time::timeout(std::time::Duration::from_millis(20), send).await;
    assert!(cut.is_err(), "the send never finishes");
    assert_eq!(lock(&progress).unreported(), 3, "still to report");
}

/// A non-transactional message's LSN is the end of its WAL record, where
/// the commit record of the next transaction may start (nothing else
/// written between them): the two keep distinct places, and confirming
/// the message alone flushes no further than that commit's start, so a
/// restart still streams the transaction.
#[test]
fn an_untransactional_message_just_before_a_commit_keeps_its_own_place() {
    use crate::replication::pgoutput::{Begin, Commit, LogicalDecodingMessage};
    let progress = Mutex::new(Progress::new(Lsn(10), 100));
    let mut s = Streaming::new(Stuck, None, Lsn(10), false, Some("p".into()));
    let (table, columns) = (
        TableName::new("public", "outbox"),
        crate::config::ColumnMap::default().resolve(&[]),
    );
    let commit_at = Lsn(0x1000);
    let message = |transactional| LogicalDecodingMessage {
        transactional,
        lsn: commit_at,
        prefix: "p".into(),
        content: bytes::Bytes::from_static(
            br#"{"id":"e","aggregate_type":"t","aggregate_id":"a","event_type":"E","payload":{}}"#,
        ),
    };
    let mut out = Vec::new();
    for m in [
        LogicalMessage::Message(message(false)),
        LogicalMessage::Begin(Begin {
            final_lsn: commit_at,
            commit_time_micros: 0,
            xid: 7,
        }),
        LogicalMessage::Message(message(true)),
        LogicalMessage::Commit(Commit {
            flags: 0,
            commit_lsn: commit_at,
            end_lsn: Lsn(0x1040),
            commit_time_micros: 0,
        }),
    ] {
        s.handle(
            StreamMessage::Change(m),
            &table,
            &columns,
            &progress,
            &mut out,
        )
        .expect("handled");
    }
    let [untransactional, event] = [out[0].position, out[1].position];
    assert!(out[0].event.is_err(), "the untransactional one is refused");
    assert!(out[1].event.is_ok());
    assert_ne!(
        (untransactional.commit_lsn, untransactional.index),
        (event.commit_lsn, event.index)
    );
    assert!(untransactional.commit_lsn < event.commit_lsn);
    lock(&progress).confirm(&untransactional);
    assert_eq!(lock(&progress).flushed(), commit_at, "not past the commit");
    assert_eq!(lock(&progress).outstanding(), 1, "the transaction waits");
    lock(&progress).confirm(&event);
    assert_eq!(lock(&progress).flushed(), Lsn(0x1040));
    assert_eq!(lock(&progress).outstanding(), 0);
}

/// A Commit with no transaction open, or a Begin inside one, is a broken
/// stream: it ends with an error (and the stream restarts from the slot)
/// instead of closing, or reopening, a transaction it never saw begin.
#[test]
fn a_commit_without_a_begin_and_a_begin_inside_a_transaction_are_refused() {
    use crate::replication::pgoutput::{Begin, Commit};
    let (table, columns) = (
        TableName::new("public", "outbox"),
        crate::config::ColumnMap::default().resolve(&[]),
    );
    let begin = || {
        LogicalMessage::Begin(Begin {
            final_lsn: Lsn(0x1000),
            commit_time_micros: 0,
            xid: 7,
        })
    };
    let commit = LogicalMessage::Commit(Commit {
        flags: 0,
        commit_lsn: Lsn(0x1000),
        end_lsn: Lsn(0x1040),
        commit_time_micros: 0,
    });
    for (messages, expected) in [
        (vec![commit], "a Commit arrived outside a transaction"),
        (
            vec![begin(), begin()],
            "a Begin arrived inside a transaction",
        ),
    ] {
        let progress = Mutex::new(Progress::new(Lsn(10), 100));
        let mut s = Streaming::new(Stuck, None, Lsn(10), false, None);
        let mut handled = messages.into_iter().map(|m| {
            s.handle(
                StreamMessage::Change(m),
                &table,
                &columns,
                &progress,
                &mut Vec::new(),
            )
        });
        let error = handled
            .find_map(Result::err)
            .expect("the stream is refused");
        assert!(error.to_string().contains(expected), "{error}");
        assert_eq!(lock(&progress).flushed(), Lsn(10), "nothing moved");
    }
}

mod refused {
    use super::*;
    use crate::replication::pgoutput::{
        Begin, Commit, Insert, Relation, RelationColumn, TupleValue,
    };

    pub(super) fn begin(at: u64) -> LogicalMessage {
        LogicalMessage::Begin(Begin {
            final_lsn: Lsn(at),
            commit_time_micros: 0,
            xid: 7,
        })
    }

    pub(super) fn commit(at: u64, end: u64) -> LogicalMessage {
        LogicalMessage::Commit(Commit {
            flags: 0,
            commit_lsn: Lsn(at),
            end_lsn: Lsn(end),
            commit_time_micros: 0,
        })
    }

    /// The default outbox's required columns, as text.
    pub(super) fn relation(id: u32, name: &str) -> LogicalMessage {
        let names = [
            "id",
            "aggregate_type",
            "aggregate_id",
            "event_type",
            "payload",
        ];
        LogicalMessage::Relation(Relation {
            id,
            namespace: "public".into(),
            name: name.into(),
            replica_identity: b'd',
            columns: names
                .iter()
                .map(|n| RelationColumn {
                    flags: 0,
                    name: (*n).into(),
                    type_oid: 25,
                    type_modifier: -1,
                })
                .collect(),
        })
    }

    pub(super) fn text() -> TupleValue {
        TupleValue::Text(bytes::Bytes::from_static(b"x"))
    }

    pub(super) fn insert(id: u32, tuple: Vec<TupleValue>) -> LogicalMessage {
        LogicalMessage::Insert(Insert {
            relation_id: id,
            tuple,
        })
    }

    /// Feeds `messages` to a new stream: the error it ends with (none: "")
    /// and how many events it read.
    pub(super) fn error_of(messages: Vec<LogicalMessage>) -> (String, usize) {
        let (table, columns) = (
            TableName::new("public", "outbox"),
            crate::config::ColumnMap::default().resolve(&[]),
        );
        let progress = Mutex::new(Progress::new(Lsn(10), 100));
        let mut s = Streaming::new(Stuck, None, Lsn(10), false, None);
        let mut out = Vec::new();
        let error = messages.into_iter().find_map(|m| {
            s.handle(
                StreamMessage::Change(m),
                &table,
                &columns,
                &progress,
                &mut out,
            )
            .err()
        });
        (error.map(|e| e.to_string()).unwrap_or_default(), out.len())
    }
}

/// A stream the relay cannot trust is refused, not read around: commits out
/// of order or not matching their Begin (the progress of confirmations
/// relies on their order), a row of a relation never announced, an outbox
/// row of another width than announced or with a column sent unchanged or
/// in binary (read as missing, it would go out with defaults), and the
/// outbox announced again under another name.
#[test]
fn a_stream_out_of_order_or_unlike_its_relations_is_refused() {
    use crate::replication::pgoutput::TupleValue;
    use refused::*;
    let unchanged = vec![text(), text(), text(), text(), TupleValue::UnchangedToast];
    let cases = [
        (
            vec![begin(0x1000), commit(0x1000, 0x1040), begin(0x0800)],
            "began after one committing at",
        ),
        (
            vec![begin(0x1000), commit(0x2000, 0x2040)],
            "closed a transaction that began saying it commits at",
        ),
        (
            vec![begin(0x1000), insert(99, vec![text()])],
            "for relation 99 that no Relation message announced",
        ),
        (
            vec![
                relation(5, "outbox"),
                begin(0x1000),
                insert(5, vec![text(); 4]),
            ],
            "came with 4 columns where its Relation message announced 5",
        ),
        (
            vec![relation(5, "outbox"), begin(0x1000), insert(5, unchanged)],
            "column 5 of an outbox row came as an unchanged TOAST value",
        ),
        (
            vec![relation(5, "outbox"), relation(5, "outbox_old")],
            "is now named public.outbox_old",
        ),
    ];
    for (messages, expected) in cases {
        let (error, read) = error_of(messages);
        assert!(error.contains(expected), "{expected}: {error:?}");
        assert_eq!(read, 0, "no event read from it");
    }
    // A well-formed row of the outbox is read.
    assert_eq!(
        error_of(vec![
            relation(5, "outbox"),
            begin(0x1000),
            insert(5, vec![text(); 5])
        ]),
        (String::new(), 1)
    );
}

/// A Truncate warns only when it names the outbox table.
#[test]
fn a_truncate_warns_only_for_the_outbox() {
    use crate::replication::pgoutput::Truncate;
    use refused::*;
    let (table, columns) = (
        TableName::new("public", "outbox"),
        crate::config::ColumnMap::default().resolve(&[]),
    );
    let progress = Mutex::new(Progress::new(Lsn(10), 100));
    let mut s = Streaming::new(Stuck, None, Lsn(10), false, None);
    let truncate = |ids: Vec<u32>| {
        LogicalMessage::Truncate(Truncate {
            options: 0,
            relation_ids: ids,
        })
    };
    for (message, warned) in [
        (relation(5, "outbox"), false),
        (begin(0x1000), false),
        (truncate(vec![6]), false),
        (truncate(vec![6, 5]), true),
    ] {
        s.handle(
            StreamMessage::Change(message),
            &table,
            &columns,
            &progress,
            &mut Vec::new(),
        )
        .expect("handled");
        assert_eq!(s.warned.contains(&MessageKind::Truncate), warned);
    }
}

/// A transaction the start-up read covered has its rows skipped, but its
/// logical messages published: once one is handed over, a batch ending
/// before its commit ends inside it, so that a clean stop reads on to the
/// commit (where the WAL is the only record, a restart would publish the
/// message again otherwise).
#[test]
fn a_covered_transaction_is_entered_by_a_message_handed_over() {
    use crate::replication::pgoutput::{Begin, Commit, LogicalDecodingMessage};
    use crate::source::cdc::snapshot::{Snapshot, StartupView};
    let progress = Mutex::new(Progress::new(Lsn(10), 100));
    let view = StartupView {
        snapshot: Snapshot {
            xmin: 100,
            xmax: 100,
            xip: Vec::new(),
        },
        until: Lsn(0x2000),
        settled: None,
    };
    let mut s = Streaming::new(Stuck, Some(view), Lsn(10), false, Some("p".into()));
    let (table, columns) = (
        TableName::new("public", "outbox"),
        crate::config::ColumnMap::default().resolve(&[]),
    );
    let commit_at = Lsn(0x1000);
    let mut out = Vec::new();
    let mut handle = |s: &mut Streaming<Stuck>, m| {
        s.handle(
            StreamMessage::Change(m),
            &table,
            &columns,
            &progress,
            &mut out,
        )
        .expect("handled");
    };
    handle(
        &mut s,
        LogicalMessage::Begin(Begin {
            final_lsn: commit_at,
            commit_time_micros: 0,
            xid: 7,
        }),
    );
    assert!(!s.inside_transaction(), "nothing handed over yet");
    handle(
        &mut s,
        LogicalMessage::Message(LogicalDecodingMessage {
            transactional: true,
            lsn: commit_at,
            prefix: "p".into(),
            content: bytes::Bytes::from_static(
                br#"{"id":"e","aggregate_type":"t","aggregate_id":"a","event_type":"E","payload":{}}"#,
            ),
        }),
    );
    assert!(s.inside_transaction(), "its message was handed over");
    handle(
        &mut s,
        LogicalMessage::Commit(Commit {
            flags: 0,
            commit_lsn: commit_at,
            end_lsn: Lsn(0x1040),
            commit_time_micros: 0,
        }),
    );
    assert!(!s.inside_transaction());
    assert_eq!(out.len(), 1, "the message, published");
}

use super::*;

fn info(partitioning: Option<Partitioning>, unique_indexes: &[&[&str]]) -> TableInfo {
    TableInfo {
        columns: Vec::new(),
        can_select: true,
        can_update: true,
        can_delete: true,
        is_owner: true,
        unique_columns: Vec::new(),
        has_replica_identity: true,
        replicating: Vec::new(),
        triggers: Vec::new(),
        partitioning,
        unique_indexes: unique_indexes
            .iter()
            .map(|i| i.iter().map(|c| c.to_string()).collect())
            .collect(),
    }
}

fn by(columns: &[&str]) -> Option<Partitioning> {
    Some(Partitioning {
        strategy: "range".into(),
        columns: columns.iter().map(|c| c.to_string()).collect(),
        expressions: false,
    })
}

#[test]
fn relay_seq_is_unique_alone_or_with_the_partition_key() {
    assert!(info(None, &[&["relay_seq"]]).seq_unique());
    assert!(!info(None, &[&["relay_seq", "created_at"]]).seq_unique());
    assert!(info(by(&["created_at"]), &[&["relay_seq", "created_at"]]).seq_unique());
    // Another column than the key would let twins through.
    assert!(!info(by(&["created_at"]), &[&["relay_seq", "tenant"]]).seq_unique());
    assert!(!info(by(&["created_at"]), &[&["created_at", "relay_seq"]]).seq_unique());
    assert_eq!(
        seq_key(by(&["created_at", "tenant"]).as_ref()),
        ["relay_seq", "created_at", "tenant"]
    );
    assert_eq!(seq_key(None), ["relay_seq"]);
}

#[test]
fn types_are_compared_without_their_modifiers() {
    for (printed, base) in [
        ("timestamp(3) with time zone", "timestamp with time zone"),
        (
            "timestamp(6) without time zone",
            "timestamp without time zone",
        ),
        ("character varying(255)", "character varying"),
        ("numeric(10,2)", "numeric"),
        ("jsonb", "jsonb"),
    ] {
        assert_eq!(base_type(printed), base);
    }
    assert!(type_is(
        "timestamp(3) with time zone",
        &["timestamp with time zone"]
    ));
    assert!(!type_is("timestamp(3) with time zone", &["timestamp"]));
}

#[test]
fn the_relay_columns_must_not_allow_null() {
    let column = |name: &str, type_name: &str, not_null: bool| ColumnInfo {
        name: name.into(),
        type_name: type_name.into(),
        not_null,
        has_default: name != "relay_sent_at",
    };
    let with = |seq_not_null: bool, xid_not_null: bool| TableInfo {
        columns: vec![
            column("relay_seq", "bigint", seq_not_null),
            column("relay_xid", "xid8", xid_not_null),
            column("relay_sent_at", "timestamp with time zone", false),
        ],
        ..info(None, &[])
    };
    assert_eq!(
        relay_column_problems(&with(true, true)),
        Vec::<String>::new()
    );
    let problems = relay_column_problems(&with(false, false));
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(
        problems[0].starts_with("column \"relay_seq\" allows NULL"),
        "{problems:?}"
    );
    assert!(
        problems[1].contains("ALTER COLUMN relay_xid SET NOT NULL"),
        "{problems:?}"
    );
}

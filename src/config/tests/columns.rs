//! `[outbox.columns]`: the column map, extra and routing columns.

use super::*;

#[test]
fn column_mapping_is_checked() {
    let e = err(&format!(
        "{MINIMAL}\n[outbox.columns]\naggregate_id = \"aggregate_type\"\n"
    ));
    assert!(
        e.contains("outbox.columns.aggregate_id") && e.contains("already mapped"),
        "{e}"
    );
    let e = err(&format!("{MINIMAL}\n[outbox]\ntable = \"a.b.c\"\n"));
    assert!(e.contains("outbox.table") || e.contains("a.b.c"), "{e}");
}

#[test]
fn extra_columns_are_read_and_checked_by_key() {
    let ok = load_str(&format!(
        "{MINIMAL}\n[[outbox.columns.extra]]\ncolumn = \"tenant_id\"\nheader = \"tenant\"\nattribute = \"tenantid\"\n"
    ))
    .unwrap();
    assert_eq!(
        ok.outbox.columns.extra,
        vec![super::ExtraColumn {
            column: "tenant_id".into(),
            header: Some("tenant".into()),
            attribute: Some("tenantid".into()),
        }]
    );
    let e = err(&format!(
        "{MINIMAL}
[[outbox.columns.extra]]
column = \"tenant_id\"
attribute = \"Tenant_Id\"
[[outbox.columns.extra]]
column = \"region\"
header = \"event_id\"
attribute = \"type\"
[[outbox.columns.extra]]
column = \"tenant_id\"
"
    ));
    for expected in [
        "outbox.columns.extra[0].attribute: \"Tenant_Id\" is not a CloudEvents attribute name",
        "outbox.columns.extra[1].attribute: \"type\" is an attribute the relay sets",
        "outbox.columns.extra[1].header: \"event_id\" is a header the relay sets",
        "outbox.columns.extra[2].column: column \"tenant_id\" is already listed in extra[0]",
        "outbox.columns.extra[2].column: publishes nothing",
    ] {
        assert!(e.contains(expected), "{expected:?} not in: {e}");
    }
    let e = err(&format!(
        "{MINIMAL}\n[[outbox.columns.extra]]\ncolumn = \"t\"\nheadr = \"x\"\n"
    ));
    assert!(
        e.contains("outbox.columns.extra") && e.contains("headr"),
        "{e}"
    );
}

#[test]
fn routing_columns_are_read_and_checked_by_key() {
    let ok = load_str(&format!(
        "{MINIMAL}\n[outbox.columns]\ndestination = \"topic\"\nkey = \"partition_key\"\n"
    ))
    .unwrap();
    assert_eq!(ok.outbox.columns.destination.as_deref(), Some("topic"));
    assert_eq!(ok.outbox.columns.key.as_deref(), Some("partition_key"));
    let absent = load_str(MINIMAL).unwrap();
    assert_eq!(
        (absent.outbox.columns.destination, absent.outbox.columns.key),
        (None, None),
        "no routing column by default"
    );
    let e = err(&format!(
        "{MINIMAL}\n[outbox.columns]\ndestination = \"relay_seq\"\nkey = \"\"\n"
    ));
    for expected in [
        "outbox.columns.destination: relay_seq is a column the relay owns",
        "outbox.columns.key: a column name must be 1 to 63 bytes long",
    ] {
        assert!(e.contains(expected), "{expected:?} not in: {e}");
    }
}

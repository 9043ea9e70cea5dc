//! `[source]`: CDC slots, logical messages, auto mode.

use super::*;

#[test]
fn a_lost_slot_is_recreated_only_when_rows_are_marked() {
    let cdc = format!("{MINIMAL}\n[source]\nmode = \"cdc\"\n");
    let c = load_str(&cdc).unwrap();
    assert!(c.source.cdc.recreates_lost_slot(c.relay.mark));
    let c = load_str(&format!("{cdc}[relay]\nmark = \"none\"\n")).unwrap();
    assert!(!c.source.cdc.recreates_lost_slot(c.relay.mark));
    let c = load_str(&format!("{cdc}[source.cdc]\non_lost_slot = \"stop\"\n")).unwrap();
    assert!(!c.source.cdc.recreates_lost_slot(c.relay.mark));
    let e = err(&format!(
        "{cdc}[source.cdc]\non_lost_slot = \"recreate\"\n[relay]\nmark = \"none\"\n"
    ));
    assert!(
        e.contains("source.cdc.on_lost_slot") && e.contains("\"stop\""),
        "{e}"
    );
    let e = err(&format!("{cdc}[source.cdc]\non_lost_slot = \"heal\"\n"));
    assert!(e.contains("on_lost_slot") && e.contains("recreate"), "{e}");
}

#[test]
fn logical_messages_need_cdc_a_kept_slot_and_a_prefix_of_their_own() {
    let cdc = format!("{MINIMAL}\n[source]\nmode = \"cdc\"\n[source.cdc]\nmessages = true\n");
    let c = load_str(&cdc).unwrap();
    assert_eq!(
        c.source.cdc.message_prefix(&c.outbox.table).as_deref(),
        Some("outbox_relay_outbox")
    );
    // Messages live in the WAL alone: a lost slot stops the relay by default.
    assert!(!c.source.cdc.recreates_lost_slot(c.relay.mark));
    let c = load_str(&format!("{cdc}message_prefix = \"shop events\"\n")).unwrap();
    assert_eq!(
        c.source.cdc.message_prefix(&c.outbox.table).as_deref(),
        Some("shop events")
    );
    for (toml, key, says) in [
        (
            format!("{MINIMAL}\n[source.cdc]\nmessages = true\n"),
            "source.cdc.messages",
            "source.mode = \"cdc\"",
        ),
        (
            format!("{cdc}on_lost_slot = \"recreate\"\n"),
            "source.cdc.on_lost_slot",
            "\"stop\"",
        ),
        (
            format!("{cdc}message_prefix = \"outbox-relay\"\n"),
            "source.cdc.message_prefix",
            "heartbeat",
        ),
        (
            format!("{cdc}message_prefix = \" \"\n"),
            "source.cdc.message_prefix",
            "1 to 200",
        ),
        (
            format!("{MINIMAL}\n[source]\nmode = \"cdc\"\n[source.cdc]\nmessage_prefix = \"x\"\n"),
            "source.cdc.message_prefix",
            "messages = true",
        ),
    ] {
        let e = err(&toml);
        assert!(e.contains(key) && e.contains(says), "{e}");
    }
}

#[test]
fn auto_mode_needs_marked_rows_and_probes_every_30s_by_default() {
    let auto = format!("{MINIMAL}\n[source]\nmode = \"auto\"\n");
    let c = load_str(&auto).unwrap();
    assert_eq!(c.source.mode, SourceMode::Auto);
    assert_eq!(c.source.auto.probe_interval, Duration::from_secs(30));
    let c = load_str(&format!("{auto}[relay]\nmark = \"delete\"\n")).unwrap();
    assert_eq!(c.relay.mark, MarkMode::Delete);

    let e = err(&format!("{auto}[relay]\nmark = \"none\"\n"));
    assert!(
        e.contains("source.mode: \"auto\" needs relay.mark = \"update\", \"delete\" or \"ranges\""),
        "{e}"
    );
    // One problem, not a second one about mark = "none" without CDC.
    assert!(!e.contains("relay.mark:"), "{e}");

    let e = err(&format!("{auto}[source.auto]\nprobe_interval = \"10ms\"\n"));
    assert!(
        e.contains("source.auto.probe_interval: ") && e.contains("out of range"),
        "{e}"
    );
    // What CDC refuses, auto refuses too: it may read by CDC.
    let e = err(&format!("{auto}[relay]\nshards = 2\n"));
    assert!(e.contains("relay.shards"), "{e}");
    let e = err(&format!("{auto}[dead_letter]\naggregate = \"wait\"\n"));
    assert!(e.contains("dead_letter.aggregate"), "{e}");
}

/// Unset, `relay.mark` is the outbox's to choose (`ops::marking`); until it
/// chose, the marking in force is `update`. Set, it is what it says, from
/// the file or the environment.
#[test]
fn mark_unset_is_chosen_by_the_outbox() {
    let c = load_str(MINIMAL).unwrap();
    assert!(c.mark_chosen_by_outbox());
    assert_eq!(
        (c.relay.mark_setting, c.relay.mark),
        (None, MarkMode::Update)
    );
    let c = load_str(&format!("{MINIMAL}\n[relay]\nmark = \"update\"\n")).unwrap();
    assert!(!c.mark_chosen_by_outbox());
    assert_eq!(c.relay.mark_setting, Some(MarkMode::Update));
    let env = [("OUTBOX_RELAY__RELAY__MARK", "ranges")];
    let c = super::load::load_str_with_env(MINIMAL, &env).unwrap();
    assert_eq!(
        (c[0].relay.mark_setting, c[0].relay.mark),
        (Some(MarkMode::Ranges), MarkMode::Ranges)
    );
}

//! The NOTIFY trigger that wakes a polling relay.

use super::{Mark, Report};
use crate::config::Config;
use crate::source::polling::notify_channel;

/// The NOTIFY trigger: wanted when polling with `notify = true`, in the
/// way otherwise (it serialises the commits of inserting transactions).
pub(super) async fn check_wakeups(
    config: &Config,
    client: &tokio_postgres::Client,
    r: &mut Report,
) {
    let table = &config.outbox.table;
    let polling = &config.source.polling;
    // The channel is the trigger's one argument (NUL-terminated).
    let notifies: Option<String> = client
        .query_opt(
            "SELECT tgargs FROM pg_trigger WHERE tgrelid = to_regclass($1) AND tgname = 'outbox_relay_notify'",
            &[&table.quoted()],
        )
        .await
        .ok()
        .flatten()
        .map(|row| {
            let args: Vec<u8> = row.get(0);
            let channel = args.split(|b| *b == 0).next().unwrap_or_default();
            String::from_utf8_lossy(channel).into_owned()
        });
    let found = notifies.is_some();
    let every = humantime::format_duration(polling.poll_interval);
    let wanted = notify_channel(polling, table).filter(|_| config.source.mode.may_poll());
    match (wanted, found) {
        (Some(channel), true) if notifies.as_deref() != Some(channel.as_str()) => r.add(
            Mark::Warn,
            "wake-ups",
            format!(
                "the insert trigger notifies channel {}, and the relay listens on {channel}: new rows wait up to \
                 source.polling.poll_interval ({every}); run `outbox-relay migrate`",
                notifies.as_deref().unwrap_or_default()
            ),
        ),
        (Some(channel), true) => r.add(
            Mark::Ok,
            "wake-ups",
            format!("insert trigger notifies channel {channel}"),
        ),
        (Some(_), false) => r.add(
            Mark::Warn,
            "wake-ups",
            format!(
                "no insert trigger: new rows wait up to source.polling.poll_interval ({every}); run `outbox-relay migrate`"
            ),
        ),
        (None, true) => r.add(
            Mark::Warn,
            "wake-ups",
            "the insert trigger outbox_relay_notify is installed but the relay does not listen: \
             its NOTIFY makes inserting transactions commit one at a time; run `outbox-relay migrate` to drop it"
                .to_owned(),
        ),
        (None, false) if config.source.mode.may_poll() && polling.notify_channel.is_some() => r.add(
            Mark::Warn,
            "wake-ups",
            format!(
                "source.polling.notify_channel is set but source.polling.notify is false, so the relay \
                 does not listen and reads the table every {every} while idle; set notify = true, or \
                 remove notify_channel"
            ),
        ),
        (None, false) if config.source.mode.may_poll() => r.add(
            Mark::Ok,
            "wake-ups",
            format!("none: the table is read every {every} while idle (source.polling.poll_interval)"),
        ),
        (None, false) => {}
    }
}

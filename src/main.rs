use clap::Parser;
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    outbox_relay::cli::main(outbox_relay::cli::Cli::parse()).await
}

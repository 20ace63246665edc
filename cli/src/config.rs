//! `oogc config`: the config reference (`--reference`, Markdown) and a commented example config
//! (`--example`, TOML), both generated from the config types' doc comments
//! ([`oogc::config::reference`]).

use std::io::Write as _;

use anyhow::Context;
use clap::Args;
use oogc::config::reference;

/// `oogc config --reference | --example`.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub(crate) struct ConfigCmd {
    /// Print the config reference as Markdown: every `[table] key` with its type, unit, default
    /// and meaning (what the book's docs/src/reference/config.md holds).
    #[arg(long)]
    reference: bool,
    /// Print a commented TOML config with every table and key: required keys set to example
    /// values, the others commented out at their default. Loads as written.
    #[arg(long)]
    example: bool,
}

/// Writes the reference or the example to stdout.
pub(crate) fn run(cmd: &ConfigCmd) -> anyhow::Result<()> {
    let text = if cmd.reference { reference::reference_markdown() } else { reference::example_toml() };
    std::io::stdout().lock().write_all(text.as_bytes()).context("writing to stdout")
}

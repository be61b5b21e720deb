//! `trellis-dev bench`: each bench in a module of its own; this only starts the one asked for.

use std::process::ExitCode;

use anyhow::{Context, Result};

use crate::args::BenchCommand;

pub fn run(cmd: BenchCommand) -> Result<ExitCode> {
    match cmd {
        BenchCommand::Compile(a) => crate::compilebench::run(&a),
        BenchCommand::Enrol(a) => match &a.mesh {
            Some(dir) => runtime()?.block_on(crate::storm::run(&a, dir)),
            None => runtime()?.block_on(crate::enrolbench::run(&a)),
        },
        BenchCommand::Certs(a) => runtime()?.block_on(crate::certs::run(&a)),
        BenchCommand::Agent(a) => crate::agentbench::run(&a),
        BenchCommand::Apply(a) => runtime()?.block_on(crate::applybench::run(&a)),
        BenchCommand::Delivery(a) => match &a.mesh {
            Some(dir) => runtime()?.block_on(crate::fleet::run(&a, dir)),
            None => runtime()?.block_on(crate::delivery::run(&a)),
        },
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("cannot start the tokio runtime")
}

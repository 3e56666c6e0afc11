//! The `kvprobe` command line: a thin layer over the library.
#![deny(unsafe_code)]

mod cli;

use clap::{CommandFactory, FromArgMatches};
use cli::*;

fn main() {
    // A write past `ulimit -f` is an error (EFBIG) kvprobe reports, not a signal that kills it.
    kvprobe::interrupt::ignore_file_size_signal();
    // A watchdog that ends the process (an expired deadline) does it without the library
    // destructors that can crash at exit.
    kvprobe::deadline::set_exit(kvprobe::nixl::exit_now);
    let cmd = Cli::command().mut_subcommand("run", |c| c.mut_arg("race", |a| a.long_help(race_help())));
    let matches = cmd.get_matches();
    // Flags typed on the command line (not defaults): load flags make no sense in a sweep,
    // nor sweep flags in a scenario.
    let typed: Vec<String> = match matches.subcommand() {
        Some(("run", m)) => {
            typed_flags(m, [group_ids("run", "LoadArgs"), group_ids("run", "sweep"), group_ids("run", "device")].concat())
        }
        // A GPU typed with --memory dram is refused even when it is the default one.
        Some(("bench" | "serve", m)) => typed_flags(m, ["device".to_string()]),
        Some(("ab", m)) => typed_flags(m, group_ids("ab", "device")),
        _ => Vec::new(),
    };
    let typed: Vec<&str> = typed.iter().map(String::as_str).collect();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    // The environment NIXL and UCX read, set while this process has one thread (the
    // watchdog, the spinner, CUDA and UCX start theirs later).
    if let Some(plan) = env_plan(&cli.command) {
        kvprobe::nixl::set_process_env(plan);
    }
    if !matches!(&cli.command, Command::Serve(a) if a.fd.is_some()) {
        // What killed kvprobes left in their private directories (SIGKILL, a crash); the
        // prefill process of --decode-process leaves that to its parent.
        kvprobe::tempdir::sweep_stale();
    }
    let exit = match cli.command {
        Command::Run(a) => run(a, &typed),
        Command::Ab(a) => ab(a, &typed),
        Command::Bench(a) => bench(a, &typed),
        Command::Env { json, no_probe } => env(json, !no_probe),
        Command::Geometry { geo, json } => geometry_command(&geo, json),
        Command::Serve(a) => serve(a, &typed),
        Command::Report(c) => report_command(c),
        Command::Bundle { report, dump, redact, output } => bundle_command(&report, dump.as_deref(), redact, &output),
    };
    // Not a plain return: see `exit_now` (library destructors can crash at exit).
    kvprobe::nixl::exit_now(exit as u8)
}

//! The `trellis-agent` binary: everything is in the `trellis-agent` library.

fn main() -> std::process::ExitCode {
    trellis_agent::main()
}

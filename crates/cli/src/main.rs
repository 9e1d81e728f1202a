//! The `dmover` command (see the library, `src/lib.rs`).

fn main() {
    dmover_cli::main()
}

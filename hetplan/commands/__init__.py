"""One module per command. Each defines HELP, add_arguments(parser) and main(args) -> int.

Modules keep heavy imports (torch, pandas) inside main() so `hetplan --help` stays fast."""

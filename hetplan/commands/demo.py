"""`hetplan demo` (to be written)."""
HELP = "demo (not yet available)"


def add_arguments(p):
    pass


def main(args) -> int:
    raise SystemExit("hetplan demo: not yet available")

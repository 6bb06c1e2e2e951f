"""`hetplan simulate` (to be written)."""
HELP = "simulate (not yet available)"


def add_arguments(p):
    pass


def main(args) -> int:
    raise SystemExit("hetplan simulate: not yet available")

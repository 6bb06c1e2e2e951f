"""`hetplan compare` (to be written)."""
HELP = "compare (not yet available)"


def add_arguments(p):
    pass


def main(args) -> int:
    raise SystemExit("hetplan compare: not yet available")

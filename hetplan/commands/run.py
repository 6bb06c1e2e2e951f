"""`hetplan run` (to be written)."""
HELP = "run (not yet available)"


def add_arguments(p):
    pass


def main(args) -> int:
    raise SystemExit("hetplan run: not yet available")

"""`hetplan graph` (to be written)."""
HELP = "graph (not yet available)"


def add_arguments(p):
    pass


def main(args) -> int:
    raise SystemExit("hetplan graph: not yet available")

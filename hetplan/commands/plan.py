"""`hetplan plan` (to be written)."""
HELP = "plan (not yet available)"


def add_arguments(p):
    pass


def main(args) -> int:
    raise SystemExit("hetplan plan: not yet available")

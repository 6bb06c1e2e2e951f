"""`hetplan profile` (to be written)."""
HELP = "profile (not yet available)"


def add_arguments(p):
    pass


def main(args) -> int:
    raise SystemExit("hetplan profile: not yet available")

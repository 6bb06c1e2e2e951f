"""The `hetplan` command line: commands are registered in `hetplan.cli`."""
__version__ = "0.1.0"

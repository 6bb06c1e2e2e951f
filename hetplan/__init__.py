"""hetplan: plan, run and train heterogeneous parallel training.

The command line's commands are registered in `hetplan.cli`; `hetplan.train` trains with a plan
from Python (hetplan.api).
"""
__version__ = "0.1.0"


def train(*args, **kwargs):
    """Train with a plan: see hetplan.api.train."""
    from hetplan.api import train as _train
    return _train(*args, **kwargs)

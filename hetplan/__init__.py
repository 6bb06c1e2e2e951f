"""hetplan: plan, run and train heterogeneous parallel training.

The command line's commands are registered in `hetplan.cli`; `hetplan.train` trains with a plan
from Python (hetplan.api); `hetplan.Workload` is what a model factory returns.
"""
__version__ = "0.1.0"


def train(*args, **kwargs):
    """Train with a plan: see hetplan.api.train."""
    from hetplan.api import train as _train
    return _train(*args, **kwargs)


def __getattr__(name: str):
    if name == "Workload":   # lazily: `import hetplan` stays light (no torch) for the command line
        from hetplan.planner.workload import Workload
        return Workload
    raise AttributeError(f"module 'hetplan' has no attribute {name!r}")

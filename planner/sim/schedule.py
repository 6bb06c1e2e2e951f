"""The schedules moved to planner.files.schedule (planner/cost reads them too, below sim); this
name stays for runtime/, which imports it, until runtime/ imports the new one."""
from planner.files.schedule import *  # noqa: F401,F403
from planner.files.schedule import __all__  # noqa: F401

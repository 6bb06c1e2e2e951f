"""The schedules moved to hetplan.planner.files.schedule (hetplan/planner/cost reads them too, below sim); this
name stays for hetplan/runtime/, which imports it, until hetplan/runtime/ imports the new one."""
from hetplan.planner.files.schedule import *  # noqa: F401,F403
from hetplan.planner.files.schedule import __all__  # noqa: F401

"""The files that pass between commands: plan, measured, report, plot; JSON I/O."""

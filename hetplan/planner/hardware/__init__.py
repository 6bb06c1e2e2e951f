"""The hardware side: topology, calibration and fits, topology lookup, torch devices."""

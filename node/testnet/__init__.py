"""Local multi-process swarms, calibration and workloads."""

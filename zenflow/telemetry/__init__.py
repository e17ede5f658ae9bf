"""Run telemetry: NVML sampling (GPU hosts) and environment capture for run records."""

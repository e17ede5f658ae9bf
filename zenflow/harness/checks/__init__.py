"""Checks before and around runs: argument checks, preflight, and the checks of `make gpu-check`."""

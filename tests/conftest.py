"""Test-suite wiring: pytester for testing the conformance plugin in throwaway projects."""

pytest_plugins = ["pytester"]

"""The command line, the demo, profiling, the pytest plugin."""

"""Measurement: the profiler (clocks and memory), the report (schema, table, chart) and the optimization record."""

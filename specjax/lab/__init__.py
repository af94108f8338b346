"""specjax's measuring code: benchmarks, the reproduce tables, profilers and HLO checks.

The library's core (decoding, drafters, models, training) imports nothing from here: what
measures a run sits above what runs.
"""

"""The optimisation engine: targets describe candidates; the engine builds, measures side by side,
chooses by objective within the accuracy budget and records every candidate (see ``engine``).

Importing this package loads no ML SDK; candidate builders import theirs when they run.
"""

"""Hardware-in-the-loop scenarios on labgrid: `pytest hil/ --lg-env hil/boards/NAME.yaml` (docs/hil.md)."""

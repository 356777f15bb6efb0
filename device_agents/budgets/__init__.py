"""Memory, power and thermal budgets of the agent.

- ``sysfs``: reading the kernel's one-value files (a missing file or a garbage value is a
  reader that is not available, logged once, never a crash).
- ``energy``: energy meters, each chosen when its sensors are present (Linux powercap/RAPL,
  Jetson INA3221 rails through hwmon, NVIDIA GPUs through NVML), and an energy *model* (CPU busy
  time x ``device_power_w``) where none is; ``pick_meter`` chooses.
- ``thermal``, ``power_supply``, ``nvpmodel``: thermal zones and trip points, battery and AC,
  the Jetson power mode.
- ``power``: the power budget as an energy bucket, and the degradation level with hysteresis
  that the bucket and the thermal headroom drive.
- ``memory``: admission of model loads against ``[budgets] memory_mb`` (the agent's whole RSS).

Every reader takes a ``root`` (default ``/``) so that it runs on a fixture tree that copies a
platform's sysfs layout.
"""
